import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdistill.acceptance import (
    alpha_needed,
    best_gamma,
    expected_speedup,
    expected_tau,
    greedy_block_acceptance,
    per_position_acceptance,
    tau_from_accepted,
    token_acceptance,
)


def test_identical_gives_one_and_disjoint_gives_zero():
    p = torch.randn(5, 13)
    assert torch.allclose(token_acceptance(p, p, 1.0), torch.ones(5))
    assert torch.equal(token_acceptance(p, p, 0.0), torch.ones(5))
    a = torch.full((1, 4), -1e9)
    b = a.clone()
    a[0, 0] = b[0, 3] = 0.0
    assert token_acceptance(a, b, 1.0).item() == pytest.approx(0.0, abs=1e-6)
    assert token_acceptance(a, b, 0.0).item() == 0.0


def test_greedy_acceptance_is_argmax_agreement_counted_by_hand():
    target = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 3.0], [1.0, 5.0, 0.0]])
    draft = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 3.0], [0.0, 1.0, 0.0]])
    assert token_acceptance(target, draft, 0.0).tolist() == [1.0, 0.0, 1.0, 1.0]


@settings(max_examples=50, deadline=None)
@given(alpha=st.floats(0, 1), gamma=st.integers(1, 10))
def test_tau_limits(alpha, gamma):
    tau = expected_tau(alpha, gamma)
    assert 1.0 - 1e-9 <= tau <= gamma + 1 + 1e-9
    assert expected_tau(1.0, gamma) == gamma + 1
    assert expected_tau(0.0, gamma) == 1.0


def test_iid_simulation_matches_closed_form():
    rng = random.Random(0)
    alpha, gamma = 0.7, 5
    agree = [1.0 if rng.random() < alpha else 0.0 for _ in range(200_000)]
    counts = greedy_block_acceptance(agree, gamma)
    assert tau_from_accepted(counts) == pytest.approx(expected_tau(alpha, gamma), rel=0.01)
    rates = per_position_acceptance(counts, gamma)
    assert all(r == pytest.approx(alpha, abs=0.01) for r in rates)


def test_block_counts_and_positions():
    assert greedy_block_acceptance([1, 1, 1, 1, 1, 1], 5) == [5]
    assert greedy_block_acceptance([0, 0, 0], 4) == [0, 0, 0]
    assert greedy_block_acceptance([1, 0, 1, 1], 2) == [1, 2]
    assert per_position_acceptance([2, 0, 1], 2) == [pytest.approx(2 / 3), pytest.approx(1 / 2)]


def test_speedup_and_best_gamma():
    assert expected_speedup(3.0, 2, 0.0, 1.0) == 3.0
    gamma, speed = best_gamma(0.9, 0.05, {g: 1.0 for g in range(1, 11)})
    assert gamma >= 5 and speed > 2
    gamma_slow, _ = best_gamma(0.3, 0.5, {g: 1.0 for g in range(1, 11)})
    assert gamma_slow == 1


@settings(max_examples=60, deadline=None)
@given(st.floats(0.5, 3.0), st.floats(0.0, 0.5), st.lists(st.floats(1.0, 2.0), min_size=1, max_size=8))
def test_alpha_needed_is_the_smallest_alpha_that_reaches_the_speedup(speedup, cost, verify_list):
    verify = {g + 1: v for g, v in enumerate(verify_list)}
    found = alpha_needed(speedup, cost, verify)
    reachable = [g for g, v in verify.items() if expected_speedup(g + 1.0, g, cost, v) >= speedup]
    if not reachable:
        assert found is None
        return
    alpha, gamma = found
    assert gamma in reachable
    assert expected_speedup(expected_tau(alpha, gamma), gamma, cost, verify[gamma]) >= speedup - 1e-9
    below = max(alpha - 1e-3, 0.0)
    if alpha > 1e-3:  # a little less α misses the speedup at every γ
        assert all(expected_speedup(expected_tau(below, g), g, cost, v) < speedup for g, v in verify.items())


def test_alpha_needed_known_values():
    # GPU-like: free draft, free verify. Break-even needs nothing; 2x at γ=1 needs α = 1.
    assert alpha_needed(1.0, 0.0, {1: 1.0})[0] == pytest.approx(0.0, abs=1e-5)
    assert alpha_needed(2.0, 0.0, {1: 1.0})[0] == pytest.approx(1.0, abs=1e-5)
    # 1.5x at γ=1 with c=0, v=1: τ = 1 + α = 1.5.
    assert alpha_needed(1.5, 0.0, {1: 1.0}) == (pytest.approx(0.5, abs=1e-5), 1)
    # A verify that costs 3 steps can never pay at γ=1 (τ ≤ 2).
    assert alpha_needed(1.0, 0.0, {1: 3.0}) is None
