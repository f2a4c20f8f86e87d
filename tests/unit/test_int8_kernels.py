"""The 8-bit value kernels (kernels/cpu_int8.py) against NumPy references written here: the bytes
of a quantized run (int8 codes, padding, float32 scales), what the rounding lost, the decoded
values, and the owner's float32 sum in rank order."""
import numpy as np
import pytest

from exdyna_mpi.kernels import cpu_int8 as k8

B = k8.BLOCK


def _reference(v):
    """(codes int8, scales float32, lost float32) of ``v`` by the definition."""
    nb = -(-v.shape[0] // B)
    codes = np.zeros(v.shape[0], np.int8)
    scales = np.zeros(nb, np.float32)
    lost = v.copy()
    for b in range(nb):
        x = v[b * B:(b + 1) * B]
        s = np.float32(np.abs(x).max(initial=np.float32(0)) / np.float32(127))
        scales[b] = s
        if s > 0:
            q = np.clip(np.rint(x / s), -127, 127).astype(np.float32)
            codes[b * B:(b + 1) * B] = q.astype(np.int8)
            lost[b * B:(b + 1) * B] = x - q * s
    return codes, scales, lost


@pytest.mark.parametrize("c", [0, 1, 3, 127, 128, 129, 1000])
def test_quantize_is_the_definition(c):
    rng = np.random.default_rng(c)
    v = (rng.laplace(0, 0.1, c) * rng.choice([1e-3, 1.0, 1e3], c)).astype(np.float32)
    if c > 200:
        v[130:258] = 0                       # a block of zeros: scale 0, codes 0, nothing lost
        v[5] = np.float32(3e38)              # near float32's top: the scale stays finite
    size = k8.share_bytes(c)
    assert size == -(-c // 4) * 4 + 4 * -(-c // B) and size % 4 == 0
    buf = np.full(size + 4, 0xAB, np.uint8)
    lost = np.empty(c, np.float32)
    k8.quantize(v, buf[:size], lost)
    codes, scales, want_lost = _reference(v)
    pad = -(-c // 4) * 4
    assert np.array_equal(buf[:c].view(np.int8), codes)
    assert (buf[c:pad] == 0).all() and (buf[size:] == 0xAB).all()
    assert np.array_equal(buf[pad:size].view(np.float32), scales)
    assert np.array_equal(lost, want_lost) and np.isfinite(lost).all()
    out = np.empty(c, np.float32)
    k8.dequantize(buf[:size], c, out)
    want = codes.astype(np.float32) * np.repeat(scales, B)[:c]
    assert np.array_equal(out, want)
    assert np.allclose(out + lost, v, rtol=1e-6, atol=0)        # what was sent and what was kept
    assert (np.abs(codes) <= 127).all()


def test_quantize_in_place_keeps_what_was_lost():
    v = np.linspace(-1, 1, 300, dtype=np.float32)
    want = _reference(v)[2]
    buf = np.empty(k8.share_bytes(300), np.uint8)
    k8.quantize(v, buf, v)
    assert np.array_equal(v, want)


@pytest.mark.parametrize("p,me", [(1, 0), (2, 1), (4, 0), (4, 3)])
def test_owner_sum_in_rank_order(p, me):
    c = 300
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
        k8.quantize(v, recv[at:at + size], np.empty(c, np.float32))
        vals[r] = np.empty(c, np.float32)
        k8.dequantize(recv[at:at + size], c, vals[r])
        offs[r] = at
        at += size
    out = np.empty(c, np.float32)
    k8.owner_sum(recv, offs, own, me, p, out)
    s = np.zeros(c, np.float32)
    for r in range(p):
        s += own if r == me else vals[r]
    assert np.array_equal(out, s)
