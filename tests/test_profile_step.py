"""scripts/profile_step.py on a tiny pair: times the trainer's step with the full and a sampled softmax, and with the
hidden-state term when the config trains with it."""

import json
import sys
from pathlib import Path

from test_trainer import overrides

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import profile_step

from specdistill.config import DistillConfig, load_config
from specdistill.trainer import run


def test_profile_step_times_each_phase_with_the_hidden_state_term(tiny_pair_dir, conversations, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    extra = ["train.data_mode=cache", "generate.teacher_top_k=6", "train.cache_top_k=4", "generate.num_prompts=8",
             "generate.max_new_tokens=8", "generate.batch_size=4", "generate.teacher_hidden_layer=1",
             "train.hidden_weight=1.0", "train.eval_prompts=0", "train.max_steps=1", "draft.num_layers=2",
             "train.head_negatives=8"]
    # The generated set the profile reads (the script refuses to run without one).
    run(load_config(DistillConfig, ROOT / "configs" / "tiny.yaml",
                    overrides(tiny_pair_dir, conversations, tmp_path / "run", *extra)))
    out = tmp_path / "profile"
    assert profile_step.main(["--config", str(ROOT / "configs" / "tiny.yaml"), "--steps", "3", "--vocab", "64",
                              "--out", str(out), *overrides(tiny_pair_dir, conversations, tmp_path / "unused",
                                                            *extra)]) == 0
    report = json.loads((out / "profile.json").read_text())
    assert report["hidden_weight"] == 1.0 and report["steps"] == 3
    assert [r["head_vocab"] for r in report["results"]] == [0, 64]
    for result in report["results"]:
        assert set(result["median_s"]) == set(profile_step.PHASES)
        assert all(seconds > 0 for seconds in result["median_s"].values())
        assert result["step_s"] == sum(result["median_s"].values())
    assert report["results"][1]["median_softmax_size"] < report["results"][0]["median_softmax_size"]
