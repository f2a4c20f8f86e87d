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
    host, dev = _public(HostOps), _public(CudaOps)
    assert set(host) == set(dev)
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
