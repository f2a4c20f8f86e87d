"""Every sparsifier in the factory on 1..4 ranks, against references computed here from gathered data.

Run serially (P=1 and COMM_SELF) and under ``mpiexec -n 2/3/4 ... --with-mpi``. For each step the
test gathers every rank's accumulator (residual before + grad), output and residual after, and checks
the method's own semantics: which indices each rank selects (recomputed from the gathered
accumulators and the reported thresholds), that ``out`` is the average of the contributions, and
that error feedback conserves ``residual_after + contribution == residual_before + grad``.
"""
import numpy as np
import pytest

import exdyna_mpi
from exdyna_mpi.sparsifiers.baselines import rangefloat
from tests.conftest import allgather_array, mpi_assert

pytestmark = pytest.mark.mpi

NAMES = exdyna_mpi.available()
# options that make a few steps reach every branch (exact and estimated thresholds, repartitions)
OPTIONS = {"oktopk": dict(local_period=2, global_period=2, region_period=3), "fft": dict(block=256)}
NUMEL, DENSITY, STEPS = 3001, 0.02, 4


def _grad(rank, t, numel, dtype, scale=0.03):
    """Heavy-tailed (Laplace) gradient with a hot region whose place moves with t."""
    rng = np.random.default_rng([7, rank, t])
    g = rng.laplace(0.0, scale, numel)
    lo = (t * numel // 5) % numel
    g[lo: lo + numel // 10] *= 4.0
    return g.astype(dtype)


def _tol(dtype):
    return 2e-6 if dtype == np.float32 else 1e-13


def _close(a, b, dtype, scale):
    t = _tol(dtype)
    return np.allclose(a, b, rtol=t, atol=t * max(scale, 1e-30))


# --------------------------------------------------------------------------- per-family references
def _check_union(sp, comm, accs, out, after, t):
    """topk / cltk / threshold / gaussiank / dgc: S_r = {|acc_r| >= thr_r}; U = union of the S_r."""
    P = comm.Get_size()
    st = sp.stats
    thr = st.thresholds
    dt = accs.dtype.type
    sel = []
    for r in range(P):
        chosen = sp.name != "cltk" or r == st.iteration % P
        sel.append(np.flatnonzero(np.abs(accs[r]) >= dt(thr[r])) if chosen else np.array([], np.int64))
    mpi_assert(np.array_equal([s.size for s in sel], st.counts), f"{sp.name}: counts differ", comm)
    if sp.name in ("topk", "cltk") and sp.density < 1:
        for r in range(P):
            if sel[r].size:  # the k-th largest magnitude, by a full sort here
                kth = np.sort(np.abs(accs[r]))[-sp.k]
                mpi_assert(thr[r] == kth and sel[r].size == sp.k, f"{sp.name}: not the top-k", comm)
    if sp.name == "threshold":
        mpi_assert(np.all(thr == float(threshold_dt(1 / (2 * np.sqrt(sp.k)), dt))),
                   "threshold: not the default 1/(2 sqrt k)", comm)
    union = np.unique(np.concatenate(sel)).astype(np.int64)
    mpi_assert(st.union == union.size == st.selected, f"{sp.name}: union size", comm)
    _check_average_on(union, sp, comm, accs, out, after)


def _check_average_on(union, sp, comm, accs, out, after):
    """out is every rank's acc averaged on ``union`` and 0 elsewhere; the residual is acc zeroed there."""
    P, rank = comm.Get_size(), comm.Get_rank()
    mask = np.zeros(accs.shape[1], bool)
    mask[union] = True
    ref = accs[:, union].astype(np.float64).sum(axis=0) / P
    mpi_assert(np.all(out[~mask] == 0), f"{sp.name}: out not zero off the union", comm)
    mpi_assert(_close(out[union], ref, accs.dtype, np.abs(ref).max(initial=0)), f"{sp.name}: out[U]", comm)
    expect = accs[rank].copy()
    expect[union] = 0
    mpi_assert(after.tobytes() == expect.tobytes(), f"{sp.name}: residual is not acc zeroed on U", comm)


def _check_owned(sp, comm, accs, out, after, t):
    """exdyna / micro: each rank selects |acc| >= threshold inside the partition it owns."""
    P = comm.Get_size()
    st = sp.stats
    b = st.bounds
    dt = accs.dtype.type
    sel = [b[st.owned[r]] + np.flatnonzero(np.abs(accs[r, b[st.owned[r]]:b[st.owned[r] + 1]]) >=
                                            threshold_dt(st.threshold, dt)) for r in range(P)]
    mpi_assert(np.array_equal([s.size for s in sel], st.counts), f"{sp.name}: counts differ", comm)
    union = np.concatenate(sel)
    mpi_assert(np.unique(union).size == union.size, f"{sp.name}: selections overlap", comm)
    _check_average_on(union, sp, comm, accs, out, after)


def threshold_dt(thr, dt):
    """The smallest value of the dtype >= thr (how the sparsifiers compare exactly)."""
    x = dt(thr)
    return np.nextafter(x, dt(np.inf)) if float(x) < thr else x


def _check_dense(sp, comm, accs, out, after, t):
    ref = accs.astype(np.float64).sum(axis=0) / comm.Get_size()
    mpi_assert(_close(out, ref, accs.dtype, np.abs(ref).max()), "dense: not the average", comm)
    mpi_assert(np.all(after == 0), "dense: residual not zero", comm)


def _check_oktopk(sp, comm, accs, out, after, t):
    """L_r = {|acc_r| >= thr_r}; R = sum of acc_r over L_r; G = {i in U : |R_i| >= global thr}."""
    P, rank = comm.Get_size(), comm.Get_rank()
    st = sp.stats
    dt = accs.dtype.type
    n = accs.shape[1]
    sel = [np.flatnonzero(np.abs(accs[r]) >= dt(st.thresholds[r])) for r in range(P)]
    mpi_assert(np.array_equal([s.size for s in sel], st.counts), "oktopk: local counts", comm)
    if t % sp.options["local_period"] == 0 and sp.density < 1:
        kths = [np.sort(np.abs(accs[r]))[-sp.k] for r in range(P)]
        mpi_assert(np.array_equal(kths, st.thresholds), "oktopk: exact local threshold", comm)
    b = st.bounds
    mpi_assert(b[0] == 0 and b[-1] == n and np.all(np.diff(b) >= 0), "oktopk: bounds", comm)
    R = np.zeros(n)
    inL = np.zeros((P, n), bool)
    for r in range(P):
        inL[r, sel[r]] = True
        R[sel[r]] += accs[r, sel[r]]
    U = inL.any(axis=0)
    G = np.flatnonzero(out)
    mpi_assert(G.size == st.selected and U[G].all(), "oktopk: global set not inside the union", comm)
    g = st.global_threshold
    band = 1e-5 if accs.dtype == np.float32 else 1e-12
    must = np.flatnonzero(U & (np.abs(R) >= g * (1 + band)))
    may = U & (np.abs(R) >= g * (1 - band))
    mpi_assert(np.isin(must, G).all() and may[G].all(), "oktopk: global set is not |R| >= thr", comm)
    if st.exact_global and sp.density < 1:
        mpi_assert(G.size == min(sp.k, np.count_nonzero(U & (R != 0))), "oktopk: exact global top-k", comm)
    mpi_assert(_close(out[G], R[G] / P, accs.dtype, np.abs(R).max(initial=0) / P), "oktopk: out[G]", comm)
    expect = accs[rank].copy()
    expect[np.intersect1d(sel[rank], G)] = 0
    mpi_assert(after.tobytes() == expect.tobytes(), "oktopk: residual is not acc zeroed on L∩G", comm)
    if sp.density < 1:  # next step's thresholds follow the VGG adjust rules
        k, c, thr = sp.k, sel[rank].size, st.thresholds[rank]
        want_local = thr / 1.012 if c < 2 * k / 3 else thr * 1.012 if c > 5 * k / 4 else thr
        want_global = g if st.exact_global else (g / 1.008 if G.size < 2 * k / 3 else
                                                 g * 1.008 if G.size > 4 * k / 3 else g)
        mpi_assert(sp.local_thr == want_local and sp.global_thr == want_global, "oktopk: adjust rules", comm)


def _check_fft(sp, comm, accs, out, after, t):
    """Kept bins = {|F_r| >= tau_r}; contribution = acc - residual is within the format's bound."""
    P, rank = comm.Get_size(), comm.Get_rank()
    st = sp.stats
    B, n = sp.block, accs.shape[1]
    rows = -(-n // B)
    bits = st.bits
    ok_count, ok_bound = True, True
    for r in range(P):
        x = np.zeros(rows * B, accs.dtype)
        x[:n] = accs[r]
        F = np.fft.rfft(x.reshape(rows, B), axis=1).ravel()
        kept = np.abs(F) >= np.abs(F).dtype.type(st.thresholds[r])
        ok_count &= int(kept.sum()) == int(st.counts[r])
        parts = np.stack([F.real[kept], F.imag[kept]]).astype(np.float64)
        if bits == 32:
            err = np.abs(parts) * 2.0 ** -24
        else:
            err = rangefloat.error_bound(parts, int(st.e_max[r]), int(st.e_bits[r]), bits)
        bound = np.sqrt(2.0 / B * np.sum(err ** 2))
        if r == rank:
            c = accs[r].astype(np.float64) - after
            exact = np.fft.irfft(np.where(kept, F, 0).reshape(rows, B // 2 + 1), n=B, axis=1).ravel()[:n]
            slack = 1e-5 * np.linalg.norm(accs[r]) if accs.dtype == np.float32 else 1e-10 * np.linalg.norm(accs[r])
            ok_bound = np.linalg.norm(c - exact) <= bound + slack
    mpi_assert(ok_count, "fft: kept bins differ from |F| >= tau", comm)
    mpi_assert(ok_bound, "fft: reconstruction error above the format's bound", comm)


CHECKS = {"dense": _check_dense, "exdyna": _check_owned, "micro": _check_owned, "oktopk": _check_oktopk,
          "fft": _check_fft}


def _run_and_check(name, comm, dtype, density=DENSITY, numel=NUMEL, steps=STEPS, **extra):
    P, rank = comm.Get_size(), comm.Get_rank()
    opts = {**OPTIONS.get(name, {}), **extra}
    sp = exdyna_mpi.make(name, numel, density, comm, **opts)
    mpi_assert(np.all(sp.residual == 0), f"{name}: residual not zero before the first step", comm)
    for t in range(steps):
        before = sp.residual
        grad = _grad(rank, t, numel, dtype)
        out = sp.step(grad)
        after = sp.residual
        outs = allgather_array(out, comm)
        mpi_assert(all(o.tobytes() == out.tobytes() for o in outs), f"{name}: outputs differ across ranks", comm)
        mpi_assert(out.dtype == dtype and out.shape == (numel,), f"{name}: out kind", comm)
        acc = before + grad  # the kernels' IEEE adds
        accs = allgather_array(acc, comm)
        # error feedback: what left the residual is this rank's contribution; their mean is out
        contrib = allgather_array(acc.astype(np.float64) - after, comm)
        scale = np.abs(accs).max()
        mpi_assert(_close(contrib.sum(axis=0) / P, out, dtype, scale) if name != "fft" else
                   np.allclose(contrib.sum(axis=0) / P, out, atol=1e-5 * scale),
                   f"{name}: out != mean contribution", comm)
        CHECKS.get(name, _check_union)(sp, comm, accs, out, after, t)
        mpi_assert(sp.stats.iteration == t and len(sp.stats.counts) == P, f"{name}: stats", comm)
        mpi_assert(sp.stats.bytes_sent >= 0 and (P == 1 or sp.stats.bytes_received > 0), f"{name}: bytes", comm)
    return sp


@pytest.mark.parametrize("name", NAMES)
def test_semantics_against_gathered_reference(name, comm):
    _run_and_check(name, comm, np.float32)


@pytest.mark.parametrize("name", NAMES)
def test_semantics_float64(name, wcomm):
    _run_and_check(name, wcomm, np.float64)


@pytest.mark.parametrize("name", [n for n in NAMES if n != "fft"])
def test_density_one_is_the_dense_average(name, wcomm):
    P, rank = wcomm.Get_size(), wcomm.Get_rank()
    sp = exdyna_mpi.make(name, 500, 1.0, wcomm, **OPTIONS.get(name, {}))
    for t in range(2):
        grad = _grad(rank, t, 500, np.float64)
        out = sp.step(grad)
        ref = allgather_array(grad, wcomm).sum(axis=0) / P
        mpi_assert(np.allclose(out, ref, rtol=1e-13, atol=1e-16), f"{name}: not the dense average", wcomm)
        mpi_assert(np.all(sp.residual == 0), f"{name}: residual left at density 1", wcomm)


def test_fft_full_spectrum_float32_parts_is_dense(wcomm):
    P, rank = wcomm.Get_size(), wcomm.Get_rank()
    sp = exdyna_mpi.make("fft", 1000, 1.0, wcomm, bits=32, block=128)
    grad = _grad(rank, 0, 1000, np.float64)
    out = sp.step(grad)
    ref = allgather_array(grad, wcomm).sum(axis=0) / P
    mpi_assert(np.allclose(out, ref, atol=1e-6 * np.abs(ref).max()), "fft: density 1 is not dense", wcomm)


def _state_bytes(sp):
    d = sp.state_dict()
    return repr({k: (v.tobytes() if isinstance(v, np.ndarray) else v) for k, v in sorted(d.items())})


@pytest.mark.parametrize("name", NAMES)
def test_bad_input_on_one_rank_raises_everywhere_state_untouched(name, wcomm):
    P, rank = wcomm.Get_size(), wcomm.Get_rank()
    sp = exdyna_mpi.make(name, 800, 0.05, wcomm, **OPTIONS.get(name, {}))
    sp.step(_grad(rank, 0, 800, np.float32))
    state = _state_bytes(sp)
    bad_rank = P - 1
    for bad in ("length", "nan"):
        g = _grad(rank, 1, 800, np.float32)
        if rank == bad_rank:
            g = np.zeros(801, np.float32) if bad == "length" else g
            if bad == "nan":
                g[3] = np.nan
        msg = None
        try:
            sp.step(g)
        except exdyna_mpi.StepError as e:
            msg = str(e)
        msgs = wcomm.allgather(msg)
        mpi_assert(msg is not None and len(set(msgs)) == 1 and f"rank {bad_rank}" in msg,
                   f"{name}: not the same StepError on every rank: {msgs}", wcomm)
        mpi_assert(_state_bytes(sp) == state, f"{name}: state changed by a refused step", wcomm)
    # the sparsifier still works, and a resumed copy continues bit-exactly
    twin = exdyna_mpi.make(name, 800, 0.05, wcomm, **OPTIONS.get(name, {}))
    twin.load_state_dict(sp.state_dict())
    for t in (1, 2, 3):
        g = _grad(rank, t, 800, np.float32)
        a, b = sp.step(g), twin.step(g)
        mpi_assert(a.tobytes() == b.tobytes(), f"{name}: resumed copy diverged", wcomm)


@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_skip_policy(name, wcomm):
    rank = wcomm.Get_rank()
    sp = exdyna_mpi.make(name, 600, 0.05, wcomm, nonfinite="skip", **OPTIONS.get(name, {}))
    sp.step(_grad(rank, 0, 600, np.float32))
    state = _state_bytes(sp)
    g = _grad(rank, 1, 600, np.float32)
    if rank == 0:
        g[5] = np.inf
    out = sp.step(g)
    mpi_assert(np.all(out == 0) and sp.stats.skipped, f"{name}: step not skipped", wcomm)
    mpi_assert(_state_bytes(sp) == state, f"{name}: skipped step changed state", wcomm)


def test_topk_union_shows_build_up(wcomm):
    """Independent gradients: the union is larger than one rank's k (up to P k)."""
    P, rank = wcomm.Get_size(), wcomm.Get_rank()
    sp = exdyna_mpi.make("topk", 4000, 0.01, wcomm)
    sp.step(_grad(rank, 0, 4000, np.float32))
    mpi_assert(sp.k <= sp.stats.union <= P * sp.k and (P == 1 or sp.stats.union > sp.k),
               f"union {sp.stats.union} for k={sp.k}, P={P}", wcomm)
