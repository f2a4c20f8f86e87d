#!/usr/bin/env python
"""What load imbalance costs on the wire: one step's sparse exchange with one rank selecting more.

    bash jobs/run_e2e.sh --job jobs/bench_imbalance.py --rate 100,1000 --out out/imbalance   # shaped links
    timeout 600 mpiexec -n 4 python -m mpi4py jobs/bench_imbalance.py --out out/imbalance    # any MPI

ExDyna's step moves two things: the selected indices (``Exchange.allgatherv``, each rank its own
count: the only part whose size differs between ranks) and the values at their union
(``Exchange.sum_identical``: ``Reduce_scatter`` + ``Allgatherv`` of equal shares of the union, the
same size on every rank whatever the split). For each total count K of ``--totals`` and each
imbalance e of ``--imbalances`` (largest count over the mean, minus 1: the ``stats.imbalance`` of
a step), one "hot" rank selects ``K (1 + e) / P`` and the others share the rest equally; the hot
rank rotates with the repetition, and the settings alternate within each repetition, so drift and
one slow link fall on every setting alike. Timed per rank from a barrier; a step waits for its
slowest rank, so each repetition keeps the largest time over ranks. Indices are int32 (4 bytes,
the uncompressed form), values float32.

Rank 0 writes ``<out>/imbalance.jsonl`` (one record per setting and rate) and appends a table to
``<out>/imbalance.md``: median milliseconds of the index gather and of the value sum, and the index
gather's time against the same K with no imbalance. ``EXDYNA_TESTBED_RATE_MBIT`` (set by the
testbed) labels the rate.
"""
import argparse
import json
import os
import time

import numpy as np
from mpi4py import MPI

from exdyna_mpi import transport


def counts_for(total, p, e, hot):
    """Per-rank counts summing to ``total``, rank ``hot`` at ``total (1 + e) / P`` (so ``max / mean
    - 1 == e`` up to rounding), the others sharing the rest equally."""
    c = np.zeros(p, dtype=np.int64)
    c[hot] = min(total, int(round(total * (1.0 + e) / p)))
    others = np.flatnonzero(np.arange(p) != hot)
    rest = total - int(c[hot])
    c[others] = rest // max(len(others), 1)
    c[others[: rest % max(len(others), 1)]] += 1
    return c


def timed(comm, fn):
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    return comm.allreduce(dt, op=MPI.MAX)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--totals", default="1410,20000,200000,2000000",
                    help="comma-separated total selected counts K (the digits CNN at d=0.01 selects 1,410)")
    ap.add_argument("--imbalances", default="0,0.2,0.5,1.0", help="comma-separated largest/mean - 1")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-seconds", type=float, default=240.0, help="stop adding repetitions after this")
    ap.add_argument("--out", default="out/imbalance")
    args, _ = ap.parse_known_args(argv)   # run_e2e.sh passes --ranks/--rate: not ours
    comm = MPI.COMM_WORLD
    p, rank = comm.Get_size(), comm.Get_rank()
    ex = transport.Exchange(comm)
    totals = [int(x) for x in args.totals.split(",")]
    imbs = [float(x) for x in args.imbalances.split(",")]
    rate = os.environ.get("EXDYNA_TESTBED_RATE_MBIT", "")
    rng = np.random.default_rng(rank)
    times = {(k, e): ([], []) for k in totals for e in imbs}
    start = time.perf_counter()
    for rep in range(args.warmup + args.reps):
        order = [(k, e) for k in totals for e in (imbs if rep % 2 == 0 else imbs[::-1])]
        for k, e in order:
            c = counts_for(k, p, e, rep % p)
            idx = rng.integers(0, 2**31 - 1, size=int(c[rank]), dtype=np.int64).astype(np.int32)
            vals = rng.standard_normal(k).astype(np.float32)
            t_idx = timed(comm, lambda: ex.allgatherv(idx, c))
            t_val = timed(comm, lambda: ex.sum_identical(vals))
            if rep >= args.warmup:
                times[(k, e)][0].append(t_idx)
                times[(k, e)][1].append(t_val)
        stop = comm.bcast(time.perf_counter() - start > args.max_seconds, root=0)
        if stop and rep >= args.warmup:
            break
    if rank != 0:
        return
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for k in totals:
        base = float(np.median(times[(k, 0.0)][0])) if (k, 0.0) in times else None
        for e in imbs:
            ti, tv = times[(k, e)]
            mi, mv = float(np.median(ti)), float(np.median(tv))
            c = counts_for(k, p, e, 0)
            rows.append({"kind": "imbalance", "rate_mbit": rate, "ranks": p, "total": k, "imbalance": e,
                         "largest": int(c.max()), "reps": len(ti), "idx_ms": 1e3 * mi, "val_ms": 1e3 * mv,
                         "idx_vs_balanced": mi / base if base else None,
                         "idx_ms_all": [1e3 * x for x in ti], "val_ms_all": [1e3 * x for x in tv]})
    with open(os.path.join(args.out, "imbalance.jsonl"), "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    when = time.strftime("%Y-%m-%d")
    lines = [f"\n### P = {p}, {rate or 'unshaped'} Mbit/s ({when}; medians of {rows[0]['reps']} steps)\n",
             "| K (total selected) | imbalance | largest rank | index gather ms | vs balanced | value sum ms |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        vs = f"{r['idx_vs_balanced']:.2f}x" if r["idx_vs_balanced"] else "-"
        lines.append(f"| {r['total']:,} | {r['imbalance']:.2f} | {r['largest']:,} | {r['idx_ms']:.2f} | {vs} | "
                     f"{r['val_ms']:.2f} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "imbalance.md"), "a") as f:
        f.write(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
