"""The compact index forms (exdyna_mpi/kernels/cpu_index.py) against references computed here.

Every form decodes to what was encoded; the chosen form is the smallest of the three sizes
computed here from ``(count, span)`` alone; Elias-Fano's bytes equal a plain-Python encoder's built
from its definition (the layout the CUDA kernels must reproduce), and its size stays within 0.6 bits
an index (plus the 4-byte padding of two parts) of the floor ``log2 C(span, count)``.
"""
import math

import numpy as np
import pytest

from exdyna_mpi.kernels import cpu_index as ki


def _selection(rng, span, count):
    return np.sort(rng.choice(span, size=count, replace=False)).astype(np.int64)


def _pad4(n):
    return -(-n // 4) * 4


def _ef_reference(offsets, span):
    """Elias-Fano bytes from the definition, with Python integers as bit strings."""
    n = len(offsets)
    low = max(0, math.floor(math.log2(span / n))) if n else 0
    while (n << low) > span:         # float log2 rounding, either way
        low -= 1
    while (n << (low + 1)) <= span:
        low += 1
    lower = sum((o & ((1 << low) - 1)) << (j * low) for j, o in enumerate(offsets))
    upper = sum(1 << ((o >> low) + j) for j, o in enumerate(offsets))
    nl = _pad4((n * low + 7) // 8)
    nu = _pad4((n + ((span - 1) >> low) + 1 + 7) // 8)
    return lower.to_bytes(nl, "little") + upper.to_bytes(nu, "little")


def _sizes(count, span):
    if count == 0:
        return {f: 0 for f in (ki.FORM_RAW, ki.FORM_BITMAP, ki.FORM_EF)}
    return {ki.FORM_RAW: 4 * count, ki.FORM_BITMAP: _pad4(-(-span // 8)),
            ki.FORM_EF: len(_ef_reference(list(range(count)), span))}


CASES = [(1, 0), (1, 1), (100, 0), (100, 1), (100, 3), (100, 100), (65536, 4096), (65537, 4097),
         (200_000, 50), (200_000, 2000), (200_000, 60_000), (1_000_003, 10_000), (1_000_003, 1_000_003),
         (2**31 + 5, 7), (10_000_000, 1)]


@pytest.mark.parametrize("span,count", CASES)
def test_indices_round_trip_in_the_smallest_form(span, count):
    rng = np.random.default_rng(span + count)
    lo = 12345
    idx = _selection(rng, span, count) + lo if span < 2**31 else np.sort(
        rng.integers(0, span, size=count)) + lo
    idx = np.unique(idx)
    count = idx.shape[0]
    form, nbytes = ki.index_form(count, span)
    sizes = _sizes(count, span)
    assert nbytes == sizes[form] == min(sizes.values()) and nbytes % 4 == 0
    buf = np.full(nbytes + 8, 0xAB, np.uint8)
    assert ki.encode_indices(idx, lo, span, buf) == nbytes
    assert (buf[nbytes:] == 0xAB).all()                        # nothing written past its bytes
    out = np.empty(count, np.int64)
    ki.decode_indices(buf[:nbytes], count, lo, span, out)
    assert np.array_equal(out, idx)


@pytest.mark.parametrize("form", [ki.FORM_RAW, ki.FORM_BITMAP, ki.FORM_EF])
@pytest.mark.parametrize("span,count", [(1, 1), (33, 5), (4096, 4096), (10_000, 77), (1 << 20, 5000)])
def test_every_form_decodes_what_it_encoded(form, span, count):
    rng = np.random.default_rng(count)
    idx = (_selection(rng, span, count) + 3).astype(np.int32)   # inside [3, 3 + span)
    nbytes = ki.form_size(form, count, span)
    buf = np.empty(nbytes, np.uint8)
    assert ki.encode_form(idx, 3, span, form, buf) == nbytes
    out = np.empty(count, np.int32)
    ki.decode_form(buf, count, 3, span, form, out)
    assert np.array_equal(out, idx)


@pytest.mark.parametrize("span,count", [(1, 1), (100, 1), (100, 37), (4099, 1000), (1 << 20, 3000), (10**7, 123)])
def test_elias_fano_bytes_are_the_definition(span, count):
    rng = np.random.default_rng(7 * count)
    off = _selection(rng, span, count)
    buf = np.empty(ki.form_size(ki.FORM_EF, count, span), np.uint8)
    ki.encode_form(off, 0, span, ki.FORM_EF, buf)
    assert buf.tobytes() == _ef_reference(off.tolist(), span)


@pytest.mark.parametrize("density", [0.001, 0.01, 0.05])
def test_elias_fano_is_near_the_entropy_floor(density):
    span = 1 << 22
    count = int(span * density)
    floor_bits = (math.lgamma(span + 1) - math.lgamma(count + 1) - math.lgamma(span - count + 1)) / math.log(2)
    form, nbytes = ki.index_form(count, span)
    assert form == ki.FORM_EF
    assert 8 * nbytes <= floor_bits + 0.6 * count + 64


def test_an_unordered_selection_decodes_ascending():
    # a selection out of order still gives every rank one union: the encoder sorts a copy
    idx = np.array([70000, 5, 131072 + 3, 65536, 7, 140000], np.int64)
    span = 200_000
    for form in (ki.FORM_RAW, ki.FORM_BITMAP, ki.FORM_EF):
        buf = np.empty(ki.form_size(form, idx.shape[0], span), np.uint8)
        ki.encode_form(idx, 0, span, form, buf)
        out = np.empty(idx.shape[0], np.int64)
        ki.decode_form(buf, idx.shape[0], 0, span, form, out)
        assert out.tolist() == sorted(idx.tolist()), form
    assert idx.tolist() == [70000, 5, 131072 + 3, 65536, 7, 140000]   # the caller's order untouched


@pytest.mark.parametrize("span,count", [(100, 3), (200_000, 2000), (1_000_003, 10_000)])
def test_host_ops_carry_the_kernels_bytes(span, count):
    from exdyna_mpi.arrays import HostOps

    idx = _selection(np.random.default_rng(count), span, count) + 7
    want = np.zeros(ki.index_form(count, span)[1], np.uint8)
    ki.encode_indices(idx, 7, span, want)
    got = np.zeros_like(want)
    assert HostOps.encode_indices(idx, 7, span, got) == want.size
    assert np.array_equal(got, want)
    out = np.empty(count, np.int64)
    assert np.array_equal(HostOps.decode_indices(got, count, 7, span, out), idx)
