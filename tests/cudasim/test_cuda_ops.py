"""CudaOps (simulator buffers) against HostOps: same interface, same bits."""
import inspect

import numpy as np
import pytest

from exdyna_mpi.arrays.cuda_ops import CudaOps
from exdyna_mpi.arrays import HostOps, ops_for


def _public(cls):
    return {k: v for k, v in vars(cls).items() if not k.startswith("_")}


def test_same_interface_as_hostops():
    assert ops_for("cuda") is CudaOps
    from exdyna_mpi.arrays.ops import DEVICE_ONLY

    host, dev = _public(HostOps), _public(CudaOps)
    assert set(host) == set(dev) - set(DEVICE_ONLY) and set(DEVICE_ONLY) <= set(dev)
    assert CudaOps.finishes_ahead is True and HostOps.finishes_ahead is False
    for name, fn in host.items():
        if isinstance(fn, staticmethod):
            assert isinstance(dev[name], staticmethod), name
            assert inspect.signature(fn.__func__) == inspect.signature(dev[name].__func__), name
    assert CudaOps.device == "cuda" and CudaOps.xp is np  # simulator: device buffers are NumPy
    from tests.unit.test_layers import ops_signature_problems

    assert not ops_signature_problems(CudaOps), ops_signature_problems(CudaOps)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_ops_match_hostops(dtype):
    rng = np.random.default_rng(3)
    n, lo, hi = 1100, 130, 1001
    r = rng.standard_normal(n).astype(dtype)
    g = rng.standard_normal(n).astype(dtype)
    thr = dtype(1.2)
    res = {}
    for ops in (HostOps, CudaOps):
        acc = ops.empty(n, dtype)
        idx = ops.zeros(hi - lo, np.int32)
        c, bad = ops.accumulate_select(r, g, acc, lo, hi, thr, idx)
        assert type(c) is int and type(bad) is int
        sel = ops.empty(hi - lo, np.int32)
        cs = ops.select_range(acc, lo, hi, thr, sel)
        cr = ops.count_range(acc, lo, hi, thr)
        vals = ops.empty(c, dtype)
        ops.gather(acc, idx[:c], vals)
        out = ops.zeros(n, dtype)
        ops.scatter(out, idx[:c], vals)
        ops.zero_at(out, idx[: c // 2])
        mean = ops.empty(n, dtype)
        ops.fill_zero(mean)
        ops.scatter_mean_zero(mean, acc, idx[:c], vals, dtype(2))
        ops.synchronize()
        res[ops.device] = [c, bad, cs, cr] + [ops.to_host(a).tobytes()
                                              for a in (acc, idx[:c], sel[:cs], vals, out, mean)]
    assert res["cpu"] == res["cuda"]
    assert res["cuda"][0] > 0


def test_host_round_trip_copies():
    a = np.arange(5, dtype=np.float32)
    d = CudaOps.from_host(a)
    a[0] = 9
    assert CudaOps.to_host(d)[0] == 0  # from_host copies: the caller may reuse its buffer


def test_scratch_per_thread_and_mask_left_zero():
    """Each thread gets its own scratch (totals, histograms, hit mask); the mask is all zero again
    after a selection (the compaction clears the words it used), so the next call starts clean."""
    import threading

    from exdyna_mpi.arrays import cuda_ops

    n = 700
    x = np.random.default_rng(5).standard_normal(n).astype(np.float32)
    idx = CudaOps.zeros(n, np.int32)
    got = CudaOps.select_range(x, 3, 650, np.float32(1.0), idx)
    assert got == int((np.abs(x[3:650]) >= 1.0).sum()) > 0
    mine = cuda_ops._scratch_here()
    assert mine.mask is not None and not mine.mask.any()
    other = []
    th = threading.Thread(target=lambda: other.append(cuda_ops._scratch_here()))
    th.start()
    th.join()
    assert other[0] is not mine and other[0].words is not mine.words
    assert cuda_ops._scratch_here() is mine


def test_default_step_reads_words_through_backend(monkeypatch):
    """Every device->host read of count words goes through ``BACKEND.read_words`` (tests/gpu hooks
    it to prove a step never copies O(numel) to the host): once per step at least, and small."""
    import exdyna_mpi
    from exdyna_mpi.arrays import device

    reads = []
    real = device.BACKEND.read_words
    monkeypatch.setattr(device.BACKEND, "read_words", lambda w: reads.append(w.nbytes) or real(w))
    n = 3000
    sp = exdyna_mpi.ExDyna(n, 0.01, device="cuda")
    g = (np.random.default_rng(2).standard_normal(n) * 0.01).astype(np.float32)
    for t in range(3):
        before = len(reads)
        sp.step(g)
        assert len(reads) > before, f"step {t}: no read through BACKEND.read_words"
    assert max(reads) < n * 4 // 4
