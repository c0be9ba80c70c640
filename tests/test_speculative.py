import json

import pytest
import torch
from conftest import make_llama

from specdistill import kernels, speculative
from specdistill.models import ReducedHeadDraft, load_draft, size_report
from specdistill.speculative import (
    SamplingParams,
    SpeculativeGenerator,
    _CachedModel,
    nucleus,
    sample_tokens,
    target_generate_stream,
    target_only_generate,
    target_only_generate_batch,
    verify,
    warp,
)

VOCAB = 16


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson χ² goodness-of-fit p-value (cells with expected count < 5 merged into one)."""
    expected = probs * counts.sum()
    keep = expected >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)]).double()
    exp = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)]).double()
    nonzero = exp > 0
    obs, exp = obs[nonzero], exp[nonzero]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


class RolledDraft(torch.nn.Module):
    """A draft whose argmax is never the target's: the target's own logits shifted by one token."""

    def __init__(self, target):
        super().__init__()
        self.inner = target
        self.config = target.config

    @property
    def device(self):
        return self.inner.device

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        out.logits = out.logits.roll(1, dims=-1)
        return out


@pytest.fixture(scope="module")
def pair():
    return make_llama(VOCAB, hidden=32, layers=2, seed=0), make_llama(VOCAB, hidden=32, layers=1, seed=1)


@pytest.mark.parametrize("gamma", [1, 2, 4, 7])
@pytest.mark.parametrize("schedule", ["fixed", "heuristic", "confidence"])
def test_greedy_identical_to_target_only(pair, gamma, schedule):
    target, draft = pair
    gen = SpeculativeGenerator(target, draft, gamma=gamma, schedule=schedule)
    for seed in range(4):
        prompt = torch.randint(0, VOCAB, (5 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        ours = gen.generate(prompt, max_new_tokens=25)
        ref = target_only_generate(target, prompt, max_new_tokens=25)
        assert ours.tokens == ref.tokens
        hf = target.generate(torch.tensor([prompt]), max_new_tokens=25, do_sample=False, min_new_tokens=25,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert ours.tokens == hf


def test_eos_and_max_new_tokens_end_where_target_only_does(pair):
    target, draft = pair
    prompt = [3, 1, 4, 1, 5]
    ref = target_only_generate(target, prompt, max_new_tokens=30)
    eos = ref.tokens[7]  # a token the target emits: generation must stop at its first occurrence
    first = ref.tokens.index(eos)
    ours = SpeculativeGenerator(target, draft, gamma=4).generate(prompt, 30, eos_token_id=eos)
    assert ours.tokens == ref.tokens[: first + 1]
    for n in (1, 2, 3, 11):
        assert SpeculativeGenerator(target, draft, gamma=4).generate(prompt, n).tokens == ref.tokens[:n]
    stop = ref.tokens[12:14]  # a two-token stop sequence: both decoders end right after its first completion
    end = next(i + 2 for i in range(len(ref.tokens) - 1) if ref.tokens[i: i + 2] == stop)
    for gamma in (1, 3, 6):
        ours = SpeculativeGenerator(target, draft, gamma=gamma).generate(prompt, 30, stop_sequences=[stop])
        assert ours.tokens == ref.tokens[:end]
    assert target_only_generate(target, prompt, 30, stop_sequences=[stop]).tokens == ref.tokens[:end]


def test_accept_all_and_accept_none(pair):
    target, _ = pair
    prompt = [1, 2, 3]
    same = SpeculativeGenerator(target, target, gamma=4).generate(prompt, 20)
    assert same.stats["accepted"][:-1] == same.stats["drafted"][:-1]
    # The prefill emits the first token (as target-only's does), then four blocks of γ + 1 = 5: 20 tokens, 5 calls.
    assert same.stats["target_calls"] == 5 and same.stats["tau"] == 4.0
    none = SpeculativeGenerator(target, RolledDraft(target), gamma=4).generate(prompt, 20)
    assert all(n == 0 for n in none.stats["accepted"]) and none.stats["tau"] == 1.0
    assert none.tokens == target_only_generate(target, prompt, 20).tokens


def _layer_kv(model: _CachedModel, layer: int, row: int = 0):
    """Keys/values of the slots ``row`` may attend to, in order."""
    slots = model.valid[row].nonzero().squeeze(1)
    keys, values = model.cache.layers[layer].keys, model.cache.layers[layer].values
    return keys[row][:, slots], values[row][:, slots]


def test_cache_rollback_equals_fresh_prefill(pair):
    target, _ = pair
    tokens = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    rolled = _CachedModel(target)
    rolled.feed([tokens[:8]])
    rolled.feed([tokens[8:] + [1, 2]])  # a speculative block, partly rejected
    rolled.keep(0, 10)
    rolled._trim()
    fresh = _CachedModel(target)
    fresh.feed([tokens[:10]])
    assert rolled.valid.shape[1] == 10  # the rejected tail was cropped, not just hidden
    for layer in range(target.config.num_hidden_layers):
        k1, v1 = _layer_kv(rolled, layer)
        k2, v2 = _layer_kv(fresh, layer)
        assert torch.allclose(k1, k2, atol=1e-5) and torch.allclose(v1, v2, atol=1e-5)
    assert torch.allclose(rolled.feed([[tokens[10]]])[0], fresh.feed([[tokens[10]]])[0], atol=1e-4)


def test_batched_cache_with_holes_and_compaction_equals_fresh_prefill(pair):
    """Rows that keep different amounts leave holes; masked holes and compaction must not change any logit."""
    target, _ = pair
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 6)]
    model = _CachedModel(target, batch=3)
    model.compact_above = 8
    model.feed([r[:2] for r in rows])
    kept = [list(r[:2]) for r in rows]
    for step in range(14):  # each step: feed a block, keep a row-dependent part of it
        block = [torch.randint(0, VOCAB, (1 + (step + b) % 4,), generator=g).tolist() for b in range(3)]
        model.feed(block)
        for b in range(3):
            keep = int((step + b) % 3 == 0) * len(block[b])  # mostly rejected: holes outgrow the rows
            kept[b] += block[b][:keep]
            model.keep(b, len(kept[b]))
        model._trim()
    assert model.compactions > 0 and not model.valid.all()  # both holes and compaction were exercised
    probe = [[1], [2], [3]]
    batched = model.feed(probe)
    for b in range(3):
        fresh = _CachedModel(target).feed([kept[b] + probe[b]])[0][-1]
        assert torch.allclose(batched[b][-1], fresh, atol=1e-4), b


@pytest.mark.parametrize("gamma", [1, 2, 4, 7])
@pytest.mark.parametrize("schedule", ["fixed", "heuristic", "confidence"])
def test_batched_greedy_identical_to_per_row_target_only(pair, gamma, schedule):
    target, draft = pair
    g = torch.Generator().manual_seed(gamma)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, 7, 4)]
    refs = [target_only_generate(target, p, max_new_tokens=20).tokens for p in prompts]
    eos = refs[1][9]  # row 1 stops early (and maybe others); the rest run to max_new_tokens
    refs = [r[: r.index(eos) + 1] if eos in r else r for r in refs]
    outs = SpeculativeGenerator(target, draft, gamma=gamma, schedule=schedule).generate_batch(
        prompts, max_new_tokens=20, eos_token_id=eos)
    assert [o.tokens for o in outs] == refs
    batched_baseline = target_only_generate_batch(target, prompts, max_new_tokens=20, eos_token_id=eos)
    assert [o.tokens for o in batched_baseline] == refs
    for o in outs:
        assert o.stats["new_tokens"] == len(o.tokens) and o.stats["tau"] >= 1.0


@pytest.mark.parametrize("sampling, eos", [({"temperature": 0.0}, 8), ({"temperature": 0.8, "top_p": 0.9}, 3)])
def test_stream_pool_equals_each_batch_alone(pair, monkeypatch, sampling, eos):
    """Batches that join a running pool (absorbed caches of other widths, rows leaving at EOS, holes, compaction)
    sample what each batch samples alone, with the same recorded teacher: per-row seeds and masks make the pool
    invisible. Greedy tokens also equal the one-prompt loop's."""
    target, _ = pair
    monkeypatch.setattr(speculative, "POOL_SPARE_SLOTS", 3)  # compact often
    g = torch.Generator().manual_seed(11)
    batches = [(i, [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths])
               for i, lengths in enumerate([(3, 9), (12,), (1, 5), (7,), (2, 2), (4, 6)])]
    kwargs = {"max_new_tokens": 24, "eos_token_id": eos, "seed": 5, "record_top_k": 4, "record_prompt": True,
              **sampling}
    compactions = []
    absorb = speculative._CachedModel.absorb

    def counting_absorb(self, other):
        compactions.append(self)
        absorb(self, other)

    monkeypatch.setattr(speculative._CachedModel, "absorb", counting_absorb)
    windows = []
    windowed = kernels._windowed_sdpa
    monkeypatch.setattr(kernels, "_windowed_sdpa", lambda *a, **k: windows.append(a[2].shape[2]) or windowed(*a, **k))
    monkeypatch.setattr(speculative, "POOL_ATTENTION_CHUNK", 1)  # each pool row attends over its own slots only
    pooled = dict(target_generate_stream(target, iter(batches), max_active_rows=4, **kwargs))
    assert compactions and max(m.compactions for m in compactions) > 0  # joins and compaction both happened
    assert windows  # the pool's steps went through the windowed attention
    monkeypatch.setattr(speculative, "POOL_ATTENTION_CHUNK", 0)
    alone = dict(target_generate_stream(target, iter(batches), max_active_rows=1, **kwargs))
    assert sorted(pooled) == sorted(alone) == list(range(len(batches)))
    lengths = set()
    for index, prompts in batches:
        for row, (a, b) in enumerate(zip(pooled[index], alone[index])):
            assert a.tokens == b.tokens, (index, row)
            lengths.add(len(a.tokens))
            for (ids_a, lp_a), (ids_b, lp_b) in zip(a.teacher + a.prompt_teacher, b.teacher + b.prompt_teacher):
                assert torch.equal(ids_a, ids_b) and torch.allclose(lp_a, lp_b, atol=1e-5)
            if not sampling["temperature"]:
                assert a.tokens == target_only_generate(target, prompts[row], 24, eos_token_id=eos).tokens
    assert len(lengths) > 1  # rows left the pool at different steps


