"""Arrays layer: the half-precision formats (float16, bfloat16) on the host.

A sparsifier computes a half gradient in float32: ``widen`` makes the float32 copy it works on
(exact: every float16 and bfloat16 value is a float32 value), ``narrow`` rounds its float32 output
back to the gradient's dtype, round-to-nearest-even (NaN stays NaN, inf stays inf, a value beyond the
dtype's largest becomes inf). bfloat16 travels as its uint16 bits (NumPy has no bfloat16):
``Input.array`` is then a uint16 view. The passes are the ``@njit`` kernels of
``exdyna_mpi/kernels/cpu_half.py`` on the 16-bit patterns (one pass, no temporaries).

``WireFormat`` is the 16-bit format values travel in (``wire_dtype``): the kernels' mode and the
float16 table, for the exchange (``transport.Exchange.mean_wire``) and the scatter at the end.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels import cpu_half as _kh
from .dlpack import HALF_DTYPES

__all__ = ["HALF_DTYPES", "WireFormat", "bf16_bits_to_f32", "f32_to_bf16_bits", "narrow", "scatter_wire", "widen"]

_MODES = {"bfloat16": _kh.MODE_BF16, "float16": _kh.MODE_F16}
_TABLE = None


def _table():
    """float16 pattern -> float32 pattern (built on first use: 256 KiB)."""
    global _TABLE
    if _TABLE is None:
        _TABLE = _kh.f16_table().view(np.uint32)
    return _TABLE


@dataclass(frozen=True)
class WireFormat:
    """A 16-bit format values travel in: ``name`` ("bfloat16" or "float16"), the kernels' ``mode``
    and the float16 widening ``table`` (uint32 patterns)."""

    name: str
    mode: int
    table: np.ndarray

    @classmethod
    def of(cls, name: str) -> "WireFormat":
        return cls(name, _MODES[name], _table())


def scatter_wire(out, residual, idx, means, err, fmt):
    """``out[idx]`` = the values of 16-bit ``means``, ``residual[idx] = err`` (one pass)."""
    _kh.scatter_wire(out, residual, idx, means, err, fmt.mode, fmt.table)


def _bits16(a):
    return a if a.dtype == np.uint16 else a.view(np.uint16)


def bf16_bits_to_f32(bits, out=None):
    """float32 values of the bfloat16 ``bits`` (uint16): ``widen`` with a new array by default."""
    return widen(bits, "bfloat16", np.empty(bits.shape, dtype=np.float32) if out is None else out)


def f32_to_bf16_bits(x, out=None):
    """bfloat16 bits (uint16) of float32 ``x``, round-to-nearest-even (``narrow``); a NaN keeps its
    sign and becomes a quiet NaN, infinities stay infinities."""
    return narrow(x, "bfloat16", out)


def widen(a, name, out):
    """``out`` (float32) = the values of ``a``, a host array of half dtype ``name`` (bfloat16 as its
    uint16 bits)."""
    _kh.widen(_bits16(a), _MODES[name], _table(), out.view(np.uint32))
    return out


def narrow(x, name, out=None):
    """float32 ``x`` rounded to half dtype ``name`` (into ``out`` when given): a float16 array, or
    the uint16 bits of bfloat16 values."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    if out is None:
        out = np.empty(b.shape, dtype=np.uint16 if name == "bfloat16" else np.float16)
    _kh.narrow(b, _MODES[name], _bits16(out))
    return out
