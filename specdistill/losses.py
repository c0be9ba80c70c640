"""Distillation divergences: pure functions of student and teacher logits, computed in fp32.

Every function returns per-token values; ``distill_loss`` sums them over the selected tokens, in chunks
under activation checkpointing: the student's vocab-sized tensors exist for one chunk at a time, and the
teacher's fp32 log-probs (N×V, computed once, not again in backward) are the one full-size buffer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

DIVERGENCES = ("fkl", "rkl", "jsd", "tvd")


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a‖b) per row from log-probabilities; 0·log 0 counts as 0."""
    a = log_a.exp()
    return torch.where(a > 0, a * (log_a - log_b), torch.zeros_like(a)).sum(-1)


def divergence_from_logprobs(student_logp: torch.Tensor, teacher_logp: torch.Tensor, kind: str,
                             beta: float = 0.5) -> torch.Tensor:
    """Per-row divergence between teacher p and student q (log-probabilities over the same outcomes).

    fkl = KL(p‖q) (mode covering), rkl = KL(q‖p) (mode seeking), tvd = ½Σ|p−q| = 1 − acceptance,
    jsd = generalised JSD(β) as in GKD: β·KL(p‖m) + (1−β)·KL(q‖m), m = βp + (1−β)q; β=0 is FKL, β=1 RKL.
    """
    if kind == "fkl":
        return _kl(teacher_logp, student_logp)
    if kind == "rkl":
        return _kl(student_logp, teacher_logp)
    if kind == "tvd":
        return 0.5 * (teacher_logp.exp() - student_logp.exp()).abs().sum(-1)
    if kind == "jsd":
        if beta <= 0.0:
            return _kl(teacher_logp, student_logp)
        if beta >= 1.0:
            return _kl(student_logp, teacher_logp)
        mix = torch.logsumexp(torch.stack([teacher_logp + torch.log(torch.tensor(beta)),
                                           student_logp + torch.log(torch.tensor(1.0 - beta))]), dim=0)
        return beta * _kl(teacher_logp, mix) + (1.0 - beta) * _kl(student_logp, mix)
    raise ValueError(f"unknown divergence '{kind}' (choose from {', '.join(DIVERGENCES)})")


def token_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: str, beta: float = 0.5,
                     temperature: float = 1.0) -> torch.Tensor:
    """Per-token divergence from raw logits (..., V), both softened by ``temperature``."""
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    return divergence_from_logprobs(s, t, kind, beta)


# Log-probability of an entry that is not there: exp() is exactly 0 in fp32, yet differences stay finite, so
# no 0·(−inf) = NaN reaches a gradient (which −inf would, through torch.where's unselected branch).
ABSENT_LOGP = -1e4


def topk_bucket(student_logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logp: torch.Tensor):
    """Student and teacher as (k+1)-way distributions: the teacher's top-k tokens plus one tail bucket.

    A teacher id < 0 is a token outside the student's (reduced) vocabulary: its entry is empty on both
    sides, and its teacher mass moves into the teacher's tail bucket.
    """
    s_full = F.log_softmax(student_logits.float(), dim=-1)
    absent = teacher_ids < 0
    s_top = s_full.gather(-1, teacher_ids.long().clamp(min=0)).masked_fill(absent, ABSENT_LOGP)
    s_tail = torch.log1p(-s_top.exp().sum(-1).clamp(max=1 - 1e-6))
    t_top = teacher_logp.float().masked_fill(absent, ABSENT_LOGP)
    t_tail = torch.log1p(-t_top.exp().sum(-1).clamp(max=1 - 1e-6))
    return torch.cat([s_top, s_tail[..., None]], -1), torch.cat([t_top, t_tail[..., None]], -1)


