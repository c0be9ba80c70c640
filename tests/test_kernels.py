"""The small-batch linear path: same numbers as F.linear up to fp32 rounding, and only where it is asked for."""

import torch
import torch.nn.functional as F

from specdistill import kernels


def test_small_batch_linear_matches_f_linear_for_each_row_count_and_shape():
    torch.manual_seed(0)
    weight, bias = torch.randn(300, 48), torch.randn(300)
    for shape in [(1, 48), (2, 48), (3, 48), (5, 48), (2, 3, 48), (1, 1, 48)]:
        x = torch.randn(*shape)
        for b in (None, bias):
            got = kernels.small_batch_linear(x, weight, b)
            assert got.shape == F.linear(x, weight, b).shape
            torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_prepared_linear_changes_kernels_only_inside_the_context_without_grad(monkeypatch):
    torch.manual_seed(0)
    head = torch.nn.Linear(64, kernels.HEAD_WEIGHT // 64 + 1, bias=False)  # head-sized: the fast path applies
    x = torch.randn(1, 2, 64)
    reference = F.linear(x, head.weight)
    monkeypatch.setitem(kernels._measured, (tuple(head.weight.shape), 2), True)  # as if W·xᵀ had timed faster
    kernels.prepare(kernels.prepare(head))  # idempotent
    with torch.no_grad():
        assert torch.equal(head(x), reference)  # outside the context: F.linear, bit for bit
        with kernels.small_batch_kernels():
            inside = head(x)
        assert torch.equal(inside, kernels.small_batch_linear(x, head.weight))
        torch.testing.assert_close(inside, reference, rtol=1e-5, atol=1e-5)
    with kernels.small_batch_kernels():  # grad enabled (training): F.linear, so autograd is untouched
        out = head(x)
        assert torch.equal(out.detach(), reference) and out.requires_grad


def test_rule_keeps_f_linear_where_it_was_as_fast():
    assert kernels.faster_than_linear(49152 * 576, 1) and kernels.faster_than_linear(49152 * 576, 48)
    assert not kernels.faster_than_linear(49152 * 576, 512)  # a prefill
    assert kernels.faster_than_linear(1536 * 576, 3) and not kernels.faster_than_linear(1536 * 576, 1)
    assert not kernels.faster_than_linear(192 * 576, 3)  # k/v projections


def test_greedy_decoding_on_the_fast_path_matches_hf_generate(monkeypatch):
    """Every linear of a tiny pair forced onto the fast path: speculative greedy still equals target-only
    greedy and HF ``generate`` (which runs outside the context, on F.linear)."""
    from conftest import make_llama

    from specdistill.speculative import SpeculativeGenerator, target_only_generate

    monkeypatch.setattr(kernels, "HEAD_WEIGHT", 0)
    target, draft = make_llama(64, hidden=32, layers=2, seed=0), make_llama(64, hidden=32, layers=1, seed=1)
    for seed in range(3):
        prompt = torch.randint(0, 64, (4 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        hf = target.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, min_new_tokens=20,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert target_only_generate(target, prompt, max_new_tokens=20).tokens == hf
        for gamma in (1, 3, 5):
            assert SpeculativeGenerator(target, draft, gamma=gamma).generate(prompt, 20).tokens == hf


def _bf16_llama(seed: int):
    """A bf16 Llama wide enough (576, as SmolLM2) that oneDNN's one-row GEMV and multi-query SDPA round
    differently from the multi-row GEMM and one-query SDPA: without the row-invariant rules its verify rows
    differ from its one-token steps (checked when this test was written)."""
    from conftest import make_llama

    return make_llama(512, hidden=576, layers=2, heads=9, kv_heads=3, seed=seed).to(torch.bfloat16)


def test_bf16_verify_rows_equal_one_token_steps_bit_for_bit():
    from specdistill.speculative import _CachedModel

    target = _bf16_llama(0)
    tokens = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    stepped = _CachedModel(target, row_invariant=True)
    stepped.feed([tokens[:30]])
    steps = [stepped.feed([[t]])[0][0] for t in tokens[30:]]
    for width in (2, 3, 6, 10):
        verify = _CachedModel(target, row_invariant=True)
        verify.feed([tokens[:30]])
        rows = verify.feed([tokens[30: 30 + width]])[0]
        for i in range(width):
            assert torch.equal(rows[i], steps[i]), f"verify of {width} tokens, row {i}"


def test_row_invariant_target_decodes_as_before_outside_our_loops():
    target = _bf16_llama(0)
    prompt = torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(1))
    before = target.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    kernels.prepare(target, row_invariant=True)
    assert target.config._attn_implementation == kernels.ROWWISE_ATTENTION
    after = target.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(before, after)


def test_bf16_speculative_greedy_is_token_identical_to_bf16_target_only():
    """Lossless in bf16, not only fp32: every γ, a draft that is mostly rejected and one that is always accepted
    (the target itself, so every verify row is used)."""
    from specdistill.speculative import SpeculativeGenerator, target_only_generate

    target, draft = _bf16_llama(0), _bf16_llama(1)
    for seed in range(2):
        prompt = torch.randint(3, 512, (6 + 5 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        reference = target_only_generate(target, prompt, max_new_tokens=24).tokens
        assert len(reference) == 24
        for gamma in (1, 3, 5):
            assert SpeculativeGenerator(target, draft, gamma=gamma).generate(prompt, 24).tokens == reference
        same = SpeculativeGenerator(target, target, gamma=4).generate(prompt, 24)
        assert same.tokens == reference and same.stats["tau"] > 3.0


def test_a_sliding_window_target_keeps_plain_sdpa():
    """The rowwise path drops the mask, which is only right for a purely causal one."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    model = kernels.prepare(MistralForCausalLM(config).eval(), row_invariant=True)
    assert model.config._attn_implementation == "sdpa"


def test_windowed_pool_attention_equals_full_width_attention():
    """A pool's decode step, chunk by chunk over each chunk's slots only, gives what one SDPA call over the whole
    (holey) cache gives: the slots left out are masked ones (right-aligned rows; a row with a hole in the middle,
    a fully visible row and chunks of 1–5 rows included)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    rows, heads, kv_heads, width, dim = 7, 4, 2, 19, 8
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = heads // kv_heads, True
    query = torch.randn(rows, heads, 1, dim)
    key, value = torch.randn(rows, kv_heads, width, dim), torch.randn(rows, kv_heads, width, dim)
    lengths = [3, 4, 19, 12, 6, 6, 1]
    mask = torch.zeros(rows, 1, 1, width, dtype=torch.bool)
    for r, n in enumerate(lengths):
        mask[r, ..., width - n:] = True
    mask[3, ..., 10] = False  # a hole inside a row's span
    reference, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=dim ** -0.5)
    for chunk in (1, 2, 3, 5):
        got, _ = kernels._windowed_sdpa(module, query, key, value, mask, chunk, scaling=dim ** -0.5)
        torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-6)
    with kernels.pool_attention(2):  # the registered attention function takes the windowed path only inside
        got, _ = kernels._rowwise_sdpa(module, query, key, value, mask, scaling=dim ** -0.5)
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-6)
    assert kernels._pool_chunk.get() == 0  # the context is left as it was found


def test_small_batch_path_is_taken_only_where_it_timed_faster_on_this_machine(monkeypatch):
    """The static rule only nominates a shape; the first call times both kernels, and the choice is remembered."""
    torch.manual_seed(0)
    head = kernels.prepare(torch.nn.Linear(64, kernels.HEAD_WEIGHT // 64 + 1, bias=False))
    x = torch.randn(1, 3, 64)
    monkeypatch.setattr(kernels, "_measured", {})
    with torch.no_grad(), kernels.small_batch_kernels():
        head(x)
        decision = kernels._measured[(tuple(head.weight.shape), 3)]
        assert isinstance(decision, bool) and len(kernels._measured) == 1
        kernels._measured[(tuple(head.weight.shape), 3)] = False  # F.linear timed faster: F.linear, bit for bit
        assert torch.equal(head(x), F.linear(x, head.weight))
        kernels._measured[(tuple(head.weight.shape), 3)] = True
        assert torch.equal(head(x), kernels.small_batch_linear(x, head.weight))
        head(torch.randn(1, 600, 64))  # a prefill: outside the rule, nothing is timed
    assert len(kernels._measured) == 1
