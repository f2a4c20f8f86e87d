"""Arrays layer: DLPack in and out, dtype rules, the ``Ops`` protocol and its host and CUDA
implementations, and (``device.py``) the one switch between a real GPU and the CUDA simulator.

Imports only ``kernels`` and ``_errors``; never MPI.
"""
from .dlpack import (ACCEPTED_DTYPES, DTYPE_NAMES, FULL_DTYPES, HALF_DTYPES, Input, as_input,
                     check_vector, compute_dtype, dtype_code, threshold_for)
from .ops import HostOps, Ops, cuda_available, gpu_available, host_threads, ops_for

__all__ = ["ACCEPTED_DTYPES", "DTYPE_NAMES", "FULL_DTYPES", "HALF_DTYPES", "HostOps", "Input", "Ops", "as_input",
           "check_vector", "compute_dtype", "cuda_available", "dtype_code", "gpu_available", "host_threads",
           "ops_for", "threshold_for"]