@pytest.mark.parametrize("decoder, params", [("speculative", SamplingParams(0.9, top_k=8)),
                                             ("target_only", SamplingParams(0.7, top_p=0.9))])
def test_batched_sampling_rows_follow_target_distribution(pair, decoder, params):
    """Rows of one batch sample independently and each follows the target's first-token distribution, in the
    speculative decoder and in the batched target-only loop (the data generator's)."""
    target, draft = pair
    prompts = [[2, 7, 1], [5, 5, 5, 5, 9]]
    with torch.no_grad():
        p = [warp(target(torch.tensor([pr])).logits[0, -1], params) for pr in prompts]
    sampling = {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p}
    if decoder == "speculative":
        gen = SpeculativeGenerator(target, draft, gamma=3)
        generate = lambda seed: gen.generate_batch(prompts, max_new_tokens=2, seed=seed, **sampling)
    else:
        generate = lambda seed: target_only_generate_batch(target, prompts, 2, seed=seed, **sampling)
    counts = torch.zeros(2, VOCAB)
    for seed in range(1500):
        outs = generate(seed)
        for b in range(2):
            counts[b, outs[b].tokens[0]] += 1
    assert chi_square_p(counts[0], p[0]) > 1e-3 and chi_square_p(counts[1], p[1]) > 1e-3


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7), SamplingParams(1.0, top_k=5),
                                    SamplingParams(0.8, top_p=0.8)])
