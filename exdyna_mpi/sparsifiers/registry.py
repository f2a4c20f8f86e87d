"""Sparsifiers by name, so jobs and benchmarks can swap them."""
from .baselines import BASELINES
from .exdyna import ExDyna, MiCRO

REGISTRY = {cls.name: cls for cls in (ExDyna, MiCRO, *BASELINES)}


def register(cls):
    """Add a Sparsifier subclass to the factory under ``cls.name``."""
    REGISTRY[cls.name] = cls
    return cls


def available():
    """Names ``make`` accepts."""
    return sorted(REGISTRY)


def make(name, numel, density, comm=None, **options):
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
