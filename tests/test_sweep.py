import json
import sys
from pathlib import Path

from test_trainer import overrides

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import sweep


def test_sweep_grid_table_heatmap_and_resume(tiny_pair_dir, conversations, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": i, "category": "writing", "prompt": t})
                                 for i, t in enumerate(["Write a poem", "What is 2+2?"])))
    out = tmp_path / "sweep"
    argv = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--sizes", "1x32,2x32", "--gammas", "1..3",
            "--prompts", str(prompts), "--num-prompts", "2", "--max-new-tokens", "6", "--measure-prompts", "1",
            "--measure-tokens", "8", "--out", str(out), *overrides(tiny_pair_dir, conversations, out / "unused",
                                                              "train.eval_prompts=0")]
    assert sweep.main(argv) == 0
    state = json.loads((out / "sweep.json").read_text())
    assert len(state["rows"]) == 6 and set(state["measured"]) == {f"{s}/{g}" for s in ("1x32", "2x32") for g in (1, 2, 3)}
    assert all(r["greedy_identical"] for r in state["rows"])
    assert state["best"]["measured"] == max(r["measured"] for r in state["rows"])
    ratios = {r["size"]: r["ratio"] for r in state["rows"]}
    assert ratios["1x32"] < ratios["2x32"]  # the sizes really differ
    assert (out / "sweep.png").stat().st_size > 0 and "best:" in (out / "sweep.md").read_text()

    # Resume: nothing is retrained or re-evaluated; only the cell removed from the state is measured again.
    stamps = {p: p.stat().st_mtime_ns for p in [out / "size-1x32" / "draft" / "config.json", out / "eval" / "metrics.json"]}
    kept = state["measured"]["1x32/1"]
    del state["measured"]["2x32/3"]
    (out / "sweep.json").write_text(json.dumps(state))
    assert sweep.main(argv) == 0
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    again = json.loads((out / "sweep.json").read_text())
    assert again["measured"]["1x32/1"] == kept and "2x32/3" in again["measured"]

    # The results page is regenerated from these run folders, between its markers only.
    import results

    page = tmp_path / "results.md"
    page.write_text(f"# Results\n\nhand-written analysis\n\n{results.BEGIN}\nstale\n{results.END}\n\nmore prose\n")
    assert results.main([str(out), "--write", str(page)]) == 0
    text = page.read_text()
    assert "hand-written analysis" in text and "more prose" in text and "stale" not in text
    report = json.loads((out / "eval" / "metrics.json").read_text())
    alpha = report["drafts"]["2x32"]["alpha"]["0"]
    assert f"| 2x32 | {report['drafts']['2x32']['sizes']['ratio_total']:.1%} | {alpha:.3f} |" in text
    assert "### Training runs" in text and "size-1x32" in text and "python eval.py --target" in text
    assert f"best {again['best']['size']}" in text
    assert results.main([str(out), "--write", str(page)]) == 0 and page.read_text() == text  # idempotent
