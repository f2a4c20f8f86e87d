"""8-bit values on the wire (``wire_dtype="int8"`` and ``"float8_e4m3fn"``), against an independent
reference.

Every sparsifier that can send them (``CAPABILITIES.wire_8bit``: those whose step ends in
``average_at``) x both codes x {mean, sign output} x {float32, bfloat16 gradients}, one to four
ranks. At each step the test records every rank's accumulator and the step's union and recomputes
in NumPy what the protocol promises: share j of the union (an equal split) is reduced by rank j,
which adds its own float32 values to the others' 8-bit values (per block of 128 of the share:
scale = max |v| / top, top 127 or 448; the code of v / scale by NumPy's rint or ml_dtypes'
float8_e4m3fn cast; the value code x scale) in rank order, in float32; each sender keeps what its
rounding lost. Mean output: the mean is rounded the same way and the owner keeps sum - P x mean.
Sign output: the sign of the float32 mean, and the owner keeps nothing. Output and residual must
match to the bit, ranks bit-identical, the mass conserved (mean output). Bytes per selected
element at P = 4, d = 0.05 with signs: at most 2.0.
"""
import numpy as np
import pytest

import exdyna_mpi
from exdyna_mpi.kernels.cpu_8bit import BLOCK
from tests.conftest import allgather_array, mpi_assert, require
from tests.mpi.test_wire import _record_unions, owner_reference

pytestmark = pytest.mark.mpi

ml_dtypes = require("ml_dtypes")

NAMES = [n for n in exdyna_mpi.available() if exdyna_mpi.sparsifiers.REGISTRY[n].CAPABILITIES.wire_8bit]
CODES = ("int8", "float8_e4m3fn")
NUMEL, STEPS = 6000, 3


def _grad(rank, t, dtype):
    rng = np.random.default_rng([11, rank, t])
    g = rng.laplace(0.0, 0.05, NUMEL).astype(np.float32)
    g[(t * 997) % NUMEL] = 300.0                     # one large value: its block's scale is coarse
    return g.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else g


def _q8(x, code):
    """float32 ``x`` as its 8-bit values would decode (blocks of 128 from x's start)."""
    out = np.zeros_like(x)
    top = np.float32(127 if code == "int8" else 448)
    for b in range(0, x.shape[0], BLOCK):
        v = x[b:b + BLOCK]
        s = np.float32(np.abs(v).max(initial=np.float32(0)) / top)
        if s > 0:
            y = (v / s).astype(np.float32)
            if code == "int8":
                q = np.clip(np.rint(y), -127, 127).astype(np.int8).astype(np.float32)
            else:
                q = np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
            out[b:b + BLOCK] = q * s
    return out


def _reference(accs, union, signs, code):
    return owner_reference(accs, union, lambda v: _q8(v, code), signs)


@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("output", ["mean", "sign"])
@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("name", NAMES)
def test_8bit_matches_the_reference(name, code, output, grad_dtype, wcomm):
    rank, p = wcomm.Get_rank(), wcomm.Get_size()
    sp = exdyna_mpi.make(name, NUMEL, 0.02, wcomm, wire_dtype=code, output=output)
    unions = _record_unions(sp)
    for t in range(STEPS):
        g = _grad(rank, t, grad_dtype)
        acc = sp.residual + g.astype(np.float32)
        out = sp.step(g)
        mpi_assert(out.dtype == g.dtype and sp.residual.dtype == np.float32, f"{name}: dtypes", wcomm)
        accs = allgather_array(acc, wcomm).reshape(p, NUMEL)
        want_out, want_res = _reference(accs, unions[-1], output == "sign", code)
        if grad_dtype == "bfloat16":
            want_out = want_out.astype(ml_dtypes.bfloat16).astype(np.float32)
        got = np.asarray(out).astype(np.float32)
        mpi_assert(np.array_equal(got.view(np.uint32), want_out.view(np.uint32)),
                   f"{name}/{code}/{output}/{grad_dtype} t={t}: output differs from the reference "
                   f"({int((got != want_out).sum())} elements)", wcomm)
        mpi_assert(np.array_equal(sp.residual.view(np.uint32), want_res[rank].view(np.uint32)),
                   f"{name}/{code}/{output}/{grad_dtype} t={t}: residual differs from the reference", wcomm)
        allo = allgather_array(got, wcomm)
        mpi_assert((allo.view(np.uint32) == allo.view(np.uint32)[0]).all(), f"{name} t={t}: ranks differ", wcomm)
        if output == "mean" and grad_dtype == "float32":
            kept = allgather_array(sp.residual, wcomm).reshape(p, NUMEL).astype(np.float64).sum(0)
            gap = np.abs(kept + p * got.astype(np.float64) - accs.astype(np.float64).sum(0))
            scale = np.abs(accs).astype(np.float64).sum(0) + 1e-30
            mpi_assert((gap <= 1e-6 * scale).all(), f"{name}: mass not conserved ({gap.max():.3g})", wcomm)


@pytest.mark.parametrize("code", CODES)
def test_8bit_signs_move_under_two_bytes_a_selected_element(code, wcomm):
    rank, p = wcomm.Get_rank(), wcomm.Get_size()
    if p != 4:
        pytest.skip("the bound is stated at P = 4")
    n = 400_000
    sp = exdyna_mpi.make("exdyna", n, 0.05, wcomm, wire_dtype=code, output="sign")
    rng = np.random.default_rng(rank)
    for _ in range(3):
        sp.step(rng.standard_normal(n).astype(np.float32))
    per = wcomm.allreduce(sp.stats.bytes_sent) / p / sp.stats.selected
    mpi_assert(per <= 2.0, f"{per:.3f} bytes per selected element", wcomm)


@pytest.mark.parametrize("code", CODES)
def test_8bit_is_refused_where_it_cannot_travel(code, wcomm):
    with pytest.raises(ValueError, match=f"cannot send its values in {code}"):
        exdyna_mpi.make("dense", 100, 1.0, wcomm, wire_dtype=code)
    sp = exdyna_mpi.make("exdyna", 1000, 0.05, wcomm, wire_dtype=code)
    with pytest.raises(exdyna_mpi.StepError, match="16 or 8 bits"):
        sp.step(np.ones(1000, np.float64))
    mpi_assert(sp.iteration == 0 and not sp.residual.any(), "a refused step changed the state", wcomm)