def test_verify_rule_preserves_target_distribution(params):
    """χ² on ≥10⁴ samples per position: emitted tokens follow p, at position 1 and (given acceptance) 2."""
    g = torch.Generator().manual_seed(0)
    v = 12
    p = warp(torch.randn(3, v, generator=g) * 2, params)
    q = warp(torch.randn(2, v, generator=g) * 2, params)
    n = 20_000
    first, second = torch.zeros(v), torch.zeros(v)
    for _ in range(n):
        drafts = torch.stack([torch.multinomial(q[0], 1, generator=g), torch.multinomial(q[1], 1, generator=g)])[:, 0]
        accepted, nxt = verify(p, q, drafts, g)
        emitted = drafts[:accepted].tolist() + [nxt]
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
    assert chi_square_p(first, p[0]) > 1e-3
    assert second.sum() > 2000 and chi_square_p(second, p[1]) > 1e-3


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.95), SamplingParams(0.5, top_p=0.5),
                                    SamplingParams(1.0, top_k=5), SamplingParams(0.8, top_k=40, top_p=0.9),
                                    SamplingParams(2.0, top_p=0.99)])
def test_nucleus_is_warp_without_the_full_sort(params):
    """Batched nucleus == per-row warp, for rows whose nucleus fits in the candidates and rows that need a full sort."""
    g = torch.Generator().manual_seed(3)
    vocab = 600
    peaked = torch.randn(3, vocab, generator=g) * 6  # few tokens hold the mass: candidates suffice
    flat = torch.randn(3, vocab, generator=g) * 0.1  # nucleus wider than 16 candidates: full-sort rows
    logits = torch.cat([peaked, flat])
    for candidates in (16, 256, vocab):
        ids, probs = nucleus(logits, params, candidates=candidates)
        dense = torch.zeros_like(logits).scatter_add(-1, ids, probs)
        assert torch.allclose(dense, warp(logits, params), atol=1e-6), candidates


