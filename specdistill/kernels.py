"""Small-batch fp32 linears for CPU decoding: the matmul kernel MKL picks for a few rows is slow.

A decode step feeds 1 token per row, a verify step γ+1. For those few rows ``F.linear`` (x·Wᵀ) lands on
kernels that read the weight at a fraction of memory speed: on this 2-core machine SmolLM2-135M's tied
LM head (49,152 × 576, fp32) took 9.4 ms for 1 row, 21 ms for 2 and 33 ms for 3, but ``W @ xᵀ`` took 3.1 ms
for 2 rows. A 2-token verify forward cost 1.6× a 1-token step, which alone kept speculative decoding below
break-even on CPU. So, inside ``small_batch_kernels()``, a linear computes ``(W @ xᵀ)ᵀ`` where
``scripts/bench_linear.py`` measured it faster: a large weight (an LM head) at up to ``HEAD_MAX_ROWS`` rows,
one row doubled to two so it takes that path too (2.1–3.1× on the heads); a mid-sized weight (the MLP and
q/o projections) at 2–4 rows (1.1–2.0×). Small weights, and mid-sized ones at 1 or 5+ rows, were as fast
or faster with ``F.linear`` and keep it.

Only our decoding loops enter the context (``speculative._CachedModel``, ``evaluation``'s step timing), so
HF ``generate`` on the same model objects keeps its own kernels and the side-by-side benchmarks stay fair.
Training (grad enabled), other dtypes and other devices always use ``F.linear``. The result equals
``F.linear``'s up to fp32 summation order, the same kind of difference as between a 1-token step and a
(γ+1)-token verify, which the greedy-identity tests already cover.
"""

from __future__ import annotations

import contextlib
import contextvars
import types

import torch
import torch.nn.functional as F

HEAD_WEIGHT = 1 << 22  # elements: the LM heads (18.9M, 28.3M), not the layers (≤ 0.9M)
HEAD_MAX_ROWS = 64  # 1.2–1.3× still at 32–48 rows; a prefill has hundreds and keeps F.linear
MID_WEIGHT = 1 << 18  # elements: SmolLM2's q/o (331k) and MLP (885k) weights, the draft's MLP (393k)
MID_ROWS = (2, 3, 4)

_enabled = contextvars.ContextVar("specdistill_small_batch_kernels", default=False)


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


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if (_enabled.get() and x.dtype == torch.float32 and self.weight.dtype == torch.float32
            and x.device.type == "cpu" and not torch.is_grad_enabled()
            and faster_than_linear(self.weight.numel(), x.numel() // max(x.shape[-1], 1))):
        return small_batch_linear(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)


def prepare(model: torch.nn.Module) -> torch.nn.Module:
    """Route ``model``'s linears through ``_forward`` (idempotent); they behave as before outside the context."""
    for module in model.modules():
        if type(module) is torch.nn.Linear and getattr(module.forward, "__func__", None) is not _forward:
            module.forward = types.MethodType(_forward, module)
    return model


@contextlib.contextmanager
def small_batch_kernels():
    token = _enabled.set(True)
    try:
        yield
    finally:
        _enabled.reset(token)
