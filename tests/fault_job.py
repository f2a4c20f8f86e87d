"""A job in which one rank fails in the middle of its steps (tests/unit/test_abort.py launches it).

    python -m mpi4py tests/fault_job.py RANK STEP [raise|stop] [exdyna|wagma]

``raise``: the rank raises; run under ``python -m mpi4py``, the exception must end every rank while
the others wait in the step's collectives for a rank that never comes. ``stop``: the rank sends
itself SIGSTOP and never dies; the others' bounded waits (``EXDYNA_TIMEOUT_S``) must end the job.
``exdyna`` steps an ExDyna sparsifier, ``wagma`` a GroupAverager (every step a group average).
"""
import os
import signal
import sys

import numpy as np
from mpi4py import MPI

import exdyna_mpi

fail_rank, fail_step = int(sys.argv[1]), int(sys.argv[2])
how = sys.argv[3] if len(sys.argv) > 3 else "raise"
what = sys.argv[4] if len(sys.argv) > 4 else "exdyna"
comm = MPI.COMM_WORLD
if what == "wagma":
    sp = exdyna_mpi.GroupAverager(10_000, comm, group_size=min(2, comm.Get_size()), sync_every=1)
else:
    sp = exdyna_mpi.ExDyna(10_000, 0.01, comm)
rng = np.random.default_rng(comm.Get_rank())
for step in range(fail_step + 50):
    if comm.Get_rank() == fail_rank and step == fail_step:
        if how == "stop":
            print(f"fault drill: rank {fail_rank} stops at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        raise RuntimeError(f"fault drill: rank {fail_rank} fails at step {step}")
    sp.step(rng.standard_normal(10_000).astype(np.float32))
print("finished without the fault", flush=True)
