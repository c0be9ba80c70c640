import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdistill.losses import DIVERGENCES, distill_loss, hidden_state_loss, teacher_topk, token_divergence


def logits(seed, n=6, v=11, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * scale


@pytest.mark.parametrize("kind", DIVERGENCES)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), temperature=st.sampled_from([0.5, 1.0, 2.0]))
def test_zero_on_identical_and_nonnegative(kind, seed, temperature):
    a, b = logits(seed), logits(seed + 1)
    assert torch.allclose(token_divergence(a, a, kind, temperature=temperature), torch.zeros(6), atol=1e-5)
    assert (token_divergence(a, b, kind, temperature=temperature) >= -1e-6).all()


def test_known_values_and_limits():
    p = torch.tensor([[0.0, 10.0]])  # ≈ one-hot on token 1
    q = torch.tensor([[10.0, 0.0]])  # ≈ one-hot on token 0
    assert token_divergence(p, q, "tvd").item() == pytest.approx(1.0, abs=1e-4)
    assert token_divergence(p, q, "jsd", beta=0.5).item() == pytest.approx(math.log(2), abs=1e-3)
    a, b = logits(1), logits(2)
    assert torch.allclose(token_divergence(a, b, "jsd", beta=0.0), token_divergence(a, b, "fkl"))
    assert torch.allclose(token_divergence(a, b, "jsd", beta=1.0), token_divergence(a, b, "rkl"))
    # β → 0 the scaled JSD tends to the forward KL's behaviour; it stays bounded by log 2 in between.
    assert (token_divergence(a, b, "jsd", beta=0.5) <= math.log(2) + 1e-5).all()
    # FKL(p‖q) with (student=a, teacher=b) is KL(b‖a): check against torch's kl_div.
    expected = torch.nn.functional.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True,
                                          reduction="none").sum(-1)
    assert torch.allclose(token_divergence(a, b, "fkl"), expected, atol=1e-5)
    with pytest.raises(ValueError, match="unknown divergence"):
        token_divergence(a, b, "hellinger")


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_chunked_equals_plain_and_gradients_finite(kind):
    torch.manual_seed(0)
    n, d, v = 37, 8, 23
    hidden = torch.randn(n, d, requires_grad=True)
    head = torch.randn(v, d, requires_grad=True)
    t_hidden, t_head = torch.randn(n, d), torch.randn(v, d)
    labels = torch.randint(0, v, (n,))
    plain = token_divergence(hidden @ head.T, t_hidden @ t_head.T, kind).sum()
    chunked = distill_loss(hidden, head, (t_hidden, t_head), labels, kind, chunk_size=5)
    assert torch.allclose(plain, chunked, atol=1e-4)
    chunked.backward()
    grad_chunked = hidden.grad.clone()
    hidden.grad = None
    plain.backward()
    assert torch.allclose(grad_chunked, hidden.grad, atol=1e-5)
    assert torch.isfinite(head.grad).all()


def test_all_masked_batch_gives_zero_not_nan():
    hidden = torch.zeros(0, 4, requires_grad=True)
    loss = distill_loss(hidden, torch.randn(9, 4), (torch.zeros(0, 4), torch.randn(9, 4)), torch.zeros(0), "fkl")
    assert loss.item() == 0.0 and not math.isnan(loss.item())


