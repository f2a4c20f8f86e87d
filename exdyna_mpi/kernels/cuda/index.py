"""The compact index forms on the device: the bytes of ``exdyna_mpi/kernels/cpu_index.py``, written and read
by ``@cuda.jit`` kernels on the buffer's uint32 words.

The CPU form is little-endian bit by bit and each part starts on 4 bytes, so one rank's bytes read
as uint32 words are the same stream: bit ``b`` is bit ``b & 31`` of word ``b >> 5``. Encoding
(``encode``) is one thread an index: a raw offset is a plain store, a bitmap bit and Elias-Fano's
bits are ``atomic.or_`` into words zeroed first (neighbouring indices share words), so the bytes do
not depend on the order threads run in. Decoding (``popcounts`` then ``emit``) is one thread a word
of the bit vector (the bitmap, or Elias-Fano's unary part): it needs the number of set bits before
its word, an exclusive scan of ``popcounts`` that the caller runs (``arrays.cuda_ops``), then writes
its indices: the bitmap's positions, or Elias-Fano's ``((position - j) << l) | low bits of j``.
"""
import numpy as np
from numba import cuda

from ..cpu_index import FORM_BITMAP, FORM_EF, FORM_RAW
from .launch import _elementwise


@cuda.jit(device=True, inline=True)
def _low_bits(words, j, low):
    # the low bits of index j: bits [j * low, (j + 1) * low) of the stream (low <= 31: two words at most)
    pos = np.int64(j) * low
    w = pos >> 5
    s = pos & 31
    v = np.int64(words[w]) >> s
    if s + low > 32:
        v |= np.int64(words[w + 1]) << (32 - s)
    return v & ((np.int64(1) << low) - 1)


@cuda.jit
def _encode(idx, lo, low, form, upper0, words):
    j = cuda.grid(1)
    stride = cuda.gridsize(1)
    while j < idx.shape[0]:
        o = np.int64(idx[j]) - lo
        if form == FORM_RAW:
            words[j] = np.uint32(o)
        elif form == FORM_BITMAP:
            cuda.atomic.or_(words, o >> 5, np.uint32(1) << np.uint32(o & 31))
        else:
            if low > 0:
                pos = np.int64(j) * low
                w = pos >> 5
                s = pos & 31
                lowbits = o & ((np.int64(1) << low) - 1)
                cuda.atomic.or_(words, w, np.uint32((lowbits << s) & 0xFFFFFFFF))
                if s + low > 32:
                    cuda.atomic.or_(words, w + 1, np.uint32(lowbits >> (32 - s)))
            p = (o >> low) + j
            cuda.atomic.or_(words, upper0 + (p >> 5), np.uint32(1) << np.uint32(p & 31))
        j += stride


@cuda.jit
def _popcounts(words, w0, nw, cnt):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < nw:
        cnt[i] = cuda.popc(words[w0 + i])
        i += stride


@cuda.jit
def _emit(words, w0, nw, start, count, lo, low, form, out):
    i = cuda.grid(1)
    stride = cuda.gridsize(1)
    while i < nw:
        v = words[w0 + i]
        j = start[i]
        while v != 0 and j < count:
            pos = np.int64(32) * i + cuda.ffs(v) - 1
            if form == FORM_EF:
                out[j] = lo + (((pos - j) << low) | (_low_bits(words, j, low) if low > 0 else 0))
            else:
                out[j] = lo + pos
            j += 1
            v &= v - np.uint32(1)
        i += stride


@cuda.jit
def _raw_decode(words, lo, out):
    j = cuda.grid(1)
    stride = cuda.gridsize(1)
    while j < out.shape[0]:
        out[j] = lo + np.int64(words[j])
        j += stride


def encode(idx, lo, low, form, upper0, words, stream=0):
    """``idx`` (ascending, inside the span from ``lo``) into ``words``, the uint32 view of its
    ``form``'s bytes (zeroed first unless raw); Elias-Fano: ``low`` bits each, the unary part from
    word ``upper0`` (its lower part's bytes / 4)."""
    _elementwise(_encode, idx.shape[0], stream, idx, lo, low, form, upper0, words)


def popcounts(words, w0, nw, cnt, stream=0):
    """``cnt[i]`` = the set bits of ``words[w0 + i]``, ``i < nw``."""
    _elementwise(_popcounts, nw, stream, words, w0, nw, cnt)


def emit(words, w0, nw, start, count, lo, low, form, out, stream=0):
    """The ``count`` indices of the bitmap or Elias-Fano ``form`` into ``out``: word ``w0 + i`` of
    the bit vector writes from ``out[start[i]]`` (``start``: the exclusive scan of ``popcounts``)."""
    _elementwise(_emit, nw, stream, words, w0, nw, start, count, lo, low, form, out)


def raw_decode(words, lo, out, stream=0):
    """``out[j] = lo + words[j]``: the raw form."""
    _elementwise(_raw_decode, out.shape[0], stream, words, lo, out)
