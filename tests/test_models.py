import pytest
import torch
from conftest import make_llama, make_tokenizer

from specdistill.config import DraftConfig
from specdistill.models import PairMismatchError, build_draft, check_pair, count_params, size_report


def test_param_count_counts_tied_weights_once():
    tied = make_llama(300, hidden=32, layers=2, tie=True)
    untied = make_llama(300, hidden=32, layers=2, tie=False)
    by_hand = sum(p.numel() for p in tied.parameters())  # parameters() already de-duplicates ties
    assert count_params(tied).total == by_hand
    assert count_params(tied).embedding == 300 * 32
    assert count_params(untied).total == count_params(tied).total + 300 * 32
    assert count_params(untied).embedding == 2 * 300 * 32


def test_draft_from_target_layers_reproduces_target_when_all_layers_copied(tiny_target):
    draft = build_draft(tiny_target, DraftConfig(init="target_layers", layers=[0, 1]))
    x = torch.randint(0, tiny_target.config.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.allclose(draft(x).logits, tiny_target(x).logits, atol=1e-5)
    ratio = size_report(draft, tiny_target)["ratio_total"]
    assert ratio == pytest.approx(1.0)


def test_projected_draft_is_narrower_and_finite(tiny_target):
    narrow = build_draft(tiny_target, DraftConfig(init="target_layers", layers=[0], hidden_size=32,
                                                  embedding="project", intermediate_size=64))
    assert narrow.config.hidden_size == 32 and narrow.config.num_hidden_layers == 1
    assert narrow.model.layers[0].mlp.gate_proj.weight.shape == (64, 32)
    assert count_params(narrow).total < count_params(tiny_target).total
    x = torch.randint(0, tiny_target.config.vocab_size, (1, 7))
    with torch.no_grad():
        assert torch.isfinite(narrow(x).logits).all()
    fresh = build_draft(tiny_target, DraftConfig(init="fresh", num_layers=2, hidden_size=32, embedding="project"))
    assert fresh.config.hidden_size == 32 and fresh.config.num_attention_heads == 2
    with pytest.raises(ValueError, match="embedding=project"):
        build_draft(tiny_target, DraftConfig(init="fresh", hidden_size=32, embedding="copy"))
    with pytest.raises(ValueError, match="out of range"):
        build_draft(tiny_target, DraftConfig(init="target_layers", layers=[5]))


def test_pair_check_accepts_same_tokenizer_and_names_mismatches(tiny_tokenizer):
    check_pair(tiny_tokenizer, tiny_tokenizer)
    smaller = make_tokenizer(vocab_size=300)
    with pytest.raises(PairMismatchError, match="tokenizer size mismatch"):
        check_pair(tiny_tokenizer, smaller)
    a, b = make_llama(len(tiny_tokenizer)), make_llama(len(tiny_tokenizer) + 4)
    with pytest.raises(PairMismatchError, match="vocab_size=.*vocab_size="):
        check_pair(tiny_tokenizer, tiny_tokenizer, a.config, b.config)
    swapped = make_tokenizer(special=("<|endoftext|>", "<|im_end|>", "<|im_start|>"))
    with pytest.raises(PairMismatchError, match="token->id mismatch: target maps '<\\|im_start\\|>'"):
        check_pair(tiny_tokenizer, swapped)


def test_fresh_draft_heads_always_group_evenly():
    # SmolLM2's grouping (9 heads in 3 groups, head_dim 64) at width 448 gives 7 heads: 7 // 3 = 2 kv heads
    # would not divide 7, and attention failed mid-training (seen in a real sweep).
    target = make_llama(1000, hidden=576, layers=1, heads=9, kv_heads=3)  # vocab ≥ width for the SVD basis
    draft = build_draft(target, DraftConfig(init="fresh", num_layers=1, hidden_size=448, embedding="project"))
    assert draft.config.num_attention_heads == 7 and draft.config.num_key_value_heads == 1
    x = torch.randint(0, 1000, (2, 5))
    with torch.no_grad():
        assert torch.isfinite(draft(x).logits).all()
    kept = build_draft(target, DraftConfig(init="fresh", num_layers=1, hidden_size=384, embedding="project"))
    assert (kept.config.num_attention_heads, kept.config.num_key_value_heads) == (6, 2)
    with pytest.raises(ValueError, match="must divide"):
        build_draft(target, DraftConfig(init="fresh", num_layers=1, hidden_size=448, embedding="project",
                                        num_key_value_heads=2))