def test_ce_mix_and_topk_bucket():
    torch.manual_seed(1)
    hidden, head = torch.randn(10, 6), torch.randn(30, 6)
    t_hidden, t_head = torch.randn(10, 6), torch.randn(30, 6)
    labels = torch.randint(0, 30, (10,))
    ce = torch.nn.functional.cross_entropy(hidden @ head.T, labels, reduction="sum")
    assert distill_loss(hidden, head, (t_hidden, t_head), labels, ce_weight=1.0).item() == pytest.approx(ce.item(), rel=1e-5)
    # Top-k with k = V keeps the whole distribution: the bucket is empty and FKL is unchanged.
    full = distill_loss(hidden, head, (t_hidden, t_head), labels, "fkl")
    ids, logp = teacher_topk(t_hidden @ t_head.T, 30)
    assert distill_loss(hidden, head, (ids, logp), labels, "fkl").item() == pytest.approx(full.item(), rel=1e-3)
    # A small k stays finite and positive.
    ids, logp = teacher_topk(t_hidden @ t_head.T, 3)
    small = distill_loss(hidden, head, (ids, logp), labels, "fkl")
    assert torch.isfinite(small) and small.item() > 0


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_reduced_vocab_loss_is_exact_with_every_token_and_matches_a_smaller_head(kind):
    """train.head_vocab: vocab_ids = all ids is the full loss; a subset equals a head that only has those rows."""
    torch.manual_seed(2)
    n, d, v = 12, 6, 40
    hidden, head = torch.randn(n, d), torch.randn(v, d, requires_grad=True)
    t_hidden, t_head = torch.randn(n, d), torch.randn(v, d)
    labels = torch.randint(0, v, (n,))
    ids, logp = teacher_topk(t_hidden @ t_head.T, 5)
    every = torch.arange(v)
    for teacher, ce_weight in (((t_hidden, t_head), 0.0), ((ids, logp), 0.0), ((ids, logp), 0.3), ((t_hidden, t_head), 1.0)):
        full = distill_loss(hidden, head, teacher, labels, kind, ce_weight=ce_weight)
        same = distill_loss(hidden, head, teacher, labels, kind, ce_weight=ce_weight, vocab_ids=every)
        assert same.item() == pytest.approx(full.item(), rel=1e-5, abs=1e-6)

    # A subset holding every label and teacher id: the loss of a head with only those rows, ids renumbered.
    subset = torch.unique(torch.cat([labels, ids.flatten(), torch.tensor([0, 7, 39])]))
    renumber = {int(t): i for i, t in enumerate(subset)}
    small_ids = ids.clone().apply_(lambda t: renumber[t])
    small_labels = labels.clone().apply_(lambda t: renumber[t])
    reduced = distill_loss(hidden, head, (ids, logp), labels, kind, ce_weight=0.3, vocab_ids=subset)
    direct = distill_loss(hidden, head[subset], (small_ids, logp), small_labels, kind, ce_weight=0.3)
    assert reduced.item() == pytest.approx(direct.item(), rel=1e-5)
    logit_reduced = distill_loss(hidden, head, (t_hidden, t_head), labels, kind, vocab_ids=subset)
    logit_direct = distill_loss(hidden, head[subset], (t_hidden, t_head[subset]), small_labels, kind)
    assert logit_reduced.item() == pytest.approx(logit_direct.item(), rel=1e-5)

    # Teacher ids and labels outside the subset: finite, and no gradient reaches the rows left out.
    narrow = torch.tensor([1, 2, 3, 5, 8, 13, 21, 34])
    loss = distill_loss(hidden, head, (ids, logp), labels, kind, ce_weight=0.5, vocab_ids=narrow)
    loss.backward()
    outside = torch.ones(v, dtype=torch.bool)
    outside[narrow] = False
    assert torch.isfinite(loss) and torch.isfinite(head.grad).all()
    assert head.grad[outside].abs().sum() == 0 and head.grad[narrow].abs().sum() > 0


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 6))
def test_hidden_state_loss_zero_when_matched_and_equal_to_a_standardised_mse(seed, tokens):
    g = torch.Generator().manual_seed(seed)
    mean, std = torch.randn(8, generator=g), torch.rand(8, generator=g) + 0.1
    teacher = (torch.randn(tokens, 8, generator=g) * 30).half()  # massive channels, stored in fp16
    matched = (teacher.float() - mean) / std
    assert hidden_state_loss(matched, teacher, mean, std).item() == pytest.approx(0.0, abs=1e-6)
    off = matched + 0.5
    assert hidden_state_loss(off, teacher, mean, std).item() == pytest.approx(0.25 * tokens, rel=1e-5)
    assert hidden_state_loss(torch.zeros(0, 8), teacher[:0], mean, std).item() == 0.0  # no tokens: 0, not NaN