def test_sample_tokens_follows_warp():
    g = torch.Generator().manual_seed(4)
    params = SamplingParams(0.7, top_p=0.9)
    logits = torch.randn(2, 30, generator=g) * 2
    logits[1] = 0.05 * logits[1]  # near-flat row: its nucleus needs the full sort
    p = warp(logits, params)
    counts = torch.zeros(2, 30)
    for _ in range(2500):
        for b, token in enumerate(sample_tokens(logits.repeat(4, 1), params, g)):
            counts[b % 2, token] += 1
    assert chi_square_p(counts[0], p[0]) > 1e-3 and chi_square_p(counts[1], p[1]) > 1e-3
    assert sample_tokens(logits, SamplingParams(0.0)) == logits.argmax(-1).tolist()


def test_verify_disjoint_support_never_accepts():
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0]] * 3)
    q = torch.tensor([[0.0, 0.0, 0.5, 0.5]] * 2)
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        drafts = torch.multinomial(q[0], 2, replacement=True, generator=g)
        accepted, nxt = verify(p, q, drafts, g)
        assert accepted == 0 and nxt in (0, 1)


def test_sampled_generation_matches_target_distribution_end_to_end(pair):
    """Whole-generator check: the first two sampled tokens' joint frequencies follow the target's."""
    target, draft = pair
    prompt = [2, 7, 1]
    params = SamplingParams(1.0)
    with torch.no_grad():
        p1 = warp(target(torch.tensor([prompt])).logits[0, -1], params)
    gen = SpeculativeGenerator(target, draft, gamma=3)
    counts = torch.zeros(VOCAB)
    for seed in range(3000):
        out = gen.generate(prompt, max_new_tokens=2, temperature=1.0, seed=seed)
        counts[out.tokens[0]] += 1
    assert chi_square_p(counts, p1) > 1e-3


def test_bad_arguments(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="vocab size mismatch"):
        SpeculativeGenerator(target, make_llama(VOCAB + 1, hidden=32, layers=1))
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="empty prompt"):
        SpeculativeGenerator(target, draft).generate([], 3)


