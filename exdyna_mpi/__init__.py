"""exdyna_mpi: sparse gradient exchange over MPI for data-parallel training.

Public surface: ``ExDyna`` (and ``MiCRO``), ``make``/``available``/``register`` for every
sparsifier by name, ``StepError``, and ``GroupAverager`` (WAGMA-SGD model averaging). The layers
are subpackages, imports pointing down only (docs/architecture.md): ``kernels`` < ``arrays`` <
``transport`` < ``algorithm`` < ``sparsifiers``, ``averaging`` < ``adapters``.
"""
from ._errors import CollectiveError, StepError
from ._version import __version__ as __version__  # re-exported: exdyna_mpi.__version__
from .averaging import GroupAverager
from .sparsifiers import ExDyna, MiCRO, Sparsifier, Stats, available, make, register
from .transport.watchdog import set_timeout

__all__ = ["CollectiveError", "ExDyna", "GroupAverager", "MiCRO", "Sparsifier", "StepError", "Stats", "available",
           "make", "register", "set_timeout"]
