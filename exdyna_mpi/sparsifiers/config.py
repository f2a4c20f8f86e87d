"""A sparsifier's arguments: ``Option`` (what a class declares), ``SparsifierConfig`` (what a
constructor resolved), ``configure`` (the one function that checks them).

Every rank runs ``configure`` on its own arguments; ``Sparsifier.__init__`` then agrees the
problems and the ``SparsifierConfig.text`` of every rank in one collective (``roles.agree_arguments``),
so a bad or disagreeing argument on any rank raises the same ``CollectiveError`` on every rank.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Mapping

import numpy as np

from ..arrays import HALF_DTYPES
from ..arrays.ops import cuda_available, cuda_simulated
from .capabilities import names_where

NONFINITE_POLICIES = ("raise", "skip")
DEVICES = ("auto", "cpu", "cuda")
#: ``wire_dtype``: None (the gradient's: 16-bit values for a half gradient where the sparsifier can
#: send them, else the computing dtype), or one of these (``EIGHT_BIT``: 8-bit integers or float8
#: e4m3fn codes with a float32 scale per block of 128 values, ``exdyna_mpi/kernels/cpu_8bit.py``)
WIRE_DTYPES = ("float32", "bfloat16", "float16", "int8", "float8_e4m3fn")
#: the ``wire_dtype`` values of 8-bit codes with a scale per block
EIGHT_BIT = ("int8", "float8_e4m3fn")
#: the ``wire_dtype`` values narrower than float32: only from float32 (or half) gradients
NARROW_WIRE = ("bfloat16", "float16") + EIGHT_BIT
#: ``output``: what a step returns at the union, the average (``"mean"``) or its sign (``"sign"``: 1,
#: -1 or 0, the values' signs gathered as 2-bit codes; for updates that use the sign alone)
OUTPUTS = ("mean", "sign")

__all__ = ["DEVICES", "EIGHT_BIT", "NARROW_WIRE", "NONFINITE_POLICIES", "OUTPUTS", "WIRE_DTYPES", "Option",
           "SparsifierConfig", "configure",
           "nonneg_int", "positive_int"]


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of a sparsifier class, declared in its ``OPTIONS`` mapping (name -> ``Option``).

    Attributes:
        default: the value when the caller gives none.
        check: ``check(value)`` raises ``ValueError(text)`` when ``value`` is not accepted, ``text``
            completing the option's name ("must be a positive integer"); what it returns is not
            used. The value is kept as given, never normalised: its ``repr`` is part of the text the
            ranks agree on (``SparsifierConfig.text``), which the state dicts and identities rely on.
        doc: one line on what the option does (docs/reference.md holds its row).

    Example::

        class MySparsifier(Sparsifier):
            OPTIONS = {"period": Option(32, positive_int, "steps between exact thresholds")}
    """

    default: Any
    check: Callable[[Any], object]
    doc: str = ""


def positive_int(v: Any) -> None:
    """An ``Option.check``: a positive Python or NumPy integer (not a bool)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ValueError("must be a positive integer")


def nonneg_int(v: Any) -> None:
    """An ``Option.check``: a non-negative Python or NumPy integer (not a bool)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ValueError("must be a non-negative integer")


@dataclasses.dataclass(frozen=True, eq=False)
class SparsifierConfig:
    """What a sparsifier was built with, as ``configure`` resolved it (``Sparsifier.config``).

    Attributes:
        name: the class's ``name``.
        numel: as given (a Python or NumPy integer; ``Sparsifier.numel`` is its ``int``).
        density: as a ``float``.
        nonfinite: ``"raise"`` or ``"skip"``.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        wire_dtype: None or one of ``WIRE_DTYPES``.
        output: ``"mean"`` or ``"sign"``.
        options: every option of the class's ``OPTIONS``, as given or its default (read-only).
    """

    name: str
    numel: int
    density: float
    nonfinite: str
    device: str
    wire_dtype: str | None
    output: str
    options: Mapping[str, Any]

    @property
    def text(self) -> str:
        """The text every rank compares at construction and fingerprints into ``Sparsifier.ident``:
        each argument's ``repr``, the options sorted by name. The same arguments give the same
        text in every version (state dicts and step identities depend on it)."""
        return (f"{self.name} numel={self.numel!r} density={self.density!r} nonfinite={self.nonfinite!r} "
                f"device={self.device!r} wire_dtype={self.wire_dtype!r} output={self.output!r} "
                + " ".join(f"{k}={v!r}" for k, v in sorted(self.options.items())))


