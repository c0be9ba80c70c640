"""Acceptance math for speculative decoding: pure functions, property-tested (see docs/metrics.md).

p is the target's distribution, q the draft's, both after the same temperature / top-k / top-p.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def token_acceptance(target_logits: torch.Tensor, draft_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-position acceptance probability: Σ_v min(p_v, q_v) = 1 − TV(p, q); greedy (T=0): argmax agreement."""
    if temperature == 0:
        return (target_logits.argmax(-1) == draft_logits.argmax(-1)).float()
    p = F.softmax(target_logits.float() / temperature, dim=-1)
    q = F.softmax(draft_logits.float() / temperature, dim=-1)
    return torch.minimum(p, q).sum(-1)


def expected_tau(alpha: float, gamma: int) -> float:
    """Mean tokens per target forward with i.i.d. acceptance α and γ drafted tokens (bonus included)."""
    if gamma < 0:
        raise ValueError("gamma must be >= 0")
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_speedup(tau: float, gamma: int, cost_ratio: float, verify_cost: float = 1.0) -> float:
    """τ / (γ·c + v): tokens per unit of target-step time, relative to plain decoding (1 token per step)."""
    return tau / (gamma * cost_ratio + verify_cost)


def tau_from_accepted(accepted: Sequence[int]) -> float:
    """Mean tokens per verification step from per-step accepted-draft counts (each step adds one bonus)."""
    if not accepted:
        return float("nan")
    return sum(n + 1 for n in accepted) / len(accepted)


def per_position_acceptance(accepted: Sequence[int], gamma: int) -> list[float]:
    """P(token i accepted | tokens < i accepted), i = 1..γ, from per-step accepted counts (each ≤ γ)."""
    rates = []
    for i in range(1, gamma + 1):
        reached = sum(1 for n in accepted if n >= i - 1)
        passed = sum(1 for n in accepted if n >= i)
        rates.append(passed / reached if reached else math.nan)
    return rates


def greedy_block_acceptance(agree: Sequence[float] | torch.Tensor, gamma: int) -> list[int]:
    """Accepted counts of γ-blocks laid end to end along the target's greedy continuation.

    ``agree[i]`` is 1 where the draft's argmax matches the target's token i. Along the target's greedy
    path this is exactly what greedy speculative decoding accepts: an accepted draft token equals the
    target's, and after a rejection the target's token is used, so the draft always sees the target's
    prefix. Each block consumes its accepted tokens plus the target's bonus/correction token. A final
    block cut short by the end of the sequence is censored (we cannot know whether it would have been
    accepted) and left out rather than counted as a rejection.
    """
    values = [float(a) for a in agree]
    counts, i = [], 0
    while i < len(values):
        n = 0
        while n < gamma and i + n < len(values) and values[i + n] >= 0.5:
            n += 1
        if n < gamma and i + n == len(values):
            break
        counts.append(n)
        i += n + 1
    return counts


def best_gamma(alpha: float, cost_ratio: float, verify_costs: dict[int, float]) -> tuple[int, float]:
    """The γ with the highest expected speedup, given measured verify costs v(γ)."""
    scores = {g: expected_speedup(expected_tau(alpha, g), g, cost_ratio, v) for g, v in verify_costs.items()}
    gamma = max(scores, key=scores.get)
    return gamma, scores[gamma]


def alpha_needed(speedup: float, cost_ratio: float, verify_costs: dict[int, float],
                 tolerance: float = 1e-6) -> tuple[float, int] | None:
    """The smallest i.i.d. α whose expected speedup τ/(γc+v) reaches ``speedup`` at some γ, and that γ.

    ``None`` when no α can: even α = 1 gives τ = γ+1, so a γ reaches ``speedup`` only if
    (γ+1) ≥ speedup·(γc + v(γ)). This is the hardware's side of the bargain: on a CPU, where verifying γ
    tokens costs v(γ) > 1 target steps, it says how good a draft must be before any training is worth it."""
    best = None
    for gamma, verify in verify_costs.items():
        if expected_speedup(gamma + 1.0, gamma, cost_ratio, verify) < speedup:
            continue
        low, high = 0.0, 1.0  # the speedup rises with α at fixed γ: bisect
        while high - low > tolerance:
            mid = (low + high) / 2
            if expected_speedup(expected_tau(mid, gamma), gamma, cost_ratio, verify) >= speedup:
                high = mid
            else:
                low = mid
        if best is None or high < best[0]:
            best = (high, gamma)
    return best
