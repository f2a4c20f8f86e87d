"""The 8-bit value kernels (exdyna_mpi/kernels/cpu_8bit.py) against references written here: the bytes of a
quantized run (codes, padding, float32 scales), what the rounding lost, the decoded values and the
owner's float32 sum in rank order, for both codes. int8's reference is NumPy's rint; float8 e4m3fn's
is ml_dtypes' cast (OCP FP8, round to nearest even), which the kernel never calls."""
import numpy as np
import pytest

from exdyna_mpi.kernels import cpu_8bit as k8
from tests.conftest import require

ml_dtypes = require("ml_dtypes")

B = k8.BLOCK
CODES = sorted(k8.CODES)


def _bytes(y, code):
    """The byte of each float32 ``y`` (already divided by its scale) by the code's definition."""
    if code == "int8":
        return np.clip(np.rint(y), -127, 127).astype(np.int8).view(np.uint8)
    return np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _decoded(b, code):
    if code == "int8":
        return b.view(np.int8).astype(np.float32)
    return b.view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def _reference(v, code):
    """(bytes uint8, scales float32, lost float32) of ``v`` by the definition."""
    top = np.float32(127 if code == "int8" else 448)
    nb = -(-v.shape[0] // B)
    codes = np.zeros(v.shape[0], np.uint8)
    scales = np.zeros(nb, np.float32)
    lost = v.copy()
    for b in range(nb):
        x = v[b * B:(b + 1) * B]
        s = np.float32(np.abs(x).max(initial=np.float32(0)) / top)
        scales[b] = s
        if s > 0:
            q = _bytes((x / s).astype(np.float32), code)
            codes[b * B:(b + 1) * B] = q
            lost[b * B:(b + 1) * B] = x - _decoded(q, code) * s
    return codes, scales, lost


def test_the_e4m3_table_is_ml_dtypes():
    want = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = k8.TABLES[k8.E4M3]
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[~np.isnan(got)].view(np.uint32), want[~np.isnan(want)].view(np.uint32))
    assert np.array_equal(k8.TABLES[k8.INT8], np.arange(256, dtype=np.uint8).view(np.int8).astype(np.float32))


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("c", [0, 1, 3, 127, 128, 129, 1000, 5000])
def test_quantize_is_the_definition(c, code):
    rng = np.random.default_rng(c)
    v = (rng.laplace(0, 0.1, c) * rng.choice([1e-6, 1e-3, 1.0, 1e3], c)).astype(np.float32)
    if c > 200:
        v[130:258] = 0                       # a block of zeros: scale 0, codes 0, nothing lost
        v[5] = np.float32(3e38)              # near float32's top: the scale stays finite
        v[300] = -0.0
    if c > 2000:                             # e4m3's binade edges, subnormals and ties, scaled by 1
        v[1024] = 448.0
        grid = k8.TABLES[k8.E4M3][:127]
        mids = (grid[1:] + grid[:-1]) / np.float32(2)
        v[1025:1025 + 126] = mids            # exact ties between neighbours: to even
        v[1151] = 448.0
        v[1152:1152 + 126] = -mids[::-1]
        v[1278] = -448.0
    size = k8.share_bytes(c)
    assert size == -(-c // 4) * 4 + 4 * -(-c // B) and size % 4 == 0
    buf = np.full(size + 4, 0xAB, np.uint8)
    lost = np.empty(c, np.float32)
    kind = k8.CODES[code]
    k8.quantize(v, buf[:size], lost, kind, k8.TABLES[kind])
    codes, scales, want_lost = _reference(v, code)
    pad = -(-c // 4) * 4
    assert np.array_equal(buf[:c], codes)
    assert (buf[c:pad] == 0).all() and (buf[size:] == 0xAB).all()
    assert np.array_equal(buf[pad:size].view(np.float32), scales)
    assert np.array_equal(lost, want_lost) and np.isfinite(lost).all()
    out = np.empty(c, np.float32)
    k8.dequantize(buf[:size], c, k8.TABLES[kind], out)
    want = _decoded(codes, code) * np.repeat(scales, B)[:c]
    assert np.array_equal(out, want) and np.isfinite(out).all()
    assert np.allclose(out + lost, v, rtol=1e-6, atol=0)        # what was sent and what was kept


def test_e4m3_keeps_the_small_values_int8_rounds_away():
    v = np.zeros(128, np.float32)
    v[0] = 1.0
    v[1:] = np.float32(0.003)                # 1/333 of the block's largest: below int8's half step
    sent = {}
    for code, kind in k8.CODES.items():
        buf = np.empty(k8.share_bytes(128), np.uint8)
        k8.quantize(v, buf, np.empty(128, np.float32), kind, k8.TABLES[kind])
        sent[code] = np.empty(128, np.float32)
        k8.dequantize(buf, 128, k8.TABLES[kind], sent[code])
    assert (sent["int8"][1:] == 0).all()
    assert (np.abs(sent["float8_e4m3fn"][1:] / v[1:] - 1) <= 1 / 16).all()


@pytest.mark.parametrize("code", CODES)
def test_quantize_in_place_keeps_what_was_lost(code):
    v = np.linspace(-1, 1, 300, dtype=np.float32)
    want = _reference(v, code)[2]
    buf = np.empty(k8.share_bytes(300), np.uint8)
    kind = k8.CODES[code]
    k8.quantize(v, buf, v, kind, k8.TABLES[kind])
    assert np.array_equal(v, want)


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("p,me", [(1, 0), (2, 1), (4, 0), (4, 3)])
def test_owner_sum_in_rank_order(p, me, code):
    c = 300
    kind, table = k8.CODES[code], k8.TABLES[k8.CODES[code]]
    rng = np.random.default_rng(p * 10 + me)
    own = rng.standard_normal(c).astype(np.float32)
    size = k8.share_bytes(c)
    recv = np.zeros(size * (p - 1), np.uint8)
    offs = np.zeros(p, np.int64)
    vals = {}
    at = 0
    for r in range(p):
        if r == me:
            continue
        v = rng.standard_normal(c).astype(np.float32) * 10.0 ** r
        k8.quantize(v, recv[at:at + size], np.empty(c, np.float32), kind, table)
        codes, scales, _ = _reference(v, code)
        vals[r] = _decoded(codes, code) * np.repeat(scales, B)[:c]
        offs[r] = at
        at += size
    out = np.empty(c, np.float32)
    k8.owner_sum(recv, offs, own, me, p, table, out)
    s = np.zeros(c, np.float32)
    for r in range(p):
        s += own if r == me else vals[r]
    assert np.array_equal(out, s)
