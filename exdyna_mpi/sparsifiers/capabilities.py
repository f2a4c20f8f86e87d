"""What a sparsifier class can do, declared once: ``Sparsifier.CAPABILITIES``.

The step template and the entry points read these instead of a sparsifier's name, so a new
sparsifier gets every path it declares and no other.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Capabilities", "names_where"]


@dataclass(frozen=True)
class Capabilities:
    """A sparsifier class's capabilities (its ``CAPABILITIES`` class attribute).

    Attributes:
        wire_half: the values can travel in 16 bits (``wire_dtype``; a half gradient's default): the
            sparsifiers whose step ends in ``average_at``, and dense.
        wire_8bit: the values can travel as 8-bit codes with a scale per block (``wire_dtype``
            ``"int8"`` or ``"float8_e4m3fn"``): the sparsifiers whose step ends in ``average_at``.
        device_step: the step runs on CUDA buffers (CuPy, torch CUDA tensors) on a real GPU. False: its
            step is host NumPy code, so ``device="cuda"`` and CUDA gradients are refused with a clear
            error (the Numba CUDA simulator, whose device buffers are NumPy arrays, runs it either way).
        sign_output: ``output="sign"`` is offered (only the signs of the averaged values are gathered):
            the sparsifiers whose step ends in ``average_at``.
        tuned_defaults: the torch entry points' automatic choices (``adam="auto"``'s aged decoupled
            momentum under Adam/AdamW, ``momentum_correction="auto"`` under momentum SGD) were tuned on
            this sparsifier and apply to it; under the others ``"auto"`` means the plain path.

    Example::

        class MySparsifier(Sparsifier):
            CAPABILITIES = Capabilities(wire_half=True, sign_output=True)
    """

    wire_half: bool = False
    wire_8bit: bool = False
    device_step: bool = True
    sign_output: bool = False
    tuned_defaults: bool = False


def names_where(family: type, capability: str) -> list[str]:
    """The names of ``family`` and its subclasses whose ``CAPABILITIES`` has ``capability`` true
    (the base class, named ``"base"``, aside), sorted: the alternatives an error text offers.

    Args:
        family: the root class (``Sparsifier``).
        capability: a field of ``Capabilities``, e.g. ``"wire_half"``.

    Returns:
        The sorted names.
    """
    names, todo = set(), [family]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if getattr(cls.CAPABILITIES, capability) and cls.name != "base":   # type: ignore[attr-defined]
            names.add(cls.name)   # type: ignore[attr-defined]
    return sorted(names)
