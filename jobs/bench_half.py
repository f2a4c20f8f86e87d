#!/usr/bin/env python
"""Benchmark (not a test): one ExDyna step on a float32, float16 and bfloat16 torch CPU gradient,
side by side (the three alternate step by step, so they see the same machine load).

    python jobs/bench_half.py                       # 10M elements, d = 0.001, one rank
    python jobs/bench_half.py --numel 1e6 --steps 30

A half gradient is widened to float32 on entry and its output rounded back (docs/precision.md):
the difference to the float32 row is the cost of those two passes.
"""
import argparse
import time

import numpy as np
import torch
from mpi4py import MPI

import exdyna_mpi


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=float, default=1e7)
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=4)
    a = ap.parse_args(argv)
    n = int(a.numel)
    base = torch.from_numpy(np.random.default_rng(0).standard_normal(n).astype(np.float32))
    grads = {"float32": base.clone(), "float16": base.half(), "bfloat16": base.bfloat16()}
    sps = {k: exdyna_mpi.ExDyna(n, a.density, MPI.COMM_SELF) for k in grads}
    outs = {k: torch.empty_like(g) for k, g in grads.items()}
    times = {k: [] for k in grads}
    for _ in range(a.steps):
        for k, g in grads.items():
            t0 = time.perf_counter()
            sps[k].step(g, out=outs[k])
            times[k].append(time.perf_counter() - t0)
    ref = np.median(times["float32"][a.warmup:])
    print(f"ExDyna.step(grad, out=), numel {n:,}, density {a.density}, one rank, median of "
          f"{a.steps - a.warmup} steps after {a.warmup}")
    for k, t in times.items():
        m = np.median(t[a.warmup:])
        print(f"{k:9s} {1e3 * m:8.2f} ms  {m / ref:5.2f}x float32")


if __name__ == "__main__":
    main()
