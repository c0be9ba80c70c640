"""Small-batch fp32 linears for CPU decoding: the matmul kernel MKL picks for a few rows is slow.

A decode step feeds 1 token per row, a verify step γ+1. For those few rows ``F.linear`` (x·Wᵀ) lands on
kernels that read the weight at a fraction of memory speed: on this 2-core machine SmolLM2-135M's tied
LM head (49,152 × 576, fp32) took 9.4 ms for 1 row, 21 ms for 2 and 33 ms for 3, but ``W @ xᵀ`` took 3.1 ms
for 2 rows. A 2-token verify forward cost 1.6× a 1-token step, which alone kept speculative decoding below
break-even on CPU. So, inside ``small_batch_kernels()``, a linear computes ``(W @ xᵀ)ᵀ`` where
``scripts/bench_linear.py`` measured it faster: a large weight (an LM head) at up to ``HEAD_MAX_ROWS`` rows,
one row doubled to two so it takes that path too (2.1–3.1× on the heads); a mid-sized weight (the MLP and
q/o projections) at 2–4 rows (1.1–2.0×). Small weights, and mid-sized ones at 1 or 5+ rows, were as fast
or faster with ``F.linear`` and keep it. That rule was measured on the machines of 2026-12-04/07; where it
applies, the first call of each weight shape and row count now times both kernels and keeps the faster
(``measured_faster``): on the 2026-12-08 Intel machine ``W @ xᵀ`` was the slower one for every shape.

Only our decoding loops enter the context (``speculative._CachedModel``, ``evaluation``'s step timing), so
HF ``generate`` on the same model objects keeps its own kernels and the side-by-side benchmarks stay fair.
Training (grad enabled), other dtypes and other devices always use ``F.linear``. The result equals
``F.linear``'s up to fp32 summation order, the same kind of difference as between a 1-token step and a
(γ+1)-token verify, which the greedy-identity tests already cover.

**Row-invariant bf16** (``small_batch_kernels(row_invariant=True)``, the target's forwards in our loops). In
bf16 that kind of difference is not small: a 2-token verify rounded differently from a 1-token step and
flipped the target's argmax at near-ties within a few dozen tokens, so bf16 speculative decoding was not
token-identical to bf16 target-only decoding (HF assisted generation's neither). Two things made a verify
row differ from the step that decodes the same position, found layer by layer on SmolLM2-135M (Zen 4,
oneDNN): (1) a bf16 linear on 1 row takes a GEMV kernel whose sums round differently from the GEMM that
2–16 rows take, while the GEMM's rows are independent of how many rows share the call; so one row is
doubled to two. (2) SDPA over γ+1 causal queries blocks its sums differently from one query over its
prefix; so, at batch 1, each verify row attends on its own, over exactly the prefix the one-token step
would see (``_rowwise_sdpa``). Every other op of a Llama layer is per row already. The verify's logits are
then bit for bit the one-token steps' (tests/test_kernels.py; 0 of 140 logit rows differ on the real
target, against 127 of 140 without), so greedy speculative output equals target-only output in bf16 too.
Cost on the Zen 4 machine: 41.0 → 43.1 ms for a 1-token step, 42.0 → 45.7 ms for a 2-token verify.

**Pool attention** (``pool_attention``, data generation only). The generation pool's cache is as wide as its
longest row, and a decode step's SDPA read every slot, holes included (58 % of them in a profiled step, attention
≈ 30 % of the CPU time). With the pool's rows right-aligned, ``_windowed_sdpa`` attends a chunk of rows over the
slots from the chunk's earliest row on: 1.11× the generation's tokens/s at 16 rows per chunk
(``scripts/bench_generate.py --compare-attention-chunks``).
"""

from __future__ import annotations

import contextlib
import contextvars
import statistics
import time
import types

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

HEAD_WEIGHT = 1 << 22  # elements: the LM heads (18.9M, 28.3M), not the layers (≤ 0.9M)
HEAD_MAX_ROWS = 64  # 1.2–1.3× still at 32–48 rows; a prefill has hundreds and keeps F.linear
MID_WEIGHT = 1 << 18  # elements: SmolLM2's q/o (331k) and MLP (885k) weights, the draft's MLP (393k)
MID_ROWS = (2, 3, 4)

