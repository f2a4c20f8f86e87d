"""A job in which one rank raises in the middle of its steps (tests/unit/test_abort.py launches it).

Run under ``python -m mpi4py``: the exception on rank FAIL_RANK must end every rank, while the
others wait in the step's collectives for a rank that never comes.
"""
import sys

import numpy as np
from mpi4py import MPI

import exdyna_mpi

fail_rank, fail_step = int(sys.argv[1]), int(sys.argv[2])
comm = MPI.COMM_WORLD
sp = exdyna_mpi.ExDyna(10_000, 0.01, comm)
rng = np.random.default_rng(comm.Get_rank())
for step in range(fail_step + 50):
    if comm.Get_rank() == fail_rank and step == fail_step:
        raise RuntimeError(f"fault drill: rank {fail_rank} fails at step {step}")
    sp.step(rng.standard_normal(10_000).astype(np.float32))
print("finished without the fault", flush=True)
