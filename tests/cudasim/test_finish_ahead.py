"""A one-rank device step finished behind its measuring pass (``CudaOps.accumulate_measure_finish``):
the device's threshold (``_resolve_fine``) is the host's ``fine_pick`` to the bit, and the steps it
finishes are the CPU's steps to the bit, with or without ``out``; where it cannot settle (a zoom,
non-finite values) it leaves ``acc``, ``out`` and the marks alone and the host's path takes over."""
import numpy as np
import pytest
from mpi4py import MPI

import exdyna_mpi
from exdyna_mpi.algorithm.controllers import MeasuredController
from exdyna_mpi.arrays import cuda_ops
from exdyna_mpi.kernels.cuda.finish import _resolve_fine
from .simdevice import simulated


def _plan(dtype, threshold, numel=200_000, density=0.01):
    c = MeasuredController(numel, density)
    c.seen, c.threshold = True, threshold
    return c, c.plan(1, dtype)


def _device_pick(c, plan, words, nonfinite=0, threads=8):
    nb = plan.hist[0]
    n, shift, key0 = plan.fine
    dt = np.dtype(plan.dtype)
    ity = np.int32 if dt == np.float32 else np.int64
    cap = (((1 << (8 * dt.itemsize - 1)) - 1) >> shift) << shift
    word = np.zeros(1, np.int64)
    ctl = np.zeros(2, np.int64)
    totals = np.array([0, nonfinite], np.int64)
    _resolve_fine[1, threads](np.ascontiguousarray(words[nb:nb + n]), n, c.k, shift, key0, cap,
                              float(c.fine_tol(plan)), totals, ctl, word.view(ity)[:1])
    if ctl[0] == 0:
        return None
    return float(word.view(dt)[0]), int(ctl[1])


