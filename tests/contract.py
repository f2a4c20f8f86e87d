"""The shared contract, for every sparsifier of ``exdyna_mpi.available()`` and every backend.

The check bodies live here; tests/mpi/test_contract.py runs them for every sparsifier on every
backend in the serial and mpiexec -n 2/3/4 lanes (``backend``: the CPU, and ``device="cuda"``
where it can run: a GPU, or the Numba CUDA simulator), tests/cudasim/test_contract_sim.py on the
simulated CUDA device at P=1, bit for bit against the CPU. Like mpi4py's tests looping over array backends
(test/arrayimpl.py), the bodies do not know which backend they run on: buffers go in and out
through the sparsifier's public ``ops`` (``from_host`` / ``to_host``).
"""
import pickle

import numpy as np
import pytest

import exdyna_mpi
from exdyna_mpi.sparsifiers.registry import REGISTRY
from tests.conftest import allgather_array, mpi_assert

NAMES = exdyna_mpi.available()
N, DENSITY, STEPS = 240, 0.05, 3
#: small, so the simulator (one OS thread per CUDA thread) stays quick
OPTIONS = {"exdyna": dict(n_blocks=16, block_align=4), "fft": dict(block=64),
           "oktopk": dict(local_period=2, global_period=2, region_period=2)}
#: the sparsifiers whose step runs on CUDA buffers on a real GPU (``CAPABILITIES.device_step``); the others' step is
#: host NumPy code, refused there (tests/gpu checks the refusal). The simulator (NumPy device
#: buffers) runs every sparsifier on the CUDA ops.
GPU_NAMES = tuple(n for n in NAMES if REGISTRY[n].CAPABILITIES.device_step)


def _cuda_is_simulated():
    from exdyna_mpi.arrays.device import BACKEND

    return BACKEND.simulated


def _make(name, comm, device, **kw):
    return exdyna_mpi.make(name, N, DENSITY, comm, device=device, **OPTIONS.get(name, {}), **kw)


def _grads(rank, steps=STEPS, dtype=np.float32):
    """A correlated stream per rank (AR(1) around a shared signal), with a change of scale."""
    rng = np.random.default_rng(7 + rank)
    base = np.random.default_rng(3).standard_normal(N)
    g, out = base.copy(), []
    for t in range(steps):
        g = 0.8 * g + 0.4 * rng.standard_normal(N)
        out.append((g * (0.05 if t < 2 else 0.5)).astype(dtype))
    return out


def _skip_unsupported(name, backend):
    if backend == "cuda" and not _cuda_is_simulated() and name not in GPU_NAMES:
        pytest.skip(f"{name}: host NumPy code in its step, refused on a CUDA device; the simulator runs it")


def _host(sp, x):
    return np.asarray(sp.ops.to_host(x))


def check_same_output(wcomm, backend, name, steps=STEPS):
    """Every step: the same output on every rank; on a device, the CPU's bits, residual, counts, bytes."""
    _skip_unsupported(name, backend)
    sp = _make(name, wcomm, backend)
    ref = _make(name, wcomm, "cpu") if backend != "cpu" else None
    for t, g in enumerate(_grads(wcomm.Get_rank(), steps)):
        out = _host(sp, sp.step(sp.ops.from_host(g.copy())))
        outs = allgather_array(out, wcomm)
        mpi_assert(all(o.tobytes() == out.tobytes() for o in outs), f"{name}: outputs differ between ranks", wcomm)
        mpi_assert(sp.stats.iteration == t and sp.iteration == t + 1 and not sp.stats.skipped, "iteration", wcomm)
        mpi_assert(len(sp.stats.counts) == wcomm.Get_size() and sp.stats.imbalance >= 0, "stats", wcomm)
        if ref is not None:
            want = ref.step(g.copy())
            same = (out.tobytes() == want.tobytes() and sp.residual.tobytes() == ref.residual.tobytes()
                    and list(sp.stats.counts) == list(ref.stats.counts)
                    and (sp.stats.bytes_sent, sp.stats.bytes_received) == (ref.stats.bytes_sent,
                                                                          ref.stats.bytes_received))
            mpi_assert(same, f"{name}: {backend} differs from the CPU at step {t}", wcomm)


