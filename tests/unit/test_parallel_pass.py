"""The measuring pass on several threads (``accumulate_measure_threads``) gives the serial pass's
bits: acc, both histograms, the largest bit pattern, the marks in order, for any number of parts."""
import numpy as np
import pytest

from exdyna_mpi.algorithm.controllers import MeasuredController
from exdyna_mpi.arrays import HostOps
from exdyna_mpi.kernels import cpu_controller as kc


def _case(seed, n, dtype):
    rng = np.random.default_rng(seed)
    r = (rng.standard_normal(n) * 0.01).astype(dtype)
    g = (rng.standard_t(3, n) * 0.01).astype(dtype)
    c = MeasuredController(n, 0.01, 2)
    c.threshold, c.seen = float(np.quantile(np.abs(r + g), 0.99)), True
    return r, g, c.plan(1, dtype)


def _run(r, g, plan, lo, hi, nparts, fine=True, keep=True):
    acc = np.empty_like(r)
    bits, sign_off = kc.int_view(acc)
    ity = bits.dtype.type
    nb = plan.hist[0]
    hist = np.zeros(nb, np.int64)
    hf = np.zeros(plan.fine[0] if fine else 0, np.int64)
    shift_f, key0_f = (plan.fine[1], plan.fine[2]) if fine else (0, 0)
    low_f = ity((int(key0_f) + 1) << int(shift_f)) if fine else sign_off
    marks = np.full(hi - lo if keep else 0, -1, np.int64)
    vals = np.full(hi - lo if keep else 0, -1, dtype=r.dtype)
    args = (r, g, acc, bits, lo, hi, sign_off, ity(plan.hist[1]), ity(plan.hist[2]), hist, plan.stride, ity(shift_f),
            ity(key0_f), hf, low_f)
    if nparts == 0:
        mx, nf = kc.accumulate_measure(*args, np.empty(kc._CHUNK, np.int64), marks, vals)
    else:
        mx, nf = kc.accumulate_measure_threads(*args, marks, vals, nparts)
    if keep:   # the values kept with the marks are acc's there, to the bit
        assert acc[marks[:nf]].tobytes() == vals[:nf].tobytes()
    return acc, hist, hf, int(mx), int(nf), marks[:nf] if keep else None


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("lo,hi", [(0, 50_000), (1234, 41_000), (20_000, 20_001), (7, 7), (0, 0), (3, 49_999)])
@pytest.mark.parametrize("fine,keep", [(True, True), (True, False), (False, False)])
def test_parallel_equals_serial(dtype, lo, hi, fine, keep):
    r, g, plan = _case(lo + hi, 50_000, dtype)
    want = _run(r, g, plan, lo, hi, 0, fine, keep)
    for nparts in (1, 2, 3, 4, 7):
        got = _run(r, g, plan, lo, hi, nparts, fine, keep)
        assert got[0].tobytes() == want[0].tobytes(), nparts
        assert np.array_equal(got[1], want[1]) and np.array_equal(got[2], want[2]), nparts
        assert got[3:5] == want[3:5], nparts
        if keep:
            assert np.array_equal(got[5], want[5]), nparts
    if fine and hi - lo > 1000:
        assert want[4] > 0   # the case has marks to move


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_element_marked(dtype):
    # marks as dense as the range: each run's slice of the buffer fills up to its end, where the
    # kernel must switch from writing marks in place (two spare words past them) to its scratch
    r, g, plan = _case(5, 50_000, dtype)
    c = MeasuredController(50_000, 0.01, 2)
    c.threshold, c.seen = float(np.abs(r + g).min()) * 0.5, True
    plan = c.plan(1, dtype)
    lo, hi = 1000, 49_000
    want = _run(r, g, plan, lo, hi, 0)
    assert want[4] == hi - lo and np.array_equal(want[5], np.arange(lo, hi))
    for nparts in (2, 3, 7):
        got = _run(r, g, plan, lo, hi, nparts)
        assert got[0].tobytes() == want[0].tobytes() and got[3:5] == want[3:5], nparts
        assert np.array_equal(got[2], want[2]) and np.array_equal(got[5], want[5]), nparts
    # nothing is written past the marks buffer (kernels do not check bounds: sentinels do)
    acc = np.empty_like(r)
    bits, sign_off = kc.int_view(acc)
    ity = bits.dtype.type
    buf = np.full(hi - lo + 4, -7, np.int64)
    vbuf = np.full(hi - lo + 4, -7, dtype)
    kc.accumulate_measure(r, g, acc, bits, lo, hi, sign_off, ity(plan.hist[1]), ity(plan.hist[2]),
                          np.zeros(plan.hist[0], np.int64), plan.stride, ity(plan.fine[1]), ity(plan.fine[2]),
                          np.zeros(plan.fine[0], np.int64), ity((int(plan.fine[2]) + 1) << int(plan.fine[1])),
                          np.empty(kc._CHUNK + 2, np.int64), buf[:hi - lo], vbuf[:hi - lo])
    assert (buf[hi - lo:] == -7).all() and np.array_equal(buf[:hi - lo], np.arange(lo, hi))
    assert (vbuf[hi - lo:] == -7).all() and vbuf[:hi - lo].tobytes() == acc[lo:hi].tobytes()


def test_wrapper_uses_threads_and_reports_nonfinite(monkeypatch):
    monkeypatch.setattr(kc, "PARALLEL_MIN", 1000)
    r, g, plan = _case(3, 30_000, np.float32)
    g[29_999] = np.inf
    out = []
    for threads in (1, 3):
        acc = np.empty_like(r)
        nb = plan.hist[0]
        w = np.zeros(plan.n_words, np.int64)
        bad = HostOps.accumulate_measure(r, g, acc, 5000, 25_000, (plan.hist[1], plan.hist[2], w[:nb]),
                                         (plan.fine[1], plan.fine[2], w[nb:]), plan.stride, None, threads)
        out.append((bad, acc.tobytes(), w.tolist()))
    assert out[0] == out[1] and out[0][0] == 1


def test_host_threads_share_the_cores_and_leave_numba_alone():
    import subprocess
    import sys
    code = ("import numba, numba.np.ufunc.parallel as p; from exdyna_mpi.arrays import host_threads; "
            "assert host_threads(10**6) == 1 and host_threads(1) >= 1; "
            "assert not p._is_initialized, 'asking for threads started the Numba threading layer'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_two_python_threads_at_once(monkeypatch):
    """Four Python threads stepping at once, each with a threaded pass: all exact."""
    import threading
    monkeypatch.setattr(kc, "PARALLEL_MIN", 1000)
    r, g, plan = _case(5, 200_000, np.float32)
    nb = plan.hist[0]

    def one():
        acc = np.empty_like(r)
        w = np.zeros(plan.n_words, np.int64)
        kc.host_accumulate_measure(r, g, acc, 0, 150_000, (plan.hist[1], plan.hist[2], w[:nb]),
                                   (plan.fine[1], plan.fine[2], w[nb:]), plan.stride, None, 4)
        return acc.tobytes(), w.tolist()

    want = one()
    got = [None] * 4

    def work(i):
        for _ in range(5):
            got[i] = one()

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert all(x == want for x in got)
