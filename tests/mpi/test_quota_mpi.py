"""ExDyna with per-rank quotas (``max_imbalance``) across ranks, against a reference computed here.

Each rank's gradient is ``1 + rank`` times larger, so under one threshold the last rank would select
most: the quotas cap it and raise the others. The reference recomputes, from every rank's gathered
accumulator, the counts at the reported threshold, the quotas (tests/unit/test_quota.py's
one-unit-at-a-time rule) and each rank's largest values, then the output, residual and bounds.
"""
import numpy as np
import pytest

import exdyna_mpi
from tests.conftest import allgather_array, mpi_assert
from exdyna_mpi.algorithm.layout import BlockLayout
from tests.unit.test_quota import _reference as reference_quotas

N, DENSITY, STEPS = 1 << 14, 0.02, 10


def _largest(v, m):
    """Indices of the m largest |v| (equal values: the lower index), ascending."""
    order = np.lexsort((np.arange(v.size), -np.abs(v.astype(np.float64))))
    return np.sort(order[:m])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("bound", [0.05, 0.0])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_quotas_against_gathered_reference(wcomm, bound, dtype):
    rank, p = wcomm.Get_rank(), wcomm.Get_size()
    sp = exdyna_mpi.ExDyna(N, DENSITY, wcomm, max_imbalance=bound)
    rng = np.random.default_rng([21, rank])
    shared = np.random.default_rng(22)
    moved = 0
    layout = BlockLayout(N, p, 1024, 32)   # the boundaries must follow the load at the threshold
    for t in range(STEPS):
        g = ((shared.standard_normal(N) + rng.standard_normal(N)) * (1 + rank)).astype(dtype)
        acc = sp.residual + g
        out = sp.step(g)
        s = sp.stats
        accs = allgather_array(acc, wcomm)
        thr = dtype(s.threshold)
        at_thr, cap, ranges = [], [], []
        for r in range(p):
            part = int(s.owned[r])
            lo, hi = int(s.bounds[part]), int(s.bounds[part + 1])
            ranges.append((lo, hi))
            at_thr.append(int(np.count_nonzero(np.abs(accs[r, lo:hi]) >= thr)))
            cap.append(hi - lo)
        want = reference_quotas(at_thr, cap, bound)
        mpi_assert(np.array_equal(s.bounds, layout.bounds()), f"step {t}: bounds {list(s.bounds)} != "
                   f"the reference layout's {list(layout.bounds())}", wcomm)
        mpi_assert(list(s.counts) == want, f"step {t}: counts {list(s.counts)} != reference quotas {want} "
                   f"(at the threshold {at_thr})", wcomm)
        mpi_assert(s.selected == sum(at_thr) == sp.controller.expected, f"step {t}: total changed", wcomm)
        mpi_assert(s.imbalance <= bound + 1e-12 or max(want) == -(-sum(want) // p),
                   f"step {t}: imbalance {s.imbalance}", wcomm)
        union = np.concatenate([lo + _largest(accs[r, lo:hi], want[r]) for r, (lo, hi) in enumerate(ranges)])
        num, den = np.zeros(p, np.int64), np.ones(p, np.int64)   # per partition: at the threshold / quota
        num[s.owned], den[s.owned] = at_thr, np.maximum(want, 1)
        layout.rebalance_blocks(union, t + 1, scale=(num, den))
        ref = np.zeros(N, dtype)
        ref[union] = accs[:, union].astype(np.float64).sum(axis=0) / p
        tol = 1e-6 if dtype == np.float32 else 1e-13
        mpi_assert(np.allclose(out, ref, rtol=tol, atol=tol * np.abs(ref).max()), f"step {t}: output", wcomm)
        mpi_assert(np.count_nonzero(out) <= union.size and np.all(out[np.setdiff1d(np.arange(N), union)] == 0),
                   f"step {t}: output off the union", wcomm)
        expect = acc.copy()
        expect[union] = 0
        mpi_assert(sp.residual.tobytes() == expect.tobytes(), f"step {t}: residual", wcomm)
        outs = allgather_array(out, wcomm)
        mpi_assert((outs == outs[0]).all(), f"step {t}: outputs not bit-identical", wcomm)
        moved += s.quota_moved
    mpi_assert(moved > 0, "the quotas never moved a selection: the test does not exercise them", wcomm)


@pytest.mark.mpi(min_size=2)
def test_a_rank_with_nothing_takes_its_quota_of_zeros(wcomm):
    """A rank whose accumulator is all zeros still selects its quota (its largest: zeros, lowest
    index first), found below the fine window (the coarse window, then every element)."""
    rank, p = wcomm.Get_rank(), wcomm.Get_size()
    sp = exdyna_mpi.ExDyna(N, DENSITY, wcomm, max_imbalance=0.0)
    rng = np.random.default_rng([23, rank])
    for t in range(3):
        g = rng.standard_normal(N).astype(np.float32) if rank else np.zeros(N, np.float32)
        out = sp.step(g)
        s = sp.stats
        mpi_assert(max(s.counts) == -(-s.selected // p) and s.counts[0] > 0 and s.selected == sp.controller.expected,
                   f"step {t}: counts {list(s.counts)}", wcomm)
        part = int(s.owned[0])
        lo = int(s.bounds[part])
        # rank 0's selection is the first counts[0] elements of its range; the others' values make them non-zero
        mine = np.flatnonzero(out[lo:int(s.bounds[part + 1])])
        mpi_assert(mine.tolist() == list(range(int(s.counts[0]))), f"step {t}: rank 0 selected {mine[:8]}...",
                   wcomm)


def test_quotas_need_the_measured_controller(wcomm):
    """Options agree on every rank, so every rank raises the same error with no collective."""
    with pytest.raises(ValueError, match="max_imbalance needs controller='measured'"):
        exdyna_mpi.ExDyna(N, DENSITY, wcomm, max_imbalance=0.05, controller="faithful")


@pytest.mark.mpi(min_size=2)
def test_quotas_with_the_deadline_exchange_equal_the_exact_one(wcomm):
    """The deadline exchange with no delay and no loss moves the quotas' selections like the exact
    exchange: the same bits."""
    rank = wcomm.Get_rank()
    ref = exdyna_mpi.ExDyna(N, DENSITY, wcomm, max_imbalance=0.0)
    sp = exdyna_mpi.ExDyna(N, DENSITY, wcomm, max_imbalance=0.0, deadline_ms=60_000, max_loss=0.0)
    rng = np.random.default_rng([24, rank])
    moved = 0
    for t in range(4):
        g = (rng.standard_normal(N) * (1 + rank)).astype(np.float32)
        want = ref.step(g.copy())
        out = sp.step(g.copy())
        moved += sp.stats.quota_moved
        same = (out.tobytes() == want.tobytes() and sp.residual.tobytes() == ref.residual.tobytes()
                and list(sp.stats.counts) == list(ref.stats.counts))
        mpi_assert(same and sp.stats.deadline["deferred"] == 0, f"step {t}: deadline differs from exact", wcomm)
    mpi_assert(moved > 0, "no selection moved", wcomm)
    sp.close()