def check_round_trip(wcomm, backend, name):
    """state_dict after a step, pickled, loaded into a fresh sparsifier: the same next steps."""
    _skip_unsupported(name, backend)
    gs = _grads(wcomm.Get_rank(), steps=3)
    a = _make(name, wcomm, backend)
    a.step(a.ops.from_host(gs[0].copy()))
    b = _make(name, wcomm, backend)
    b.load_state_dict(pickle.loads(pickle.dumps(a.state_dict())))
    same = True
    for g in gs[1:]:
        oa = _host(a, a.step(a.ops.from_host(g.copy())))
        ob = _host(b, b.step(b.ops.from_host(g.copy())))
        same &= oa.tobytes() == ob.tobytes() and a.residual.tobytes() == b.residual.tobytes()
    sa, sb = a.state_dict(), b.state_dict()
    same &= pickle.dumps(sorted((k, repr(v)) for k, v in sa.items() if k != "residual")) == \
        pickle.dumps(sorted((k, repr(v)) for k, v in sb.items() if k != "residual"))
    mpi_assert(same, f"{name}: a resumed sparsifier diverged", wcomm)


def check_bad_input(wcomm, backend, name, kind):
    """The last rank passes bad input: every rank refuses (or skips) together, state untouched."""
    _skip_unsupported(name, backend)
    P, rank = wcomm.Get_size(), wcomm.Get_rank()
    sp = _make(name, wcomm, backend, nonfinite="skip")
    gs = _grads(rank)
    sp.step(sp.ops.from_host(gs[0].copy()))
    before = (sp.residual.tobytes(), sp.iteration, repr(sorted(sp.state_dict().items())))
    bad = gs[1].copy()
    if kind == "length":
        bad = bad[:-1] if rank == P - 1 else bad
        with pytest.raises(exdyna_mpi.StepError, match=f"rank {P - 1}: grad has length {N - 1}"):
            sp.step(sp.ops.from_host(bad))
    else:
        if rank == P - 1:
            bad[5] = np.nan
        out = _host(sp, sp.step(sp.ops.from_host(bad)))
        mpi_assert(sp.stats.skipped and not out.any(), "a non-finite step is skipped on every rank", wcomm)
    after = (sp.residual.tobytes(), sp.iteration, repr(sorted(sp.state_dict().items())))
    mpi_assert(after == before, f"{name}: a refused step changed the state", wcomm)
    sp.step(sp.ops.from_host(gs[2].copy()))
    mpi_assert(sp.iteration == 2 and not sp.stats.skipped, "the next good step runs", wcomm)


def check_bad_state(wcomm, backend, name, kind):
    """The last rank loads a corrupt state dict (its residual cut to half length, or holding a NaN):
    every rank raises the same error naming that rank, and no rank's state changes."""
    _skip_unsupported(name, backend)
    P, rank = wcomm.Get_size(), wcomm.Get_rank()
    sp = _make(name, wcomm, backend)
    gs = _grads(rank)
    sp.step(sp.ops.from_host(gs[0].copy()))
    d = sp.state_dict()
    sp.step(sp.ops.from_host(gs[1].copy()))
    before = (sp.residual.tobytes(), sp.iteration, repr(sorted(sp.state_dict().items())))
    if rank == P - 1:
        res = d["residual"] if d["residual"] is not None else np.zeros(N, np.float32)
        if kind == "residual-length":
            res = res[: N // 2].copy()
        else:
            res = res.copy()
            res[3] = np.nan
        d = dict(d, residual=res)
    with pytest.raises(ValueError, match=f"rank {P - 1}: state_dict is malformed"):
        sp.load_state_dict(d)
    after = (sp.residual.tobytes(), sp.iteration, repr(sorted(sp.state_dict().items())))
    mpi_assert(after == before, f"{name}: a refused load changed the state", wcomm)
    sp.step(sp.ops.from_host(gs[2].copy()))
    mpi_assert(sp.iteration == 3 and not sp.stats.skipped, f"{name}: the next step runs", wcomm)
