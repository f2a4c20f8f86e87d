"""The simulator lane: CUDA kernels and the device path under ``NUMBA_ENABLE_CUDASIM=1``.

The lane command sets the variable; running ``pytest tests/cudasim`` without it still works when
numba is not imported yet (we set it here), and skips otherwise.
"""
import os
import sys

import pytest

if "numba" not in sys.modules:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


def simulator_on():
    from exdyna_mpi.kernels import cuda as kc

    return kc.SIMULATOR


def pytest_collection_modifyitems(config, items):
    quiet = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
    for item in items:
        item.add_marker(quiet)  # simulated threads compute inf - inf on purpose (non-finite test)
    if simulator_on():
        return
    skip = pytest.mark.skip(reason="needs NUMBA_ENABLE_CUDASIM=1 set before numba is imported")
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)
