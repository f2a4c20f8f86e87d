"""ExDyna with adaptive rebalancing, across ranks.

Every rank must hold the same bounds and threshold each step (no extra communication decides
them), partitions stay non-empty and within the adaptive limit, and the output equals the
average of every rank's ``acc`` at the gathered selection (a reference computed here).
"""
import numpy as np
import pytest
from mpi4py import MPI

import exdyna_mpi
from exdyna_mpi.algorithm.layout import BlockLayout
from tests.conftest import allgather_array, mpi_assert


def _grad(rng, n):
    g = rng.standard_t(3, n).astype(np.float32)
    g[: n // 8] *= 4.0                                  # strong skew: the head eighth 4x
    return g


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("controller", ["measured", "faithful"])
def test_adaptive_bounds_identical_and_output_matches_reference(wcomm, controller):
    n, p = 1 << 16, wcomm.Get_size()
    sp = exdyna_mpi.ExDyna(n, 0.01, wcomm, controller=controller, balance="adaptive")
    rng = np.random.default_rng(100 + wcomm.Get_rank())
    ref_layout = BlockLayout(n, p)
    m = ref_layout.min_blocks_adaptive()
    for _ in range(12):
        g = _grad(rng, n)
        acc = sp.residual + g
        out = sp.step(g)
        st = sp.stats
        b = allgather_array(st.bounds, wcomm)
        mpi_assert((b == b[0]).all(), "bounds differ between ranks", wcomm)
        thr = wcomm.allgather(sp.threshold)
        mpi_assert(len(set(thr)) == 1, "next threshold differs between ranks", wcomm)
        sizes = np.diff(np.asarray(sp.layout.bounds()))
        mpi_assert(np.all(sizes > 0) and min(sp.layout.blk_part) >= m and sum(sp.layout.blk_part) ==
                   sp.layout.n_blocks, f"partition sizes {sp.layout.blk_part}", wcomm)
        # reference: the union of what each owner selects at the step's threshold, averaged acc
        owned = int(st.owned[wcomm.Get_rank()])
        lo, hi = int(st.bounds[owned]), int(st.bounds[owned + 1])
        mine = lo + np.nonzero(np.abs(acc[lo:hi]) >= np.float32(st.threshold))[0]
        union = np.concatenate(wcomm.allgather(mine))
        total = np.zeros(n, np.float32)
        total[union] = wcomm.allreduce(acc[union].astype(np.float64), op=MPI.SUM).astype(np.float32)
        ref = np.zeros(n, np.float32)
        ref[union] = total[union] / np.float32(p)
        mpi_assert(len(union) == st.selected and np.allclose(out, ref, rtol=1e-5, atol=1e-6),
                   "output differs from the reference", wcomm)
        outs = allgather_array(out, wcomm)
        mpi_assert((outs == outs[0]).all(), "outputs not bit-identical", wcomm)


@pytest.mark.mpi(min_size=2)
def test_faithful_controller_with_balance_true_keeps_the_authors_rule(wcomm):
    n, p = 1 << 16, wcomm.Get_size()
    sp = exdyna_mpi.ExDyna(n, 0.01, wcomm, controller="faithful", balance=True)
    ref = BlockLayout(n, p)
    rng = np.random.default_rng(7 + wcomm.Get_rank())
    for t in range(6):
        sp.step(_grad(rng, n))
        ref.rebalance_faithful(sp.stats.counts, t + 1)
        mpi_assert(sp.layout.blk_part == ref.blk_part, "faithful rule changed", wcomm)