def _fine_words(c, plan, rng, kind):
    """Summed words with the k-th value placed by ``kind`` in (or out of) the fine window."""
    nb = plan.hist[0]
    n = plan.fine[0]
    w = np.zeros(nb + n, np.int64)
    fine = w[nb:]
    k = c.k
    if kind == "inside":
        fine[1:n - 1] = rng.integers(0, 3 * k // n + 2, n - 2)
        fine[n - 1] = rng.integers(0, k // 2)
    elif kind == "steep":     # a pile in one bucket: the nearest edge misses k by more than the tolerance
        fine[n // 2] = 3 * k
    elif kind == "above":     # the k-th value at or above the top edge
        fine[n - 1] = k + rng.integers(0, k)
    elif kind == "below":
        fine[1:n - 1] = rng.integers(0, 2, n - 2)
    elif kind == "tie":       # a * b == k * k exactly (k = 30 * 31): both take edge j, 3.3 % over k
        a, b = 31 * 31, 30 * 30
        assert k == 30 * 31
        fine[n // 2 + 1] = b
        fine[n // 2] = a - b
    fine[0] = rng.integers(0, 10 * k)
    return w


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["inside", "steep", "above", "below", "tie"])
def test_resolve_fine_is_fine_pick(dtype, kind):
    rng = np.random.default_rng(11)
    settled = 0
    for trial in range(6):
        numel = 93_000 if kind == "tie" else 200_000
        c, plan = _plan(dtype, float(rng.uniform(1e-4, 1.0)), numel, float(rng.choice([0.01, 0.002])))
        if kind == "tie":
            c.k = 30 * 31
        words = _fine_words(c, plan, rng, kind)
        want = c.fine_pick(plan, words)
        got = _device_pick(c, plan, words, threads=int(rng.choice([8, 32])))
        assert got == want, (kind, trial)
        settled += want is not None
        # resolve's general loop, with the short cut off, settles the same words at its first look
        # (no zoom: fused=None would fail), on fine_pick's answer
        if want is not None:
            c.fine_pick = lambda *a: None
            plan2 = c.resolve(plan, words, owned=None)
            del c.fine_pick
            assert (plan2.threshold, plan2.expected) == want and plan2.zoom_words == ()
    if kind in ("inside", "tie"):
        assert settled > 0
    if kind in ("steep", "above", "below"):
        assert settled == 0


def test_resolve_fine_refuses_nonfinite():
    rng = np.random.default_rng(3)
    c, plan = _plan(np.float32, 0.01)
    words = _fine_words(c, plan, rng, "inside")
    assert c.fine_pick(plan, words) is not None
    assert _device_pick(c, plan, words, nonfinite=1) is None


def _ar_stream(n, steps, dtype, seed):
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(n)
    for _ in range(steps):
        g = 0.9 * g + 0.45 * rng.standard_normal(n)
        yield (g * 0.01).astype(dtype)


@pytest.mark.parametrize("dtype, out_kind", [(np.float32, "none"), (np.float32, "buffer"), (np.float32, "grad"),
                                             (np.float64, "grad")])
def test_one_rank_steps_finished_ahead_match_cpu(monkeypatch, dtype, out_kind):
    n = 16384
    settled = []
    real = cuda_ops.CudaOps.finish_settled
    monkeypatch.setattr(cuda_ops.CudaOps, "finish_settled",
                        staticmethod(lambda: (settled.append(True), real())[1]))
    ref = exdyna_mpi.ExDyna(n, 0.01, MPI.COMM_SELF, device="cpu", n_blocks=16, block_align=32)
    dev = simulated(exdyna_mpi.ExDyna, n, 0.01, MPI.COMM_SELF, n_blocks=16, block_align=32)
    calls = []
    real_finish = cuda_ops.CudaOps.accumulate_measure_finish
    monkeypatch.setattr(cuda_ops.CudaOps, "accumulate_measure_finish",
                        staticmethod(lambda *a: (calls.append(1), real_finish(*a))[1]))
    buf = np.full(n, 7.0, dtype)
    for step, g in enumerate(_ar_stream(n, 14, dtype, 4)):
        want = ref.step(g.copy())
        if out_kind == "none":
            got = dev.step(g.copy())
        elif out_kind == "buffer":
            got = dev.step(g.copy(), out=buf)
            assert got is buf
        else:
            gg = g.copy()
            got = dev.step(gg, out=gg)
            assert got is gg
        assert got.tobytes() == want.tobytes(), step
        assert dev.residual.tobytes() == ref.residual.tobytes(), step
        assert dev.stats.threshold == ref.stats.threshold and dev.stats.selected == ref.stats.selected
        assert list(dev.stats.counts) == list(ref.stats.counts)
    assert len(calls) == 13         # every step after the first (no fine window at step 0)
    # the threshold climbs while the residual builds up (a zoom a step), then holds: from the 9th
    # step on the device settles it
    assert sum(settled) >= 4, settled
    assert dev.state_dict()["controller_state"] == ref.state_dict()["controller_state"]


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_nonfinite_after_finish_leaves_gradient_and_state(monkeypatch, policy):
    n = 16384
    calls = []
    real_finish = cuda_ops.CudaOps.accumulate_measure_finish
    monkeypatch.setattr(cuda_ops.CudaOps, "accumulate_measure_finish",
                        staticmethod(lambda *a: (calls.append(1), real_finish(*a))[1]))
    dev = simulated(exdyna_mpi.ExDyna, n, 0.01, MPI.COMM_SELF, nonfinite=policy, n_blocks=16, block_align=32)
    ref = exdyna_mpi.ExDyna(n, 0.01, MPI.COMM_SELF, device="cpu", nonfinite=policy, n_blocks=16, block_align=32)
    stream = list(_ar_stream(n, 14, np.float32, 4))
    for g in stream[:12]:
        ref.step(g.copy())
        dev.step(g.copy())
    before = dev.residual.copy()
    bad = stream[12].copy()
    bad[[5, 9000]] = [np.nan, np.inf]
    kept = bad.copy()
    calls.clear()
    if policy == "raise":
        with pytest.raises(exdyna_mpi.StepError, match="(?i)non-finite|nonfinite"):
            dev.step(bad, out=bad)
        assert bad.tobytes() == kept.tobytes()   # out=grad: the refused step left the gradient as it was
    else:
        out = dev.step(bad, out=bad)
        assert dev.stats.skipped and not out.any()
    assert calls == [1]   # the device was given the step to finish, and refused it itself
    assert dev.residual.tobytes() == before.tobytes() and dev.iteration == 12
    want = ref.step(stream[13].copy())
    got = dev.step(stream[13].copy())
    assert got.tobytes() == want.tobytes() and dev.residual.tobytes() == ref.residual.tobytes()
