"""exdyna_mpi: sparse gradient exchange over MPI for data-parallel training.

Public surface: ``ExDyna`` (and ``MiCRO``), ``make``/``available``/``register`` for every
sparsifier by name, ``StepError``, ``RanksLost`` (an elastic entry point recovered from a lost
rank), ``GroupAverager`` (WAGMA-SGD model averaging), and
``bind_local_gpu`` (each rank of a node on its own GPU, an explicit start-up call). The layers
are subpackages, imports pointing down only (docs/architecture.md): ``kernels`` < ``arrays`` <
``transport`` < ``algorithm`` < ``sparsifiers``, ``averaging`` < ``adapters``.
"""
from ._errors import CollectiveError, RanksLost, StepError
from ._version import __version__ as __version__  # re-exported: exdyna_mpi.__version__
from .averaging import GroupAverager
from .sparsifiers import ExDyna, MiCRO, Sparsifier, Stats, available, make, register
from .transport.binding import bind_local_gpu
from .transport.watchdog import set_timeout

__all__ = ["CollectiveError", "ExDyna", "GroupAverager", "MiCRO", "RanksLost", "Sparsifier", "StepError", "Stats",
           "available", "bind_local_gpu", "make", "register", "set_timeout"]
