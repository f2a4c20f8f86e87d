"""The default (measured) controller holds the density on correlated, constant, rotating and
scale-changing streams (jobs/streams.py), across ranks, with the bounds of the controller issue:
after step 20 at least 95 % of steps within +-10 % of k, none above 1.5x, mean within +-3 %, no step
that selects nothing while the accumulator is non-zero. Smaller N than the benchmark (k = 1310).

Each step also checks what the controller promises exactly: the total selected equals the count
its summed histogram gave for the chosen threshold, the threshold is the same on every rank, and
the output is the average of every rank's ``acc`` at the union of the owners' selections (a
reference computed here).
"""
import numpy as np
import pytest
import streams  # jobs/streams.py: pytest.ini puts jobs/ on the path
from mpi4py import MPI

import exdyna_mpi
from exdyna_mpi.kernels.cpu_index import index_form
from tests.conftest import allgather_array, mpi_assert

N, DENSITY, STEPS, SKIP = 1 << 17, 0.01, 36, 20


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stream", ["ar0.9", "ar0.99", "constant", "rotate3", "scale10"])
def test_default_controller_holds_density_on_correlated_streams(wcomm, stream):
    rank, p = wcomm.Get_rank(), wcomm.Get_size()
    st = streams.Synthetic(stream, N, rank, p, seed=3)
    if stream == "scale10":    # bring the scale changes (steps 60 and 90) into a short test
        st.t = 50
    sp = exdyna_mpi.ExDyna(N, DENSITY, wcomm)
    assert sp.options["controller"] == "measured"
    k = int(DENSITY * N)
    ratios = []
    for t in range(STEPS):
        g = st.next()
        acc = sp.residual + g
        out = sp.step(g)
        s = sp.stats
        ratios.append(s.selected / k)
        mpi_assert(s.selected == sp.controller.expected, f"step {t}: selected {s.selected}, summed "
                   f"histogram said {sp.controller.expected}", wcomm)
        thr = wcomm.allgather(s.threshold)
        mpi_assert(len(set(thr)) == 1, f"step {t}: thresholds differ {thr}", wcomm)
        nonzero = wcomm.allreduce(int(np.count_nonzero(acc)), op=MPI.SUM)
        mpi_assert(s.selected > 0 or nonzero == 0, f"step {t}: nothing selected", wcomm)
        if t in (0, SKIP, STEPS - 1):   # the reference, on a few steps
            owned = int(s.owned[rank])
            lo, hi = int(s.bounds[owned]), int(s.bounds[owned + 1])
            mine = lo + np.nonzero(np.abs(acc[lo:hi]) >= np.float32(s.threshold))[0]
            union = np.concatenate(wcomm.allgather(mine))
            ref = np.zeros(N, np.float32)
            tot = np.zeros(N, np.float32)
            tot[union] = wcomm.allreduce(acc[union].astype(np.float64), op=MPI.SUM).astype(np.float32)
            ref[union] = tot[union] / np.float32(p)
            mpi_assert(union.size == s.selected and np.allclose(out, ref, rtol=1e-5, atol=1e-5),
                       f"step {t}: output differs from the reference: {union.size} {s.selected} "
                       f"{np.abs(out - ref).max()}", wcomm)
            outs = allgather_array(out, wcomm)
            mpi_assert((outs == outs[0]).all(), "outputs not bit-identical", wcomm)
    a = np.array(ratios[SKIP:])
    in_band = np.mean(np.abs(a - 1) <= 0.1)
    mpi_assert(in_band >= 0.95 and a.max() <= 1.5 and abs(a.mean() - 1) <= 0.03,
               f"{stream}: in band {in_band:.2f}, max {a.max():.3f}, mean {a.mean():.3f}", wcomm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("stream", ["ar0.9", "constant", "skewed"])
def test_quotas_bound_the_imbalance_and_keep_the_density(wcomm, stream):
    """``max_imbalance=0.05`` on correlated, constant and layer-skewed streams: every step's
    imbalance within the bound (these partitions hold far more than a quota), the same density
    bounds as the default, the total the summed histogram promised, and outputs identical."""
    rank, p = wcomm.Get_rank(), wcomm.Get_size()
    st = streams.Synthetic(stream, N, rank, p, seed=4)
    sp = exdyna_mpi.ExDyna(N, DENSITY, wcomm, max_imbalance=0.05)
    k = int(DENSITY * N)
    ratios, moved = [], 0
    for t in range(STEPS):
        out = sp.step(st.next())
        s = sp.stats
        ratios.append(s.selected / k)
        moved += s.quota_moved
        mpi_assert(s.imbalance <= 0.05 + 1e-12, f"step {t}: imbalance {s.imbalance:.4f}", wcomm)
        mpi_assert(s.selected == sp.controller.expected, f"step {t}: total {s.selected} != {sp.controller.expected}",
                   wcomm)
        if t % 12 == 0:
            outs = allgather_array(out, wcomm)
            mpi_assert((outs == outs[0]).all(), f"step {t}: outputs not bit-identical", wcomm)
    a = np.array(ratios[SKIP:])
    in_band = np.mean(np.abs(a - 1) <= 0.1)
    mpi_assert(in_band >= 0.95 and a.max() <= 1.5 and abs(a.mean() - 1) <= 0.03,
               f"{stream}: in band {in_band:.2f}, max {a.max():.3f}, mean {a.mean():.3f}", wcomm)
    mpi_assert(moved > 0, f"{stream}: no step moved a selection (the bound was never reached)", wcomm)


@pytest.mark.mpi(min_size=2)
def test_summed_words_do_not_grow_with_p(wcomm):
    """Bytes of one step = compact indices + values + the summed words (a fixed number, whatever P) + one
    count word per rank: the ring model of ``transport.Exchange``, counted here from the counts."""
    rank, p = wcomm.Get_rank(), wcomm.Get_size()
    n = 1 << 16
    sp = exdyna_mpi.ExDyna(n, 0.002, wcomm)
    st = streams.Synthetic("ar0.9", n, rank, p, seed=1)
    for _ in range(4):
        sp.step(st.next())
    c = sp.stats.counts
    words = 3 + sp.sum_size(_Step(sp))          # 3 error / dtype flags, then the histograms
    assert words == 3 + sp.controller.N_COARSE + sp.controller.n_fine
    total = int(c.sum())
    reduce = sum(2 * (p - 1) * w * 4 // p for w in [words] + sp.controller.zoom_words)
    # indices in compact form: each rank's bytes from its count and the span of its partition
    b, own = sp.stats.bounds, sp.stats.owned
    nbytes = [index_form(int(c[r]), int(b[own[r] + 1] - b[own[r]]))[1] for r in range(p)] if p > 1 else [0]
    idx_bytes = sum(nbytes) - nbytes[(rank + 1) % p]
    want = idx_bytes + 2 * (p - 1) * total * 4 // p + reduce + (p - 1) * 8
    mpi_assert(sp.stats.bytes_sent == want, f"bytes sent {sp.stats.bytes_sent}, model {want}", wcomm)


class _Step:
    def __init__(self, sp):
        import numpy as _np
        self.t, self.dtype = sp.iteration, _np.dtype(_np.float32)
