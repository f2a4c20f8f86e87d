"""Sparsifiers by name, so jobs and benchmarks can swap them."""
from __future__ import annotations

from typing import Any, TypeVar

from .base import Sparsifier
from .baselines import BASELINES
from .exdyna import ExDyna, MiCRO

REGISTRY: dict[str, type[Sparsifier]] = {cls.name: cls for cls in (ExDyna, MiCRO, *BASELINES)}

_S = TypeVar("_S", bound=type[Sparsifier])


def register(cls: _S) -> _S:
    """Add a Sparsifier subclass to the factory under ``cls.name``."""
    REGISTRY[cls.name] = cls
    return cls


def available() -> list[str]:
    """Names ``make`` accepts."""
    return sorted(REGISTRY)


def make(name: str, numel: int, density: float, comm: Any = None, **options: Any) -> Sparsifier:
    """Build the sparsifier called ``name``; every one has the same ``step``/``stats`` interface.

    Example::

        >>> sp = exdyna_mpi.make("topk", numel, 0.01, comm)
        >>> out = sp.step(grad)
    """
    try:
        cls = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown sparsifier {name!r}; available: {', '.join(available())}") from None
    return cls(numel, density, comm, **options)
