import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import results


def _report(alpha_by_category: dict[str, float]) -> dict:
    draft = {"alpha": {"0": 0.2, "1": 0.1}, "tau": {"0/5": 1.25}, "sizes": {"ratio_total": 0.187},
             "cost_ratio": 0.2, "best_gamma": {"0": 1}, "best_speedup": {"0": 0.9},
             "alpha_by_category": {"0": alpha_by_category}}
    return {"drafts": {"ce": draft}}


def test_category_rows_of_same_named_drafts_in_two_reports_stay_apart(tmp_path):
    short, long = tmp_path / "recipes" / "eval", tmp_path / "recipes-20min" / "eval"
    lines = results.acceptance_section([(short, _report({"coding": 0.111})), (long, _report({"coding": 0.222}))])
    rows = [line for line in lines if line.startswith("| `") and line.count("|") == 3]
    assert rows == [f"| `{short}` ce | 0.111 |", f"| `{long}` ce | 0.222 |"]


def test_acceptance_points_follow_a_renamed_run_folder_and_are_plotted(tmp_path, monkeypatch):
    """A demo folder copied to demo-slowday keeps old draft paths in its eval config: read its own run."""
    import json

    import yaml

    monkeypatch.chdir(tmp_path)  # recorded paths are relative to the repository root
    for name, minutes, loss in (("demo", 10.0, "fkl"), ("demo-slowday", 5.0, "tvd")):
        run = Path("runs") / name / "distill"
        run.mkdir(parents=True)
        (run / "config.yaml").write_text(yaml.safe_dump({"train": {"objective": "distill", "loss": loss,
                                                                    "data_mode": "cache"}}))
        (run / "metrics.json").write_text(json.dumps({"steps": 3, "elapsed_s": minutes * 60}))
        (run / "train_metrics.csv").write_text("elapsed_s,step\n30.0,1\n60.0,2\n")
        (run / "eval_metrics.csv").write_text("alpha_greedy,step\n0.01,0\n0.1,2\n")
        (Path("runs") / name / "eval").mkdir()
        (Path("runs") / name / "eval" / "config.yaml").write_text(yaml.safe_dump({  # as written before the copy
            "target": "t", "draft": ["init:fresh", "runs/demo/distill/draft"], "name": ["init", "distilled"],
            "output_dir": "runs/demo/eval"}))
    reports = []
    for name in ("demo", "demo-slowday"):
        report = _report({})
        report["drafts"] = {"init": report["drafts"]["ce"], "distilled": report["drafts"]["ce"]}
        reports.append((Path("runs") / name / "eval", report))

    points = results.acceptance_points(reports)
    assert [(p["run"], p["minutes"], p["recipe"]) for p in points] == [
        ("runs/demo/distill", 10.0, "fkl / cache"), ("runs/demo-slowday/distill", 5.0, "tvd / cache")]
    curves = results.training_curves([(Path("runs") / name / "distill", {}) for name in ("demo", "demo-slowday")])
    assert [c["minutes"] for c in curves] == [[0.0, 1.0], [0.0, 1.0]] and curves[0]["alpha"] == [0.01, 0.1]
    results.plot_acceptance_vs_minutes(points, curves, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 1000
