"""scripts/fit_gap.py on a tiny pair: the target agrees with itself everywhere; a trained draft is measured on both sides."""

import json
import sys
from pathlib import Path

import pytest
from test_trainer import overrides

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import fit_gap

from specdistill.config import DistillConfig, load_config
from specdistill.trainer import run


def test_fit_gap_measures_trained_and_unseen_replies(tiny_pair_dir, conversations, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    extra = ["train.data_mode=generated", "generate.num_prompts=8", "generate.max_new_tokens=8",
             "data.heldout_fraction=0.3", "train.eval_prompts=0", "train.max_steps=2"]
    run(load_config(DistillConfig, ROOT / "configs" / "tiny.yaml",
                    overrides(tiny_pair_dir, conversations, tmp_path / "run", *extra)))
    out = tmp_path / "gap"

    def argv(*more):
        return ["--config", str(ROOT / "configs" / "tiny.yaml"), "--draft", str(tiny_pair_dir / "target"),
                "--draft", str(tmp_path / "run" / "draft"), "--rows", "4", "--out", str(out),
                *overrides(tiny_pair_dir, conversations, tmp_path / "unused", *extra, *more)]

    assert fit_gap.main(argv()) == 0
    drafts = json.loads((out / "fit_gap.json").read_text())["drafts"]
    itself = drafts[str(tiny_pair_dir / "target")]
    assert itself["trained_replies"] == 1.0 and itself["unseen_replies"] == 1.0
    assert itself["trained_positions"] > 0 and itself["unseen_positions"] > 0
    trained = drafts[str(tmp_path / "run" / "draft")]
    assert 0.0 <= trained["trained_replies"] <= 1.0 and 0.0 <= trained["unseen_replies"] <= 1.0
    with pytest.raises(SystemExit):  # another generated set, never made: an error that says so
        fit_gap.main(argv("generate.num_prompts=9"))
