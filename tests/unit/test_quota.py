"""Per-rank quotas (algorithm/quota.py) against a one-unit-at-a-time reference written here."""
import math

import numpy as np
import pytest

from exdyna_mpi.algorithm.quota import quotas


def _reference(counts, capacity, eps):
    """Move one selection at a time: cap the ranks above the bound, then give each excess unit to
    the rank with the lowest quota that has room (the lower rank on a tie)."""
    c = [int(x) for x in counts]
    cap = [int(x) for x in capacity]
    p, total = len(c), sum(c)
    if total == 0:
        return c
    bound = max(math.ceil(total / p), math.floor(total * (1 + eps) / p))
    while sum(min(x, bound) for x in cap) < total:
        bound += 1
    q = [min(x, bound) for x in c]
    for _ in range(total - sum(q)):
        r = min((x, i) for i, x in enumerate(q) if x < min(cap[i], bound))[1]
        q[r] += 1
    return q


def test_worked_case():
    # a hot rank and a cold one (counts of the recorded digits CNN at P = 4, one step)
    assert quotas([1458, 1041, 705, 463], [10**6] * 4, 0.05).tolist() == [962, 962, 872, 871]


def test_within_the_bound_nothing_moves():
    c = np.array([100, 104, 98, 102])
    assert quotas(c, [10**6] * 4, 0.05) is c


def test_small_partitions_raise_the_bound_not_lose_selections():
    assert quotas([0, 0, 0, 100], [10, 10, 10, 10**6], 0.05).tolist() == [10, 10, 10, 70]


@pytest.mark.parametrize("seed", range(4))
def test_random_against_reference(seed):
    rng = np.random.default_rng(seed)
    for _ in range(500):
        p = int(rng.integers(2, 9))
        cap = rng.integers(1, 3000, p)
        c = np.minimum(rng.integers(0, int(rng.integers(1, 2500)), p), cap)
        eps = float(rng.choice([0.0, 0.05, 0.1, 0.5]))
        q = quotas(c, cap, eps)
        assert q.tolist() == _reference(c, cap, eps), (c.tolist(), cap.tolist(), eps)
        assert q.sum() == c.sum() and (q <= cap).all()
