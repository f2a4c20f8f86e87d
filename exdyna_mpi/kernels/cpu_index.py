"""CPU kernels of the compact index forms: one rank's selection on the wire, ``@njit`` on NumPy buffers.

A rank's selection inside its span ``[lo, lo + L)`` travels in the smallest of three forms. The
size of each depends on ``(count, L)`` alone, so every rank knows every rank's byte count from the
agreed counts and spans, and no length word travels (``index_form``):

- ``FORM_RAW``: uint32 offsets from ``lo`` (4 bytes each; only for a handful of indices);
- ``FORM_BITMAP``: one bit per element of the span (from about a quarter of the span selected);
- ``FORM_EF``: Elias-Fano. With ``l = floor(log2(L / count))``, the low ``l`` bits of each offset
  are packed side by side, and the high part ``o >> l`` of the j-th offset sets bit
  ``(o >> l) + j`` of a bit vector of ``count + ((L - 1) >> l) + 1`` bits. That is at most
  ``l + 3`` bits an index, against the floor ``log2 C(L, count) / count`` (about
  ``log2(L / count) + 1.44``): 6.3 bits at a density of 0.05, 8.6 at 0.01, 12.0 at 0.001.

The bit order is little-endian throughout (bit ``b`` of the stream is bit ``b & 7`` of byte
``b >> 3``), and each part starts on 4 bytes, so the stream read as uint32 words is the same: the
CUDA kernels (``exdyna_mpi/kernels/cuda/index.py``) write it with 32-bit atomics and produce these bytes.

Every form decodes to ascending offsets. Raw and Elias-Fano need an ascending selection (every
selector writes one); ``encode_indices`` sorts a copy of one that is not, so every rank still
decodes one union from the same bytes.
"""
import numpy as np
from numba import njit

FORM_RAW = 0
FORM_BITMAP = 1
FORM_EF = 2

#: the lowest set bit of every nonzero byte (Elias-Fano's decoder reads its unary part a byte at a time)
_CTZ8 = np.array([0] + [(v & -v).bit_length() - 1 for v in range(1, 256)], dtype=np.int64)


@njit(cache=True, nogil=True, inline="always")
def _pad4(nbytes):
    return (nbytes + 3) // 4 * 4


@njit(cache=True, nogil=True)
def ef_shape(count, span):
    """``(l, lower bytes, upper bytes)`` of the Elias-Fano form of ``count`` >= 1 offsets in a span
    of ``span`` elements: ``l`` low bits each, both parts padded to 4 bytes."""
    low = 0
    while (count << (low + 1)) <= span:
        low += 1
    lower = _pad4((count * low + 7) // 8)
    upper = _pad4((count + ((span - 1) >> low) + 1 + 7) // 8)
    return low, lower, upper


@njit(cache=True, nogil=True)
def form_size(form, count, span):
    """Bytes of ``count`` offsets in a span of ``span`` elements in ``form`` (multiples of 4)."""
    if count == 0:
        return 0
    if form == FORM_RAW:
        return 4 * count
    if form == FORM_BITMAP:
        return _pad4((span + 7) // 8)
    _, lower, upper = ef_shape(count, span)
    return lower + upper


@njit(cache=True, nogil=True)
def index_form(count, span):
    """``(form, bytes)``: the smallest form of ``count`` offsets in a span of ``span`` elements
    (ties: raw, then bitmap, then Elias-Fano)."""
    best, size = FORM_RAW, form_size(FORM_RAW, count, span)
    for form in (FORM_BITMAP, FORM_EF):
        s = form_size(form, count, span)
        if s < size:
            best, size = form, s
    return best, size


@njit(cache=True, nogil=True)
def _ascending(idx):
    for j in range(1, idx.shape[0]):
        if idx[j] < idx[j - 1]:
            return False
    return True


@njit(cache=True, nogil=True, inline="always")
def _put_bits(out, pos, v, nbits):
    # the low nbits of v at bit pos of out (bits already zero), a byte at a time
    while nbits > 0:
        b = pos >> 3
        s = pos & 7
        take = min(8 - s, nbits)
        out[b] |= np.uint8((v & ((1 << take) - 1)) << s)
        v >>= take
        pos += take
        nbits -= take


@njit(cache=True, nogil=True, inline="always")
def _get_bits(buf, pos, nbits):
    v = np.int64(0)
    got = 0
    while got < nbits:
        b = pos >> 3
        s = pos & 7
        take = min(8 - s, nbits - got)
        v |= np.int64((buf[b] >> s) & ((1 << take) - 1)) << got
        pos += take
        got += take
    return v


@njit(cache=True, nogil=True)
def encode_form(idx, lo, span, form, out):
    """Write the selection ``idx`` (global indices inside ``[lo, lo + span)``) into the uint8
    buffer ``out`` in ``form``; returns the bytes written (``form_size``)."""
    count = idx.shape[0]
    nbytes = form_size(form, count, span)
    if form != FORM_BITMAP and not _ascending(idx):
        idx = np.sort(idx)
    out[:nbytes] = 0
    if form == FORM_RAW:
        o32 = out[:nbytes].view(np.uint32)
        for j in range(count):
            o32[j] = idx[j] - lo
    elif form == FORM_BITMAP:
        for j in range(count):
            o = idx[j] - lo
            out[o >> 3] |= np.uint8(1 << (o & 7))
    elif count > 0:
        low, lower, _ = ef_shape(count, span)
        up = out[lower:nbytes]
        for j in range(count):
            o = np.int64(idx[j] - lo)
            if low > 0:
                _put_bits(out, j * low, o, low)
            p = (o >> low) + j
            up[p >> 3] |= np.uint8(1 << (p & 7))
    return nbytes


@njit(cache=True, nogil=True)
def encode_indices(idx, lo, span, out):
    """``encode_form`` in the selection's ``index_form``; returns the bytes written."""
    return encode_form(idx, lo, span, index_form(idx.shape[0], span)[0], out)


@njit(cache=True, nogil=True)
def decode_form(buf, count, lo, span, form, out):
    """The ``count`` global indices encoded in ``buf`` in ``form`` into ``out``, ascending."""
    nbytes = form_size(form, count, span)
    if form == FORM_RAW:
        o32 = buf[:nbytes].view(np.uint32)
        for j in range(count):
            out[j] = lo + np.int64(o32[j])
    elif form == FORM_BITMAP:
        j = 0
        for b in range(nbytes):
            v = buf[b]
            if v == 0:
                continue
            for bit in range(8):
                if (v >> bit) & 1:
                    out[j] = lo + 8 * b + bit
                    j += 1
    elif count > 0:
        low, lower, _ = ef_shape(count, span)
        j = 0
        for b in range(nbytes - lower):
            v = np.int64(buf[lower + b])
            while v != 0 and j < count:
                high = 8 * b + _CTZ8[v] - j
                lowbits = _get_bits(buf, j * low, low) if low > 0 else 0
                out[j] = lo + ((high << low) | lowbits)
                j += 1
                v &= v - 1


@njit(cache=True, nogil=True)
def decode_indices(buf, count, lo, span, out):
    """``decode_form`` in the ``index_form`` of ``(count, span)``."""
    decode_form(buf, count, lo, span, index_form(count, span)[0], out)
