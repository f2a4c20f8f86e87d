"""The 16-bit kernels (exdyna_mpi/kernels/cpu_half.py) against independent references.

Conversions: NumPy's own float16 cast and ``ml_dtypes.bfloat16`` on random float32 patterns (every
class: normals, subnormals, the rounding boundaries, inf, NaN). Wire rounding saturates instead of
overflowing. The owner's reduction against a NumPy float32 loop. (The compact index forms:
tests/unit/test_index_kernels.py.)
"""
import numpy as np
import pytest

from exdyna_mpi.arrays.half import WireFormat, narrow, widen
from exdyna_mpi.kernels import cpu_half as kh
from tests.conftest import require

ml_dtypes = require("ml_dtypes")

EDGES = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFC00001,
                  0x477FF000, 0x477FEFFF, 0x477FE000, 0x38800000, 0x387FFFFF, 0x33000000, 0x33000001,
                  0x32FFFFFF, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00000001, 0x3F808000, 0x3F818000,
                  0xB3800000, 0x38FFF000], dtype=np.uint32)


def _patterns(n=2_000_000):
    rng = np.random.default_rng(5)
    anywhere = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    near_half = rng.integers(0x30000000, 0x48000000, size=n, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([EDGES, anywhere, near_half, near_half | np.uint32(0x80000000)])


def _reference(x, name):
    with np.errstate(over="ignore", invalid="ignore"):
        if name == "float16":
            return x.astype(np.float16).view(np.uint16)
        return x.astype(ml_dtypes.bfloat16).view(np.uint16)


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_narrow_is_round_to_nearest_even_like_the_references(name):
    bits = _patterns()
    x = bits.view(np.float32)
    got = narrow(x, name).view(np.uint16)
    want = _reference(x, name)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want[~nan])
    back = widen(got[nan], name, np.empty(int(nan.sum()), np.float32))
    assert np.isnan(back).all()                       # NaN stays NaN (payload conventions differ)


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_widen_is_exact(name):
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    got = widen(h, name, np.empty(65536, np.float32))
    ref = (h.view(np.float16) if name == "float16" else h.view(ml_dtypes.bfloat16)).astype(np.float32)
    ok = ~np.isnan(ref)
    assert np.array_equal(got.view(np.uint32)[ok], ref.view(np.uint32)[ok]) and np.isnan(got[~ok]).all()


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_wire_round_saturates_and_keeps_what_rounding_lost(name):
    fmt = WireFormat.of(name)
    big = 1e5 if name == "float16" else 3.4e38
    vals = np.array([1.0, 1 + 2**-9, -3.3, big, -big, 1e-9, 7.0, 0.1], np.float32)
    orig = vals.copy()
    sent = np.zeros(vals.shape, np.uint16)
    kh.wire_round(vals, fmt.mode, fmt.table, sent, 6, 7)       # element 6 is this rank's own share
    back = widen(sent, name, np.empty(vals.shape, np.float32))
    assert np.isfinite(back).all()                              # saturated, not inf
    top = float(np.finfo(np.float16).max) if name == "float16" else float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    assert back[3] == top and back[4] == -top
    keep = np.ones(8, bool)
    keep[6] = False
    assert np.array_equal((back + vals)[keep], orig[keep])      # sent + kept == the value, exactly
    assert vals[6] == orig[6] and sent[6] == 0                  # the own share is left as it was


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
@pytest.mark.parametrize("p,me", [(1, 0), (3, 1), (4, 3)])
def test_owner_mean_sums_in_float32_in_rank_order(name, p, me):
    fmt = WireFormat.of(name)
    rng = np.random.default_rng(p * 10 + me)
    c = 1000
    recv = _reference(rng.standard_normal((p, c)).astype(np.float32), name).reshape(p, c)
    own = rng.standard_normal(c).astype(np.float32)
    means, err = np.empty(c, np.uint16), np.empty(c, np.float32)
    kh.owner_mean(recv, own.copy(), me, p, fmt.mode, fmt.table, means, err)
    rows = (recv.view(np.float16) if name == "float16" else recv.view(ml_dtypes.bfloat16)).astype(np.float32)
    s = np.zeros(c, np.float32)
    for r in range(p):
        s += own if r == me else rows[r]
    mean = s / np.float32(p)
    assert np.array_equal(means, _reference(mean, name))
    m = widen(means, name, np.empty(c, np.float32))
    assert np.array_equal(err, s - np.float32(p) * m)