ROWWISE_ATTENTION = "specdistill_rowwise_sdpa"  # the name ``prepare(..., row_invariant=True)`` gives SDPA

_enabled = contextvars.ContextVar("specdistill_small_batch_kernels", default=False)
_row_invariant = contextvars.ContextVar("specdistill_row_invariant", default=False)
_pool_chunk = contextvars.ContextVar("specdistill_pool_attention_chunk", default=0)


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a few rows, through the kernel that reads ``weight`` fast."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:
        out = (weight @ torch.cat([flat, flat]).t())[:, :1].t()
    else:
        out = (weight @ flat.t()).t()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def faster_than_linear(weight_elements: int, rows: int) -> bool:
    """Where ``small_batch_linear`` beat ``F.linear`` (fp32, CPU; ``scripts/bench_linear.py``)."""
    if weight_elements >= HEAD_WEIGHT:
        return 0 < rows <= HEAD_MAX_ROWS
    return weight_elements >= MID_WEIGHT and rows in MID_ROWS


_measured: dict[tuple[tuple[int, ...], int], bool] = {}  # (weight shape, rows) -> W·xᵀ was faster here


def measured_faster(weight: torch.Tensor, x: torch.Tensor, repeats: int = 3) -> bool:
    """Whether ``small_batch_linear`` beats ``F.linear`` on this machine for ``weight``'s shape at ``x``'s row count.

    Timed once per process and shape (alternately, after a warm-up, median of ``repeats``), then remembered:
    ``faster_than_linear``'s rule was measured on other CPUs, and on the 2026-12-08 Intel machine ``W @ xᵀ`` was
    2–4× slower than ``F.linear`` for every shape (``scripts/bench_linear.py``), which made our fp32 loops slower
    than HF's there.
    """
    key = (tuple(weight.shape), x.numel() // x.shape[-1])
    if key not in _measured:
        ours, theirs = [], []
        small_batch_linear(x, weight), F.linear(x, weight)
        for _ in range(repeats):
            start = time.perf_counter()
            small_batch_linear(x, weight)
            ours.append(time.perf_counter() - start)
            start = time.perf_counter()
            F.linear(x, weight)
            theirs.append(time.perf_counter() - start)
        _measured[key] = statistics.median(ours) < statistics.median(theirs)
    return _measured[key]


def _row_invariant_applies(x: torch.Tensor) -> bool:
    return (_row_invariant.get() and x.dtype == torch.bfloat16 and x.device.type == "cpu"
            and not torch.is_grad_enabled())


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if _row_invariant_applies(x) and x.numel() == x.shape[-1]:  # one row: through the GEMM that 2+ rows take
        flat = x.reshape(1, x.shape[-1])
        return F.linear(torch.cat([flat, flat]), self.weight, self.bias)[:1].reshape(*x.shape[:-1], -1)
    if (_enabled.get() and x.dtype == torch.float32 and self.weight.dtype == torch.float32
            and x.device.type == "cpu" and not torch.is_grad_enabled()
            and faster_than_linear(self.weight.numel(), x.numel() // max(x.shape[-1], 1))
            and measured_faster(self.weight, x)):
        return small_batch_linear(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)


def _rowwise_sdpa(module, query, key, value, attention_mask, **kwargs):
    """SDPA; inside ``small_batch_kernels(row_invariant=True)``, a batch-1 verify's queries one at a time;
    inside ``pool_attention``, a pool's decode step a chunk of rows at a time (``_windowed_sdpa``).

    Query row ``i`` of ``rows`` new positions sees the cache's first ``kv − rows + i + 1`` slots, exactly what
    the one-token step at that position sees, through the same call (one query, no mask): the same sums.
    Only at batch 1, where our cache has no holes and the mask is purely causal (``speculative._CachedModel``);
    ``prepare`` never gives it to a sliding-window model, whose mask is more than causal.
    """
    rows, kv = query.shape[2], key.shape[2]
    chunk = _pool_chunk.get()
    if chunk and rows == 1 and attention_mask is not None and attention_mask.dtype == torch.bool \
            and query.shape[0] > chunk:
        return _windowed_sdpa(module, query, key, value, attention_mask, chunk, **kwargs)
    if not (_row_invariant_applies(query) and query.shape[0] == 1 and 1 < rows < kv):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs = {**kwargs, "is_causal": False}
    outputs = []
    for i in range(rows):
        seen = kv - rows + i + 1
        out, _ = sdpa_attention_forward(module, query[:, :, i: i + 1].contiguous(), key[:, :, :seen],
                                        value[:, :, :seen], None, **kwargs)
        outputs.append(out)
    return torch.cat(outputs, dim=1), None


def _windowed_sdpa(module, query, key, value, attention_mask, chunk: int, **kwargs):
    """A pool's one-token decode step, ``chunk`` rows at a time, each chunk over only the slots its rows use.

    A data-generation pool holds rows of very different lengths in one cache as wide as its longest row, and a
    decode step's attention reads every slot, holes included: 58 % of the slots were holes in a 59-row step of
    SmolLM2's pool, and attention took ≈ 30 % of the step. The pool keeps each row's slots right-aligned
    (``speculative._CachedModel.right_align``), so a chunk of rows only needs the slots from its earliest valid
    one on; the masked slots left out weigh exactly 0 in softmax.
    """
    valid = attention_mask.reshape(attention_mask.shape[0], -1)  # (B, 1, 1, L) -> (B, L)
    first = valid.int().argmax(dim=1)  # each row's earliest visible slot (0 for a fully visible row)
    outputs = []
    for start in range(0, query.shape[0], chunk):
        rows = slice(start, start + chunk)
        begin = int(first[rows].min())
        out, _ = sdpa_attention_forward(module, query[rows], key[rows, :, begin:], value[rows, :, begin:],
                                        attention_mask[rows, ..., begin:], **kwargs)
        outputs.append(out)
    return torch.cat(outputs), None


AttentionInterface.register(ROWWISE_ATTENTION, _rowwise_sdpa)
AttentionMaskInterface.register(ROWWISE_ATTENTION, sdpa_mask)


def prepare(model: torch.nn.Module, row_invariant: bool = False) -> torch.nn.Module:
    """Route ``model``'s linears through ``_forward`` (idempotent); they behave as before outside the context.

    ``row_invariant``: an SDPA model also gets ``_rowwise_sdpa``, the same SDPA outside the context (a target
    prepared for our loops still decodes as before in HF ``generate``). Other attention implementations, and
    sliding-window models, keep theirs: their bf16 verify rows may round differently (fp32 stays exact).
    """
    for module in model.modules():
        if type(module) is torch.nn.Linear and getattr(module.forward, "__func__", None) is not _forward:
            module.forward = types.MethodType(_forward, module)
    config = getattr(model, "config", None)
    # A sliding window makes the mask more than causal, and the rowwise path drops the mask: keep plain SDPA.
    windowed = bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True)
    if row_invariant and getattr(config, "_attn_implementation", None) == "sdpa" and not windowed:
        model.set_attn_implementation(ROWWISE_ATTENTION)
    return model


@contextlib.contextmanager
def pool_attention(chunk: int):
    """Decode steps of a row-invariant-prepared model attend ``chunk`` rows at a time (``_windowed_sdpa``);
    0 = off. Data generation's pool only: its rows are right-aligned, so the windows skip their holes."""
    token = _pool_chunk.set(chunk)
    try:
        yield
    finally:
        _pool_chunk.reset(token)


@contextlib.contextmanager
def small_batch_kernels(row_invariant: bool = False):
    """Our decoding loops' kernels; ``row_invariant``: also the bf16 rules above (the target's forwards)."""
    token, row_token = _enabled.set(True), _row_invariant.set(row_invariant)
    try:
        yield
    finally:
        _row_invariant.reset(row_token)
        _enabled.reset(token)
