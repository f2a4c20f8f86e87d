"""Sparsifiers by name, so jobs and benchmarks can swap them."""
from __future__ import annotations

from typing import Any, TypeVar

from .base import Sparsifier
from .baselines import BASELINES
from .exdyna import ExDyna, MiCRO

REGISTRY: dict[str, type[Sparsifier]] = {cls.name: cls for cls in (ExDyna, MiCRO, *BASELINES)}

_S = TypeVar("_S", bound=type[Sparsifier])


def register(cls: _S) -> _S:
    """Add a Sparsifier subclass to the factory under ``cls.name`` (usable as a decorator).

    Args:
        cls: a ``Sparsifier`` subclass with a unique ``name`` (``examples/topk_sparsifier.py``).

    Returns:
        ``cls``, unchanged.

    Raises:
        Nothing; a second class of the same name replaces the first.
    """
    REGISTRY[cls.name] = cls
    return cls


def available() -> list[str]:
    """The names ``make`` accepts.

    Returns:
        The registered sparsifiers' names, sorted.

    Raises:
        Nothing.
    """
    return sorted(REGISTRY)


def make(name: str, numel: int, density: float, comm: Any = None, **options: Any) -> Sparsifier:
    """Build the sparsifier called ``name``; every one has the same ``step``/``stats`` interface.
    Collective over ``comm``.

    Args:
        name: one of ``available()``.
        numel: the flat gradient's length, the same on every rank.
        density: the fraction of elements sent per step, in (0, 1].
        comm: the communicator (``MPI.COMM_WORLD`` when None).
        **options: the sparsifier's options (docs/reference.md).

    Returns:
        The sparsifier.

    Raises:
        ValueError: an unknown ``name``; ``CollectiveError`` (a ``ValueError``, on every rank) for
            bad or disagreeing arguments on any rank.

    Example::

        >>> sp = exdyna_mpi.make("topk", numel, 0.01, comm)
        >>> out = sp.step(grad)
    """
    try:
        cls = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown sparsifier {name!r}; available: {', '.join(available())}") from None
    return cls(numel, density, comm, **options)
