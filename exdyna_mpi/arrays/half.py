"""Arrays layer: the half-precision gradients (float16, bfloat16) on the host.

A sparsifier computes a half gradient in float32: ``widen`` makes the float32 copy it works on
(exact: every float16 and bfloat16 value is a float32 value), ``narrow`` rounds its float32 output
back to the gradient's dtype, round-to-nearest-even (NaN stays NaN, inf stays inf, a value beyond the
dtype's largest becomes inf). bfloat16 travels as its uint16 bits (NumPy has no bfloat16):
``Input.array`` is then a uint16 view. Vectorised NumPy, no per-element Python.
"""
import numpy as np

from .dlpack import HALF_DTYPES

__all__ = ["HALF_DTYPES", "bf16_bits_to_f32", "f32_to_bf16_bits", "narrow", "widen"]


def bf16_bits_to_f32(bits, out=None):
    """float32 values of the bfloat16 ``bits`` (uint16): the bits shifted into the high half."""
    if out is None:
        out = np.empty(bits.shape, dtype=np.float32)
    w = out.view(np.uint32)
    np.left_shift(bits, 16, out=w, dtype=np.uint32)
    return out


def f32_to_bf16_bits(x, out=None):
    """bfloat16 bits (uint16) of float32 ``x``, round-to-nearest-even; a NaN keeps its sign and
    becomes a quiet NaN, infinities stay infinities."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    if out is None:
        out = np.empty(b.shape, dtype=np.uint16)
    r = (b >> np.uint32(16)) & np.uint32(1)
    r += np.uint32(0x7FFF)
    r += b                          # no wrap for a finite or infinite value (|b| <= 0x7F800000)
    r >>= np.uint32(16)
    nan = (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        r[nan] = (b[nan] >> np.uint32(16)) | np.uint32(0x0040)
    np.copyto(out, r, casting="unsafe")
    return out


def widen(a, name, out):
    """``out`` (float32) = the values of ``a``, a host array of half dtype ``name`` (bfloat16 as its
    uint16 bits)."""
    if name == "bfloat16":
        return bf16_bits_to_f32(a, out)
    np.copyto(out, a)
    return out


def narrow(x, name, out=None):
    """float32 ``x`` rounded to half dtype ``name`` (into ``out`` when given): a float16 array, or
    the uint16 bits of bfloat16 values."""
    if name == "bfloat16":
        return f32_to_bf16_bits(x, out)
    if out is None:
        return x.astype(np.float16)
    np.copyto(out, x, casting="same_kind")
    return out