def teacher_topk(teacher_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k token ids and their log-probabilities (of the full softmax) at T=1."""
    logp = F.log_softmax(teacher_logits.float(), dim=-1)
    values, ids = logp.topk(k, dim=-1)
    return ids, values


def cross_entropy_sum(student_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token CE; a label < 0 (outside a reduced vocabulary) adds nothing."""
    labels = labels.long()
    return F.cross_entropy(student_logits.float(), labels.masked_fill(labels < 0, -100), reduction="sum")


def _chunk_loss(student_hidden, head_weight, teacher, labels, kind, beta, temperature, ce_weight):
    """Summed loss of one chunk. ``teacher`` is the teacher's log-probs (n, V) at ``temperature``, or
    (ids, logp) for a top-k teacher."""
    logits = student_hidden @ head_weight.T
    loss = torch.zeros((), dtype=torch.float32, device=logits.device)
    if ce_weight < 1.0:
        if isinstance(teacher, tuple):
            s, t = topk_bucket(logits / temperature, teacher[0], teacher[1])
            div = divergence_from_logprobs(s, t, kind, beta)
        elif kind == "fkl":
            # Σ p (log p − log q) without _kl's mask: a log_softmax of finite logits is finite, so p·log p
            # never meets 0·(−inf). Fewer vocab-sized temporaries, and the backward is q − p.
            s = F.log_softmax(logits.float() / temperature, dim=-1)
            p = teacher.exp()
            div = (p * (teacher - s)).sum(-1)
        else:
            div = divergence_from_logprobs(F.log_softmax(logits.float() / temperature, dim=-1), teacher, kind, beta)
        # T² keeps gradient scale comparable across temperatures (Hinton et al.).
        loss = loss + (1.0 - ce_weight) * div.sum() * temperature**2
    if ce_weight > 0.0:
        loss = loss + ce_weight * cross_entropy_sum(logits, labels)
    return loss


def distill_loss(student_hidden: torch.Tensor, head_weight: torch.Tensor, teacher: tuple, labels: torch.Tensor,
                 kind: str = "fkl", beta: float = 0.5, temperature: float = 1.0, ce_weight: float = 0.0,
                 chunk_size: int = 1024, vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Summed loss over N selected tokens (divide by the token count yourself, across steps and ranks).

    student_hidden (N, d), head_weight (V, d); teacher = (teacher_hidden (N, d_t), teacher_head (V, d_t))
    or (topk_ids (N, k), topk_logp (N, k)); labels (N,) for the CE term. N = 0 gives 0, never NaN.

    ``vocab_ids`` (sorted unique ids): both softmaxes cover only these tokens (``train.head_vocab``). A logit
    teacher is renormalised over them; a top-k teacher's other entries join its tail bucket; labels outside
    them are skipped. With every id it equals the full-vocabulary loss.
    """
    total = student_hidden.new_zeros((), dtype=torch.float32)
    topk = teacher[0].dtype in (torch.int32, torch.int64)
    if vocab_ids is not None:
        to_subset = torch.full((head_weight.shape[0],), -1, dtype=torch.long, device=vocab_ids.device)
        to_subset[vocab_ids] = torch.arange(vocab_ids.numel(), device=vocab_ids.device)
        head_weight = head_weight.index_select(0, vocab_ids)
        labels = to_subset[labels.long()]
        if topk:
            teacher = (to_subset[teacher[0].long()], teacher[1])
        elif ce_weight < 1.0:
            teacher = (teacher[0], teacher[1].index_select(0, vocab_ids))
    for start in range(0, student_hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        # Top-k teachers are per-token (ids, logp); logit teachers are per-token hidden states and one head,
        # turned into log-probs here, outside the checkpoint, so backward does not recompute them.
        if topk:
            chunk_teacher = (teacher[0][rows], teacher[1][rows])
        elif ce_weight < 1.0:
            with torch.no_grad():
                chunk_teacher = F.log_softmax((teacher[0][rows] @ teacher[1].T).float() / temperature, dim=-1)
        else:
            chunk_teacher = teacher[0][rows]  # CE only: never read
        args = (student_hidden[rows], head_weight, chunk_teacher, labels[rows], kind, beta, temperature, ce_weight)
        if torch.is_grad_enabled() and student_hidden.requires_grad:
            total = total + checkpoint(_chunk_loss, *args, use_reentrant=False)
        else:
            total = total + _chunk_loss(*args)
    return total


def hidden_state_loss(predicted: torch.Tensor, teacher_hidden: torch.Tensor, mean: torch.Tensor,
                      std: torch.Tensor) -> torch.Tensor:
    """Summed over N tokens: the mean squared error over channels between ``predicted`` (N, d_t), a map of the
    draft's state, and the target's ``teacher_hidden`` (N, d_t) standardised per channel by ``mean`` / ``std``
    (d_t,). Standardised, because a few of SmolLM2's residual channels are 100× the others and would be all an
    unscaled MSE sees. Summed like ``distill_loss``, so the caller normalises both by one token count."""
    wanted = (teacher_hidden.float() - mean) / std
    return (predicted.float() - wanted).pow(2).mean(-1).sum()
