"""Launched by tests/mpi/test_wagma.py from the repository root, as a module (it imports tests.mpi):
``mpiexec -n P python -m mpi4py -m tests.mpi.wagma_job ...``.

--checks               the sync-exactness and wait-avoiding checks of test_wagma.py at this P (P=8)
--exit-without-close   a wait-avoiding run that never calls close(): the interpreter must still exit
"""
import sys

import numpy as np
from mpi4py import MPI

from exdyna_mpi import GroupAverager
from tests.mpi import test_wagma as tw


def main():
    comm = MPI.COMM_WORLD
    P, r = comm.Get_size(), comm.Get_rank()
    if "--exit-without-close" in sys.argv:
        ga = GroupAverager(tw.N, comm, group_size=2, sync_every=5, mode="wait_avoiding")
        for t in range(7):
            ga.step(tw.x_of(r, t))
        if r == 0:
            print(f"WAGMA-JOB exit-without-close P={P}", flush=True)
        return  # no close(): the atexit hook ends the progress thread after its last round
    for S in (2, 4, 8):
        tw.check_sync_exact(comm, S, np.float32, T=3, steps=6)
    tw.check_sync_exact(comm, 4, np.float64, T=4, steps=4)
    tw.check_wait_avoiding_delay(comm, T=4, late=5, delay=0.5, k=6, steps=9)
    worst = tw.check_wait_avoiding_random_delays(comm, T=5, steps=20)
    worst = comm.allreduce(worst, op=MPI.MAX)
    if r == 0:
        print(f"WAGMA-JOB OK P={P} (worst staleness {worst})", flush=True)


if __name__ == "__main__":
    main()
