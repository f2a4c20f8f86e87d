"""The adaptive rebalancing rule against a simulated skewed load, and its limits."""
import numpy as np
import pytest

from exdyna_mpi.algorithm.layout import BlockLayout, partition_of


def _loads(layout, rate):
    """Per-partition expected selections for a per-block selection rate."""
    b = np.concatenate(([0], np.cumsum(layout.blk_part)))
    return np.array([rate[b[p]:b[p + 1]].sum() for p in range(layout.nparts)])


def _counts_by_rank(loads, t, n):
    return [int(round(loads[partition_of(r, t, n)])) for r in range(n)]


@pytest.mark.parametrize("nparts", [2, 4, 7])
def test_converges_under_strong_skew_where_the_neighbour_rule_stalls(nparts):
    rate = np.ones(1024)
    rate[:128] = 16.0                                # head eighth: 4x scale ~ 16x selection rate
    rate *= 40.0
    ada, fai = BlockLayout(1 << 20, nparts), BlockLayout(1 << 20, nparts)
    for t in range(60):
        ada.rebalance_adaptive(_counts_by_rank(_loads(ada, rate), t, nparts), t + 1)
        fai.rebalance_faithful(_counts_by_rank(_loads(fai, rate), t, nparts), t + 1)
    def imb(lay):
        return _loads(lay, rate).max() * nparts / rate.sum() - 1

    assert imb(ada) < 0.15
    assert imb(ada) < imb(fai)


def test_limits_and_partition_sum():
    lay = BlockLayout(1 << 20, 4)
    m = lay.min_blocks_adaptive()
    for t in range(20):                              # all load on partition 0: it shrinks to the minimum
        counts = [1000 if partition_of(r, t, 4) == 0 else 0 for r in range(4)]
        lay.rebalance_adaptive(counts, t + 1)
        assert sum(lay.blk_part) == lay.n_blocks and min(lay.blk_part) >= m
    assert lay.blk_part[0] == m
    b = lay.bounds()
    assert b[0] == 0 and b[-1] == 1 << 20 and np.all(np.diff(b) > 0)


def test_zero_counts_leave_bounds_alone_and_state_round_trips():
    lay = BlockLayout(100_000, 3)
    before = list(lay.blk_part)
    lay.rebalance_adaptive([0, 0, 0], 1)
    assert lay.blk_part == before
    lay.rebalance_adaptive([500, 10, 10], 2)
    other = BlockLayout(100_000, 3)
    other.load_state(lay.state())
    lay.rebalance_adaptive([300, 20, 5], 3)
    other.rebalance_adaptive([300, 20, 5], 3)
    assert lay.blk_part == other.blk_part
