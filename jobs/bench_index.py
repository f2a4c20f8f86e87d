#!/usr/bin/env python
"""Benchmark (not a test): the step's bytes per selected element against the index floor, and its phases.

    mpiexec -n 4 python -m mpi4py jobs/bench_index.py --out results/bench_index/2026-12-02/P4.jsonl
    mpiexec -n 2 python -m mpi4py jobs/bench_index.py --densities 0.001 --numel 1e7

For each density, ExDyna (its defaults) steps one synthetic stream (jobs/streams.py) in six
settings side by side, alternating step by step, each its own instance:

    mean        float32 values, the mean gathered (ExDyna's plain step)
    mean-int8   the same with ``wire_dtype="int8"`` (8-bit values, a scale per 128)
    sign        float32 values to their owners, the signs gathered (``output="sign"``: what
                ``DistributedOptimizer``'s AdamW default, ``adam="demo-age"``, sends)
    sign-bf16   the same with ``wire_dtype="bfloat16"``
    sign-int8   the same with ``wire_dtype="int8"``
    sign-fp8    the same with ``wire_dtype="float8_e4m3fn"`` (the same bytes as int8)

Reported per setting, over the steps after ``--warmup``:

- bits per index on the wire: each rank's selection in its ``exdyna_mpi/kernels/cpu_index.index_form`` (what
  the exchange sends), against the floor ``log2 C(span, count)`` summed over ranks, and the
  16-bit-offset form these forms replaced (computed: 2 bytes an index and 4 a 65,536-element
  segment);
- bytes per selected element: ``bytes_sent`` per rank and step (the ring model's count) over the
  step's selected elements;
- the median of each phase of ``stats.seconds`` (slowest rank), and the step.
"""
import argparse
import json
import math
import platform
import time

import numpy as np
from mpi4py import MPI

import exdyna_mpi
# the forms the exchange sends: this benchmark measures them against the floor
from exdyna_mpi.kernels.cpu_index import index_form
import streams  # jobs/streams.py, beside this script

SETTINGS = {"mean": {}, "mean-int8": {"wire_dtype": "int8"}, "sign": {"output": "sign"},
            "sign-bf16": {"output": "sign", "wire_dtype": "bfloat16"},
            "sign-int8": {"output": "sign", "wire_dtype": "int8"},
            "sign-fp8": {"output": "sign", "wire_dtype": "float8_e4m3fn"}}


def floor_bits(count, span):
    """``log2 C(span, count)``: the fewest bits that tell ``count`` positions among ``span``."""
    return (math.lgamma(span + 1) - math.lgamma(count + 1) - math.lgamma(span - count + 1)) / math.log(2)


def seg16_bytes(count, span):
    """The 16-bit-offset form's bytes (a uint32 count per 65,536 elements, 2 bytes an index)."""
    return -(-(4 * -(-span // 65536) + 2 * count) // 4) * 4


def index_bits(stats):
    """(wire bits, floor bits, seg16 bits, selected) of one step's selections, over every rank."""
    c, b, own = stats.counts, stats.bounds, stats.owned
    wire = fl = seg = 0.0
    for r in range(len(c)):
        span = int(b[own[r] + 1] - b[own[r]])
        wire += 8 * index_form(int(c[r]), span)[1]
        fl += floor_bits(int(c[r]), span)
        seg += 8 * seg16_bytes(int(c[r]), span)
    return wire, fl, seg, int(c.sum())


def run(density, args, comm):
    rank, p = comm.Get_rank(), comm.Get_size()
    src = streams.open_stream(streams.ensure(args.stream, p), int(args.numel), rank, p, seed=1)
    g = src.next()
    n = g.shape[0]
    sps = {s: exdyna_mpi.make("exdyna", n, density, comm, **o) for s, o in SETTINGS.items()}
    acc = {s: dict(sent=0.0, sel=0, wire=0.0, floor=0.0, seg=0.0, phases={}, step=[]) for s in SETTINGS}
    for t in range(args.steps):
        if t:
            g = src.next()
        for s, sp in sps.items():
            comm.Barrier()
            t0 = time.perf_counter()
            sp.step(g)
            dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if t < args.warmup:
                continue
            a, st = acc[s], sp.stats
            a["step"].append(dt)
            a["sent"] += comm.allreduce(st.bytes_sent) / p
            w, f, sg, k = index_bits(st)
            a["wire"] += w
            a["floor"] += f
            a["seg"] += sg
            a["sel"] += k
            every = comm.allgather(dict(st.seconds))
            for ph in set().union(*every):
                a["phases"].setdefault(ph, []).append(max(d.get(ph, 0.0) for d in every))
    rows = []
    for s, a in acc.items():
        k = max(a["sel"], 1)
        rows.append({"stream": args.stream, "numel": n, "density": density, "setting": s, "ranks": p,
                     "steps": args.steps - args.warmup, "selected_per_step": a["sel"] / len(a["step"]),
                     "bits_per_index": a["wire"] / k, "floor_bits_per_index": a["floor"] / k,
                     "seg16_bits_per_index": a["seg"] / k, "bytes_per_selected": a["sent"] / k,
                     "step_ms": 1e3 * float(np.median(a["step"])),
                     "phases_ms": {ph: 1e3 * float(np.median(v)) for ph, v in sorted(a["phases"].items())}})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stream", default="ar0.9", help="a synthetic stream of jobs/streams.py")
    ap.add_argument("--numel", type=float, default=1e7)
    ap.add_argument("--densities", default="0.001,0.01,0.05")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--out", help="JSON lines file for the records")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    rows = [r for d in args.densities.split(",") for r in run(float(d), args, comm)]
    if comm.Get_rank() == 0:
        when = time.strftime("%Y-%m-%d")
        print(f"bench_index, {comm.Get_size()} ranks, {when}, {platform.processor() or platform.machine()}")
        print("| density | setting | bits/index | floor | 16-bit form | B/selected | step ms | phases ms |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            ph = ", ".join(f"{k} {v:.2f}" for k, v in r["phases_ms"].items() if v >= 0.05)
            print(f"| {r['density']} | {r['setting']} | {r['bits_per_index']:.2f} | {r['floor_bits_per_index']:.2f} | "
                  f"{r['seg16_bits_per_index']:.2f} | {r['bytes_per_selected']:.2f} | {r['step_ms']:.2f} | {ph} |")
        if args.out:
            with open(args.out, "w") as f:
                for r in rows:
                    f.write(json.dumps({**r, "date": when, "machine": platform.processor() or platform.machine()})
                            + "\n")


if __name__ == "__main__":
    main()
