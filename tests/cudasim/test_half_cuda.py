"""Half gradients and 16-bit values on the (simulated) device: the kernels of exdyna_mpi/kernels/cuda/half.py
give the host kernels' bits, and a float16 or bfloat16 step, or a float32 one with
``wire_dtype="bfloat16"``, on the device equals the host step, staged and direct (CUDA-aware)."""
import numpy as np
import pytest
from mpi4py import MPI

import exdyna_mpi
from exdyna_mpi.arrays.half import narrow, widen
from exdyna_mpi.kernels import cpu_half as kh
from exdyna_mpi.kernels import cuda as kc
from tests.conftest import require

from .simdevice import simulated, step_both

ml_dtypes = require("ml_dtypes")

EDGES = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0x477FF000, 0x477FEFFF, 0x38800000,
         0x387FFFFF, 0x33000000, 0x33000001, 0x32FFFFFF, 0x7F7FFFFF, 0x7F7F8000, 0x00000001, 0x3F808000,
         0x3F818000, 0x38FFF000, 0x35800000]


def _patterns():
    rng = np.random.default_rng(2)
    return np.concatenate([np.array(EDGES, np.uint32),
                           rng.integers(0, 2**32, 300, dtype=np.uint64).astype(np.uint32),
                           rng.integers(0x30000000, 0x48000000, 300, dtype=np.uint64).astype(np.uint32)])


@pytest.mark.parametrize("name,mode", [("bfloat16", kc.half.MODE_BF16), ("float16", kc.half.MODE_F16)])
def test_device_conversions_match_the_host(name, mode):
    bits = _patterns()
    dev = np.empty(bits.shape, np.uint16)
    kc.narrow16(bits, dev, mode)
    host = narrow(bits.view(np.float32), name).view(np.uint16)
    assert np.array_equal(dev, host)
    # every 16-bit pattern's sign/exponent class, widened: subnormals, normals, inf, NaN
    h = np.concatenate([np.arange(0, 2048, 7), np.arange(0x7BF0, 0x7C10), np.arange(0x8000, 0x8400, 13),
                        np.array([0x3C00, 0x7F80, 0x7F81, 0xFF80, 0x0001, 0x03FF, 0x0400])]).astype(np.uint16)
    out = np.empty(h.shape, np.uint32)
    kc.widen16(h, out, mode)
    want = widen(h, name, np.empty(h.shape, np.float32)).view(np.uint32)
    assert np.array_equal(out, want)
    assert mode == (kh.MODE_BF16 if name == "bfloat16" else kh.MODE_F16)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("cls", [exdyna_mpi.ExDyna, exdyna_mpi.MiCRO])
def test_half_step_on_the_device_equals_the_host(cls, dtype):
    n = 1500
    kw = dict(n_blocks=16, block_align=32) if cls is exdyna_mpi.ExDyna else {}
    ref = cls(n, 0.03, MPI.COMM_SELF, device="cpu", **kw)
    dev = simulated(cls, n, 0.03, MPI.COMM_SELF, cuda_aware=False, **kw)
    rng = np.random.default_rng(3)
    half = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    for step in range(3):
        g = (rng.standard_normal(n) * 0.05).astype(np.float32).astype(half)
        want, got = step_both(ref, dev, g, step)   # the 16-bit patterns and the float32 residual
        assert got.dtype == want.dtype == np.dtype(half)
        assert dev.residual.dtype == np.float32
        assert dev.stats.bytes_sent == ref.stats.bytes_sent


@pytest.mark.parametrize("name,mode", [("bfloat16", kc.half.MODE_BF16), ("float16", kc.half.MODE_F16)])
def test_wire_kernels_match_the_host(name, mode):
    from exdyna_mpi.arrays.half import WireFormat

    fmt = WireFormat.of(name)
    rng = np.random.default_rng(mode)
    n, p, me = 300, 3, 1
    big = 7e4 if name == "float16" else 3.4e38
    vals = (rng.standard_normal(n) * 3).astype(np.float32)
    vals[[5, 77]] = [big, -big]                                # saturated, not inf
    vals[[6, 7, 8, 9, 10]] = [0.0, -0.0, 1e-40, -3e-42, 2.0**-126]   # zeros, subnormals, the smallest normal
    lo, hi = 100, 200
    host_v, dev_v = vals.copy(), vals.copy()
    host_s, dev_s = np.zeros(n, np.uint16), np.zeros(n, np.uint16)
    kh.wire_round(host_v, fmt.mode, fmt.table, host_s, lo, hi)
    kc.wire_round(dev_v, mode, dev_s, lo, hi)
    assert np.array_equal(host_s, dev_s) and host_v.tobytes() == dev_v.tobytes()
    c = hi - lo
    recv = np.stack([host_s[lo:hi]] * p)                       # any 16-bit rows do
    recv[0] = narrow(rng.standard_normal(c).astype(np.float32), name).view(np.uint16)
    own_h, own_d = vals[lo:hi].copy(), vals[lo:hi].copy()
    m_h, m_d = np.empty(c, np.uint16), np.empty(c, np.uint16)
    kh.owner_mean(recv, own_h, me, p, fmt.mode, fmt.table, m_h, own_h)
    kc.owner_mean(recv, own_d, me, p, mode, m_d)
    assert np.array_equal(m_h, m_d) and own_h.tobytes() == own_d.tobytes()
    idx = np.sort(rng.choice(1000, c, replace=False)).astype(np.int32)
    out_h, out_d = np.zeros(1000, np.float32), np.zeros(1000, np.float32)
    res_h, res_d = np.ones(1000, np.float32), np.ones(1000, np.float32)
    kh.scatter_wire(out_h, res_h, idx, m_h, own_h, fmt.mode, fmt.table)
    kc.scatter_wire(out_d, res_d, idx, m_d, own_d, mode)
    assert out_h.tobytes() == out_d.tobytes() and res_h.tobytes() == res_d.tobytes()


@pytest.mark.parametrize("aware", [False, True], ids=["staged", "direct"])
@pytest.mark.parametrize("name", ["exdyna", "topk", "dense"])
def test_16_bit_values_on_the_device_equal_the_host(name, aware):
    n = 1200
    density = 1.0 if name == "dense" else 0.03
    cls = exdyna_mpi.sparsifiers.REGISTRY[name]
    ref = cls(n, density, MPI.COMM_SELF, device="cpu", wire_dtype="bfloat16")
    dev = simulated(cls, n, density, MPI.COMM_SELF, cuda_aware=aware, wire_dtype="bfloat16")
    rng = np.random.default_rng(9)
    for step in range(3):
        g = (rng.standard_normal(n) * 0.05).astype(np.float32)
        step_both(ref, dev, g, step)
        assert ref.residual.any()                              # the rounding was kept


@pytest.mark.parametrize("aware", [False, True], ids=["staged", "direct"])
@pytest.mark.parametrize("output", ["mean", "sign"])
@pytest.mark.parametrize("code", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("name", ["exdyna", "topk"])
def test_8_bit_values_on_the_device_equal_the_host(name, code, output, aware):
    n = 1200
    cls = exdyna_mpi.sparsifiers.REGISTRY[name]
    ref = cls(n, 0.03, MPI.COMM_SELF, device="cpu", wire_dtype=code, output=output)
    dev = simulated(cls, n, 0.03, MPI.COMM_SELF, cuda_aware=aware, wire_dtype=code, output=output)
    rng = np.random.default_rng(10)
    for step in range(3):
        g = (rng.standard_normal(n) * 0.05).astype(np.float32)
        step_both(ref, dev, g, step)
        assert dev.stats.bytes_sent == ref.stats.bytes_sent