def test_decode_cli_streams_text_and_stops_at_stop_string(tiny_pair_dir, capsys):
    from specdistill import decode_cli

    common = ["--target", str(tiny_pair_dir / "target"), "--draft", str(tiny_pair_dir / "draft"),
              "--prompt", "Write a poem about the sea.", "--max-new-tokens", "24", "--gamma", "3", "--compare"]
    assert decode_cli.main(common) == 0
    full_text, stats = capsys.readouterr().out.rsplit("\n\n{", 1)
    stats = json.loads("{" + stats)
    assert stats["new_tokens"] == 24 and stats["greedy_identical"] and stats["tau"] >= 1.0
    sampled = [*common, "--temperature", "1.0", "--seed", "3"]  # a random tiny model's greedy text is blank lines
    assert decode_cli.main(sampled) == 0
    full_text = capsys.readouterr().out.rsplit("\n\n{", 1)[0]
    assert len(full_text.strip()) > 4, "nothing was streamed"
    stop = full_text.strip()[len(full_text.strip()) // 2:][:2]  # a string from the middle of the reply
    assert decode_cli.main([*sampled, "--stop", stop]) == 0  # same seed: the same tokens, cut at the stop
    cut_text, stats = capsys.readouterr().out.rsplit("\n\n{", 1)
    stats = json.loads("{" + stats)
    assert stats["stopped_at"] == "stop string" and stats["new_tokens"] < 24
    assert stop not in cut_text and full_text.startswith(cut_text)


def test_reduced_head_draft_computes_the_full_heads_logits_on_its_tokens(pair, tmp_path):
    target, draft = pair
    keep = [0, 3, 5, 9, 15]
    reduced = ReducedHeadDraft(draft, keep)
    ids = torch.tensor([[1, 4, 2, 7]])
    full, part = draft(input_ids=ids).logits, reduced(input_ids=ids).logits
    left_out = torch.ones(VOCAB, dtype=torch.bool)
    left_out[keep] = False
    assert torch.allclose(part[..., keep], full[..., keep], atol=1e-5)
    assert bool((part[..., left_out] == float("-inf")).all())
    # Through the decoder's cache, rows of two lengths, only each row's last position (logits_to_keep).
    a = _CachedModel(draft, 2).feed([[1, 4, 2], [7]], last_only=True)
    b = _CachedModel(reduced, 2).feed([[1, 4, 2], [7]], last_only=True)
    assert torch.allclose(b[:, keep], a[:, keep], atol=1e-5)
    assert size_report(reduced, target) == size_report(draft, target)  # the decode-time copy is not a parameter
    with pytest.raises(ValueError, match=r"token ids in \[0, 16\)"):
        ReducedHeadDraft(draft, [3, VOCAB])
    with pytest.raises(ValueError, match="got nothing"):
        ReducedHeadDraft(draft, [])
    draft.save_pretrained(tmp_path)
    assert not isinstance(load_draft(str(tmp_path)), ReducedHeadDraft)  # no draft_vocab.json: the full head
    (tmp_path / "draft_vocab.json").write_text(json.dumps({"token_ids": keep}))
    assert load_draft(str(tmp_path)).token_ids.tolist() == keep
    (tmp_path / "draft_vocab.json").write_text('{"token_ids": [1, 2')  # cut mid-write
    with pytest.raises(ValueError, match="draft_vocab.json: unreadable"):
        load_draft(str(tmp_path))


@pytest.mark.parametrize("gamma", [1, 3])
def test_reduced_head_draft_stays_lossless(pair, gamma):
    """Half the vocabulary left out of the draft's head, so the target's token is often one the draft cannot
    propose: greedy output is still the target's, token for token, and sampled output follows the target."""
    target, draft = pair
    reduced = ReducedHeadDraft(draft, range(0, VOCAB, 2))
    g = torch.Generator().manual_seed(gamma)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, 6, 3)]
    refs = [target_only_generate(target, p, max_new_tokens=20).tokens for p in prompts]
    outs = SpeculativeGenerator(target, reduced, gamma=gamma).generate_batch(prompts, max_new_tokens=20)
    assert [o.tokens for o in outs] == refs
    params = SamplingParams(0.9)
    prompt = [5, 1, 8]
    with torch.no_grad():
        p = warp(target(torch.tensor([prompt])).logits[0, -1], params)
    gen = SpeculativeGenerator(target, reduced, gamma=gamma)
    counts = torch.zeros(VOCAB)
    for seed in range(1500):
        counts[gen.generate(prompt, max_new_tokens=2, temperature=0.9, seed=seed).tokens[0]] += 1
    assert chi_square_p(counts, p) > 1e-3
    assert counts[1::2].sum() > 0  # tokens the draft never proposes still come out, from the residual
