"""exdyna_mpi: sparse gradient exchange over MPI for data-parallel training.

Public surface: ``ExDyna`` (and ``MiCRO``), ``make``/``available`` for every sparsifier by name,
``StepError``. Everything else lives in private modules.
"""
from ._errors import StepError
from ._factory import available, make, register
from .exdyna import ExDyna, MiCRO
from .wagma import GroupAverager

__all__ = ["ExDyna", "GroupAverager", "MiCRO", "StepError", "available", "make", "register"]
__version__ = "0.1.0"
