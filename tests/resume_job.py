"""Run under mpiexec by tests/unit/test_resume_processes.py, from the repository root as a module
(``mpiexec -n P python -m tests.resume_job ...``): steps of ExDyna, saving state or outputs.

  --mode full     steps 1..20, write the outputs of steps 8..20
  --mode first    steps 1..7, write each rank's state_dict
  --mode resume   load the state_dicts, steps 8..20, write the outputs
"""
import argparse
import os
import pickle

import numpy as np

import exdyna_mpi
from tests.reference import laplace_grad

NUMEL, DENSITY = 40_000, 0.005


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["full", "first", "resume"], required=True)
    ap.add_argument("--dir", required=True)
    a = ap.parse_args()
    sp = exdyna_mpi.ExDyna(NUMEL, DENSITY)
    rank = sp.rank
    state_file = os.path.join(a.dir, f"state{rank}.pkl")
    steps = {"full": range(1, 21), "first": range(1, 8), "resume": range(8, 21)}[a.mode]
    if a.mode == "resume":
        with open(state_file, "rb") as f:
            sp.load_state_dict(pickle.load(f))
    outs = {}
    for t in steps:
        out = sp.step(laplace_grad(rank, t, NUMEL, scale=0.004))
        if t >= 8:
            outs[t] = out.copy()
    if a.mode == "first":
        with open(state_file, "wb") as f:
            pickle.dump(sp.state_dict(), f)
    else:
        np.savez(os.path.join(a.dir, f"{a.mode}{rank}.npz"), **{str(t): o for t, o in outs.items()})


if __name__ == "__main__":
    main()