def configure(cls: type[Any], family: type, numel: Any, density: Any, nonfinite: Any, device: Any,
              options: Mapping[str, Any]) -> tuple[SparsifierConfig, list[str]]:
    """Check one rank's arguments for sparsifier class ``cls``; nothing collective.

    Args:
        cls: the sparsifier class (its ``name``, ``CAPABILITIES`` and ``OPTIONS``).
        family: the class whose subclasses are named when ``cls`` lacks a capability asked for.
        numel, density, nonfinite, device: the constructor's arguments.
        options: the keyword options (``wire_dtype``, ``output`` and the class's ``OPTIONS``).

    Returns:
        ``(config, problems)``: the resolved arguments and one text per bad argument (empty when
        every argument is good; the config is then what the sparsifier runs with).

    Raises:
        Nothing: every problem is returned, so that every rank can refuse together.
    """
    errors = []
    opts = dict(options)
    if isinstance(numel, (bool, np.bool_)) or not isinstance(numel, (int, np.integer)) or numel <= 0:
        errors.append(f"numel must be a positive integer, got {numel!r}")
    try:
        density = float(density)
        if not 0.0 < density <= 1.0:
            raise ValueError
    except (TypeError, ValueError):
        errors.append(f"density must be in (0, 1], got {density!r}")
    caps, name = cls.CAPABILITIES, cls.name
    if nonfinite not in NONFINITE_POLICIES:
        errors.append(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
    if device not in DEVICES:
        errors.append(f"device must be one of {DEVICES}, got {device!r}")
    elif device == "cuda" and not cuda_available():
        errors.append("device='cuda' but no CUDA device is available to CuPy")
    elif device == "cuda" and not caps.device_step and not cuda_simulated():
        errors.append(f"device='cuda': {name}'s step is host NumPy code (no CUDA step); give it host "
                      f"gradients with device='cpu', or use one of {', '.join(names_where(family, 'device_step'))}")
    wire_dtype = opts.pop("wire_dtype", None)
    if wire_dtype is not None and wire_dtype not in WIRE_DTYPES:
        errors.append(f"wire_dtype must be None or one of {WIRE_DTYPES}, got {wire_dtype!r}")
    elif wire_dtype in HALF_DTYPES and not caps.wire_half:
        errors.append(f"{name} cannot send its values in {wire_dtype} (wire_dtype); the sparsifiers "
                      f"that can: {', '.join(names_where(family, 'wire_half'))}")
    elif wire_dtype in EIGHT_BIT and not caps.wire_8bit:
        errors.append(f"{name} cannot send its values in {wire_dtype} (wire_dtype); the sparsifiers "
                      f"that can: {', '.join(names_where(family, 'wire_8bit'))}")
    output = opts.pop("output", "mean")
    if output not in OUTPUTS:
        errors.append(f"output must be one of {OUTPUTS}, got {output!r}")
    elif output == "sign" and not caps.sign_output:
        errors.append(f"{name} cannot return the sign of its average (output='sign'); the sparsifiers "
                      f"that can: {', '.join(names_where(family, 'sign_output'))}")
    resolved = {}
    for key, option in cls.OPTIONS.items():
        val = opts.pop(key, option.default)
        try:
            option.check(val)
        except ValueError as e:
            errors.append(f"{key} {e}, got {val!r}")
        resolved[key] = val
    for key in sorted(opts):
        errors.append(f"unknown option {key!r} for {name}")
    config = SparsifierConfig(name, numel, density, nonfinite, device, wire_dtype, output,
                              types.MappingProxyType(resolved))
    return config, errors
