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


def test_a_run_continuing_another_runs_draft_is_plotted_after_its_minutes(tmp_path, monkeypatch):
    """draft.init=pretrained from runs/full/draft: the continuation's α belongs at full's minutes + its own."""
    import json

    import yaml

    monkeypatch.chdir(tmp_path)
    for name, minutes, draft in (("full", 75.0, {"init": "fresh"}),
                                 ("cont", 40.0, {"init": "pretrained", "path": "runs/full/draft"})):
        run = Path("runs") / name
        run.mkdir(parents=True)
        (run / "config.yaml").write_text(yaml.safe_dump({"draft": draft, "train": {"loss": "jsd",
                                                                                  "data_mode": "cache"}}))
        (run / "metrics.json").write_text(json.dumps({"steps": 2, "elapsed_s": minutes * 60}))
        (run / "train_metrics.csv").write_text("elapsed_s,step\n60.0,2\n")
        (run / "eval_metrics.csv").write_text("alpha_greedy,step\n0.4,0\n0.45,2\n")
        (Path("runs") / name / "eval").mkdir()
        (Path("runs") / name / "eval" / "config.yaml").write_text(yaml.safe_dump({
            "draft": [f"runs/{name}/draft"], "name": [name], "output_dir": f"runs/{name}/eval"}))
    reports = [(Path("runs") / name / "eval", {"drafts": {name: _report({})["drafts"]["ce"]}}) for name in ("full", "cont")]

    assert [p["minutes"] for p in results.acceptance_points(reports)] == [75.0, 115.0]
    curves = results.training_curves([(Path("runs") / name, {}) for name in ("full", "cont")])
    assert [c["minutes"] for c in curves] == [[0.0, 1.0], [75.0, 76.0]]


def test_write_keeps_rows_and_points_of_folders_not_on_this_machine(tmp_path, monkeypatch):
    """Run folders are git-ignored: regenerating on another machine must not drop the page's earlier rows."""
    import json

    import yaml

    monkeypatch.chdir(tmp_path)
    here = Path("runs") / "here"
    here.mkdir(parents=True)
    (here / "config.yaml").write_text(yaml.safe_dump({"train": {"objective": "distill", "loss": "fkl"},
                                                      "draft": {"init": "fresh", "num_layers": 2, "hidden_size": 8}}))
    (here / "metrics.json").write_text(json.dumps({"steps": 7, "elapsed_s": 60.0, "loss_tokens": 100,
                                                   "sizes": {"ratio_total": 0.1}}))
    gone_run = "| `runs/gone` | ce | 10.0% (fresh, 2 × 8) | 5 | 1.0 | 50 | — | `python train.py` |"
    gone_eval = "| `runs/gone/eval` | ce | 10.0% | 0.300 | 0.200 | 1.40 | 0.100 | 1 (0.90×) | `python eval.py` |"
    gone_category = "| `runs/gone/eval` ce | 0.310 | 0.290 |"
    gone_sweep = "`runs/gone-sweep`: best 2x8 (10.0%) at γ=3, measured 1.10× (expected 1.20×); table `x`, heatmap `y`"
    gone_bench = ["6 prompts, batch 1 — `python scripts/bench_decode.py --target t --draft d --out runs/gone-bench`", "",
                  "| method | median tok/s |", "|---|---|", "| ours target-only | 19.4 |"]
    stale_here = "| `runs/here` | kd / fkl | 10.0% (fresh, 2 × 8) | 3 | 0.5 | 10 | — | `old command` |"
    old_section = "\n".join([
        results.BEGIN, "", "Generated from `runs`.", "", *results.training_section([])[:4], gone_run, stale_here, "",
        *results.acceptance_section([])[:4], gone_eval, "", "Greedy α by MT-bench category:", "",
        "| draft | coding | math |", "|---|---|---|", gone_category, "",
        results.BENCH_TITLE, "", *gone_bench, "",
        "### Draft-size × γ sweeps (scripts/sweep.py)", "", gone_sweep, "", results.END])
    page = Path("results.md")
    page.write_text("# Results\n\nhand-written analysis\n\n" + old_section + "\n\nmore analysis\n")
    (Path("alpha_vs_minutes.json")).write_text(json.dumps({"points": [
        {"minutes": 1.0, "alpha": 0.3, "alpha_t1": 0.2, "recipe": "ce / generated", "run": "runs/gone",
         "report": "runs/gone/eval"}], "curves": []}))

    assert results.main(["runs", "--write", str(page)]) == 0
    text = page.read_text()
    lines = text.splitlines()
    assert text.startswith("# Results\n\nhand-written analysis") and text.endswith("more analysis\n")
    for line in (gone_run, gone_eval, gone_category, gone_sweep):
        assert lines.count(line) == 1, line
    at = lines.index(gone_bench[0])
    assert lines[at:at + len(gone_bench)] == gone_bench and lines.count(gone_bench[0]) == 1
    assert results.BENCH_TITLE in lines[:at]
    assert stale_here not in lines  # a folder that is here is regenerated, not carried
    fresh_here = next(line for line in lines if line.startswith("| `runs/here` |"))
    assert "| 7 | 1.0 | 100 |" in fresh_here
    # Each carried row sits in its own table: right after that table's header rule or its rows.
    assert lines[lines.index(gone_run) - 1] == fresh_here
    assert lines[lines.index(gone_category) - 1] == "|---|---|---|"
    assert "kept from the page before" in text
    assert json.loads(Path("alpha_vs_minutes.json").read_text())["points"][0]["run"] == "runs/gone"
    assert Path("alpha_vs_minutes.png").stat().st_size > 1000

    assert results.main(["runs", "--write", str(page)]) == 0
    assert page.read_text() == text  # idempotent: carried rows are not carried twice


def test_bench_section_adds_the_fastest_target_only_column_only_where_rows_have_it():
    row = {"method": "bf16 ours target-only", "median_tokens_per_s": 18.2, "vs_target_only": 1.0, "vs_hf": 0.98,
           "greedy_identical": True}
    old = {"title": "old", "command": "c", "hf_baseline": "HF assisted (γ=1)", "rows": [row]}
    new = {**old, "title": "new", "rows": [{**row, "vs_best_target_only": 0.91}]}
    lines = results.bench_section([(Path("runs/old"), old), (Path("runs/new"), new)])
    assert "| bf16 ours target-only | 18.2 | 1.00× | 0.98× | yes |" in lines
    assert "| bf16 ours target-only | 18.2 | 1.00× | 0.98× | 0.91× | yes |" in lines
    assert sum("vs fastest target-only" in line for line in lines) == 1
