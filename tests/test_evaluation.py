import json
import sys
from pathlib import Path

import pytest
import torch

from specdistill.acceptance import greedy_block_acceptance, per_position_acceptance, token_acceptance
from specdistill.evaluation import evaluate_draft, main, parse_gammas

ROOT = Path(__file__).resolve().parent.parent


def test_identical_draft_gives_alpha_one_and_full_tau():
    logits = [torch.randn(20, 17), torch.randn(9, 17)]
    r = evaluate_draft(logits, logits, ["a", "b"], [0, 1.0], [1, 3, 5])
    assert r["alpha"]["0"] == 1.0 and r["alpha"]["1.0"] == pytest.approx(1.0)
    # Full blocks except where a sequence ends mid-block.
    assert r["tau"]["0/1"] == pytest.approx(2.0)
    assert r["tau"]["1.0/5"] == pytest.approx(6.0)
    assert r["per_position_greedy"] == [1.0] * 5


def test_disjoint_draft_gives_zero_and_tau_one():
    target = torch.full((12, 6), -1e9)
    target[:, 0] = 0
    draft = torch.full((12, 6), -1e9)
    draft[:, 5] = 0
    r = evaluate_draft([target], [draft], ["x"], [0, 1.0], [4])
    assert r["alpha"]["0"] == 0.0 and r["alpha"]["1.0"] == pytest.approx(0.0, abs=1e-6)
    assert r["tau"]["0/4"] == 1.0 and r["tau"]["1.0/4"] == pytest.approx(1.0)


def test_parse_gammas():
    assert parse_gammas("1..4") == [1, 2, 3, 4]
    assert parse_gammas("2,5") == [2, 5]


def test_evaluate_module_matches_library():
    import evaluate

    metric = evaluate.load(str(ROOT / "metrics" / "acceptance_rate"))
    torch.manual_seed(0)
    p, q = torch.randn(30, 11), torch.randn(30, 11)
    p[::2] = q[::2] * 3  # agree on every other position
    result = metric.compute(predictions=[q.argmax(-1).tolist()], references=[p.argmax(-1).tolist()], gamma=3,
                            target_logits=[p.numpy()], draft_logits=[q.numpy()], temperature=1.0)
    agree = token_acceptance(p, q, 0.0)
    assert result["alpha_greedy"] == pytest.approx(agree.mean().item())
    assert result["per_position"] == pytest.approx(per_position_acceptance(greedy_block_acceptance(agree, 3), 3),
                                                   nan_ok=True)
    assert result["alpha"] == pytest.approx(token_acceptance(p, q, 1.0).mean().item())


def test_eval_cli_writes_report(tiny_pair_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": i, "category": c, "prompt": t}) for i, (c, t) in
                                 enumerate([("writing", "Write a poem"), ("math", "What is 2+2?"), ("writing", "Hi")])))
    out = tmp_path / "report"
    monkeypatch.setattr(sys, "argv", ["eval.py"])
    assert main(["--target", str(tiny_pair_dir / "target"), "--draft", str(tiny_pair_dir / "draft"),
                 "--draft", str(tiny_pair_dir / "target"), "--name", "draft", "--name", "self",
                 "--prompts", str(prompts), "--max-new-tokens", "6", "--gamma", "1..3",
                 "--output-dir", str(out)]) == 0
    report = json.loads((out / "metrics.json").read_text())
    assert report["drafts"]["self"]["alpha"]["0"] == 1.0
    assert report["drafts"]["self"]["tau"]["0/3"] > 1.0
    assert set(report["drafts"]["draft"]["alpha_by_category"]["0"]) == {"writing", "math"}
    for name in ("report.md", "acceptance_by_position.png", "tau_speedup_vs_gamma.png", "alpha_by_category.png",
                 "config.yaml", "run.json"):
        assert (out / name).is_file(), name


def test_paired_cost_ratio_ranks_a_shallow_draft_below_the_target_itself(tiny_tokenizer):
    """c from alternating steps: a 1-layer draft costs less than the 8-layer target does against itself."""
    from conftest import make_llama

    from specdistill.evaluation import paired_cost_ratio

    target = make_llama(len(tiny_tokenizer), layers=8, seed=0)
    draft = make_llama(len(tiny_tokenizer), layers=1, seed=1)
    with torch.inference_mode():
        step, c_draft = paired_cost_ratio(draft, target, context=16, repeats=9)
        _, c_self = paired_cost_ratio(target, target, context=16, repeats=9)
    assert step > 0 and 0 < c_draft < c_self
    assert 0.5 < c_self < 2.0  # the same model on both sides: the ratio is 1 up to timing noise


def test_paired_verify_cost_grows_with_the_block_and_is_near_one_for_a_single_extra_token(tiny_tokenizer):
    """v(γ) from alternating steps: a 300-token verify costs clearly more than one token; v(1) is ≈ 1."""
    from conftest import make_llama

    from specdistill.evaluation import paired_verify_cost

    target = make_llama(len(tiny_tokenizer), hidden=256, layers=4, seed=0)
    with torch.inference_mode():
        verify = paired_verify_cost(target, [1, 300], context=16, repeats=9)
    assert set(verify) == {1, 300}
    assert 0.5 < verify[1] < 2.5
    assert verify[300] > 2 * verify[1]
