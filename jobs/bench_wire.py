#!/usr/bin/env python
"""Benchmark (not a test): what 16-bit values and compact indices save on the wire, and what they cost.

    mpiexec -n 3 python -m mpi4py jobs/bench_wire.py                    # mlp (recorded) and ar0.9 at 10M
    mpiexec -n 3 python -m mpi4py jobs/bench_wire.py --streams mlp --methods exdyna --steps 40

For each stream and sparsifier, four settings step side by side (alternating step by step, so they
see the same machine load), each its own instance on its own trajectory:

    int32-idx   float32 values, int32 indices (``COMPACT_INDICES = False``: the format before)
    float32     float32 values, compact indices (the float32 default)
    wire-bf16   float32 gradients, ``wire_dtype="bfloat16"``
    bf16-grad   bfloat16 gradients (ml_dtypes), 16-bit values by default

Reported per setting: bytes sent per step and rank, bytes per selected element
(bytes_sent / (selected x (P-1)/P), the exchange's own count), the median step time (slowest rank),
and for wire-bf16 the error of one step against the float32 path from the same state (the float32
instance's ``state_dict`` loaded into two twins before each step, one with each wire, both given
the step's gradient): ||out16 - out32|| / ||out32||, the median over steps. Records (JSON lines)
with ``--out``.
"""
import argparse
import json
import platform
import time

import numpy as np
from mpi4py import MPI

import exdyna_mpi
import streams  # jobs/streams.py, beside this script

SETTINGS = ("int32-idx", "float32", "wire-bf16", "bf16-grad")


def _make(name, setting, n, density, comm):
    wire = "bfloat16" if setting == "wire-bf16" else None
    sp = exdyna_mpi.make(name, n, 1.0 if name == "dense" else density, comm, wire_dtype=wire)
    if setting == "int32-idx":
        sp.COMPACT_INDICES = False
    return sp


def _input(g, setting):
    if setting == "bf16-grad":
        import ml_dtypes
        return g.astype(ml_dtypes.bfloat16)
    return g


def run(stream, name, args, comm):
    rank, p = comm.Get_rank(), comm.Get_size()
    src = streams.open_stream(streams.ensure(stream, p), int(args.numel), rank, p, seed=1)
    g = src.next()
    n = g.shape[0]
    sps = {s: _make(name, s, n, args.density, comm) for s in SETTINGS}
    probe, twin = _make(name, "float32", n, args.density, comm), _make(name, "wire-bf16", n, args.density, comm)
    times = {s: [] for s in SETTINGS}
    sent = {s: 0 for s in SETTINGS}
    selected = {s: 0 for s in SETTINGS}
    errs = []
    for t in range(args.steps):
        if t:
            g = src.next()
        if t >= args.warmup:
            # this step from the float32 instance's state, twice: float32 and 16-bit values (untimed)
            state = sps["float32"].state_dict()
            probe.load_state_dict(state)
            twin.load_state_dict(state)
            a = np.asarray(probe.step(g.copy()), np.float64)
            b = np.asarray(twin.step(g.copy()), np.float64)
            num, den = comm.allreduce(float(np.sum((a - b) ** 2))), comm.allreduce(float(np.sum(a * a)))
            errs.append((num / den) ** 0.5 if den else 0.0)
        for s, sp in sps.items():
            x = _input(g, s)
            comm.Barrier()
            t0 = time.perf_counter()
            sp.step(x)
            dt = time.perf_counter() - t0
            times[s].append(comm.allreduce(dt, op=MPI.MAX))
            if t >= args.warmup:
                sent[s] += sp.stats.bytes_sent
                selected[s] += sp.stats.selected
    rows = []
    steps = args.steps - args.warmup
    for s in SETTINGS:
        b = comm.allreduce(sent[s]) / p / steps
        sel = selected[s] / steps
        rows.append({"stream": stream, "numel": n, "sparsifier": name, "setting": s, "ranks": p,
                     "density": 1.0 if name == "dense" else args.density, "steps": steps,
                     "bytes_per_step": b, "bytes_per_selected": b / (sel * (p - 1) / p) if p > 1 else None,
                     "step_ms": 1e3 * float(np.median(times[s][args.warmup:])),
                     "one_step_rel_error": float(np.median(errs)) if s == "wire-bf16" and errs else None})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="mlp,ar0.9")
    ap.add_argument("--numel", type=float, default=1e7, help="size of a synthetic stream")
    ap.add_argument("--methods", default="exdyna,topk,dense")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--out", help="JSON lines file for the records")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    rows = []
    for stream in args.streams.split(","):
        for name in args.methods.split(","):
            rows += run(stream, name, args, comm)
    if comm.Get_rank() == 0:
        when = time.strftime("%Y-%m-%d")
        print(f"bench_wire, {comm.Get_size()} ranks, {when}, {platform.processor() or platform.machine()}")
        print("| stream | sparsifier | setting | bytes/step/rank | B/selected | step ms | 1-step rel. error |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            bps = "—" if r["bytes_per_selected"] is None else f"{r['bytes_per_selected']:.2f}"
            err = "—" if r["one_step_rel_error"] is None else f"{r['one_step_rel_error']:.2e}"
            print(f"| {r['stream']} ({r['numel']:,}) | {r['sparsifier']} | {r['setting']} | "
                  f"{r['bytes_per_step']:,.0f} | {bps} | {r['step_ms']:.2f} | {err} |")
        if args.out:
            with open(args.out, "w") as f:
                for r in rows:
                    f.write(json.dumps({**r, "date": when}) + "\n")


if __name__ == "__main__":
    main()
