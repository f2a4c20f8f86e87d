"""Half gradients on the (simulated) device: the conversion kernels of kernels/cuda/half.py give the
host kernels' bits, and a float16 or bfloat16 step on the device equals the host step (float32
values on the wire: 16-bit values from a device are refused, on every rank, with the reason)."""
import numpy as np
import pytest
from mpi4py import MPI

import exdyna_mpi
from exdyna_mpi.arrays.half import narrow, widen
from exdyna_mpi.kernels import cpu_half as kh
from exdyna_mpi.kernels import cuda as kc
from tests.conftest import require

from .simdevice import simulated

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
    ref = cls(n, 0.03, MPI.COMM_SELF, device="cpu", wire_dtype="float32", **kw)
    dev = simulated(cls, n, 0.03, MPI.COMM_SELF, cuda_aware=False, **kw)
    rng = np.random.default_rng(3)
    half = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    for step in range(3):
        g = (rng.standard_normal(n) * 0.05).astype(np.float32).astype(half)
        want = ref.step(g.copy())
        got = dev.step(g.copy())
        assert got.dtype == want.dtype == np.dtype(half)
        assert got.view(np.uint16).tobytes() == want.view(np.uint16).tobytes(), f"step {step}"
        assert dev.residual.dtype == np.float32 and dev.residual.tobytes() == ref.residual.tobytes()
        assert dev.stats.bytes_sent == ref.stats.bytes_sent


def test_16_bit_values_from_the_device_are_refused():
    dev = simulated(exdyna_mpi.ExDyna, 800, 0.05, MPI.COMM_SELF, cuda_aware=False, wire_dtype="bfloat16",
                    n_blocks=8, block_align=32)
    with pytest.raises(exdyna_mpi.StepError, match="values travel in 16 bits .* on the host"):
        dev.step(np.zeros(800, np.float32))
    assert dev.iteration == 0
