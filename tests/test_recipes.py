import json
import sys
from pathlib import Path

import pytest
import yaml
from test_trainer import overrides

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import recipes


def test_recipes_train_each_objective_then_one_eval_and_resume(tiny_pair_dir, conversations, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": i, "category": c, "prompt": t})
                                 for i, (c, t) in enumerate([("writing", "Write a poem"), ("math", "What is 2+2?")])))
    out = tmp_path / "recipes"
    argv = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--recipes", "ce,fkl,tvd", "--minutes", "5",
            "--prompts", str(prompts), "--num-prompts", "2", "--max-new-tokens", "6", "--gammas", "1..3",
            "--out", str(out), *overrides(tiny_pair_dir, conversations, out / "unused", "train.eval_prompts=0",
                                          "train.max_steps=4")]
    assert recipes.main(argv) == 0
    state = json.loads((out / "recipes.json").read_text())
    assert [r["recipe"] for r in state["rows"]] == ["init", "ce", "fkl", "tvd"]
    for name in ("ce", "fkl", "tvd"):
        assert state["runs"][name]["steps"] == 4  # the trailing override capped the clock budget
        assert yaml.safe_load((out / name / "config.yaml").read_text())["train"]["max_minutes"] == 5
    assert yaml.safe_load((out / "ce" / "config.yaml").read_text())["train"]["objective"] == "ce"
    assert yaml.safe_load((out / "tvd" / "config.yaml").read_text())["train"]["loss"] == "tvd"
    ce = next(r for r in state["rows"] if r["recipe"] == "ce")
    assert ce["tau_vs_ce"] == 0.0
    report = json.loads((out / "eval" / "metrics.json").read_text())
    assert set(report["drafts"]) == {"init", "ce", "fkl", "tvd"}
    assert set(report["drafts"]["fkl"]["alpha_by_category"]["0"]) == {"writing", "math"}
    assert (out / "recipes.png").stat().st_size > 0 and "best at equal budget" in (out / "recipes.md").read_text()

    # Resume: nothing is retrained or re-evaluated.
    stamps = {p: p.stat().st_mtime_ns for p in [out / "fkl" / "draft" / "config.json", out / "eval" / "metrics.json"]}
    assert recipes.main(argv) == 0
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps


def test_recipes_reject_an_unknown_name(tmp_path):
    with pytest.raises(SystemExit, match="unknown"):
        recipes.main(["--config", str(ROOT / "configs" / "tiny.yaml"), "--recipes", "ce,kd", "--out", str(tmp_path)])
