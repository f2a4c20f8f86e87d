"""Density and balance of ExDyna's controllers on every stream of the corpus (jobs/streams.py), one table.

Runs the real ExDyna, every rank its own gradient of the stream, for each stream and controller:
  measured    the default: measures this step's |acc| (histograms summed with one Allreduce)
  faithful    the authors' rule (x1.005 / x1.00125 / x0.995 from 1/(2 sqrt k))
  quota       measured with ``max_imbalance=0.05`` (per-rank quotas after the count exchange)
each with ``balance=True`` (the controller's own rebalancing rule). Columns, after step 20: the
share of steps with selected / k within +-10 %, the mean, min and max of selected / k, the median
imbalance (max count x P / total - 1). Recorded streams run at the density that gives k >= --min-k
(their vectors are small); the table says which. Writes JSON.

    timeout 3000 mpiexec -n 4 python -m mpi4py jobs/density_bench.py --numel 1048576 --steps 120 --out out/density
"""
import json
import os
import sys
import time

import numpy as np

import exdyna_mpi
import streams as corpus
from common import parser, world

CONTROLLERS = ("measured", "quota", "faithful")
#: a row name -> ExDyna options
OPTIONS = {"quota": {"controller": "measured", "max_imbalance": 0.05}}


def run(stream, ctl, numel, density, steps, comm, seed):
    st = corpus.open_stream(stream, numel, comm.Get_rank(), comm.Get_size(), seed)
    numel = getattr(st, "numel", numel)
    sp = exdyna_mpi.ExDyna(numel, density, comm, **OPTIONS.get(ctl, {"controller": ctl}))
    k = max(1, int(density * numel))
    ratio, imb, empty = [], [], 0
    for _ in range(steps):
        sp.step(st.next())
        ratio.append(sp.stats.selected / k)
        imb.append(sp.stats.imbalance)
        empty += int(sp.stats.selected == 0)
    return numel, k, np.array(ratio), np.array(imb), empty


def summarise(ratio, imb, empty, skip=20):
    a = ratio[skip:]
    return {"in_band": float(np.mean(np.abs(a - 1.0) <= 0.1)), "mean": float(a.mean()), "min": float(a.min()),
            "max": float(a.max()), "imbalance_median": float(np.median(imb[skip:])),
            "first": float(ratio[0]), "empty_steps": int(empty)}


def main():
    ap = parser(__doc__, numel=1 << 20, density=0.001, steps=120, seed=0, out="out/density", raw=True)
    ap.add_argument("--streams", default=",".join(corpus.SYNTHETIC + tuple(corpus.RECORDED)))
    ap.add_argument("--controllers", default=",".join(CONTROLLERS))
    ap.add_argument("--min-k", type=int, default=1000, help="recorded streams: raise the density to this k")
    a = ap.parse_args()
    comm, rank, P = world(a)
    rows, t_start = [], time.perf_counter()
    for s in a.streams.split(","):
        if s in corpus.RECORDED:
            if rank == 0:
                corpus.ensure(s, P)
            comm.Barrier()
        for ctl in a.controllers.split(","):
            t0 = time.perf_counter()
            numel = a.numel
            if s in corpus.RECORDED:
                numel = corpus.Recorded(s, 0, 1).numel
            d = max(a.density, a.min_k / numel) if s in corpus.RECORDED else a.density
            steps = a.steps
            if s in corpus.RECORDED:
                steps = min(steps, corpus.Recorded(s, 0, 1).steps)
            numel, k, ratio, imb, empty = run(s, ctl, numel, d, steps, comm, a.seed)
            row = {"stream": s, "controller": ctl, "numel": numel, "density": d, "k": k, "steps": steps,
                   **summarise(ratio, imb, empty), "seconds": time.perf_counter() - t0}
            rows.append(row)
            if rank == 0:
                print(f"[{s}/{ctl}] {row['seconds']:.0f} s", file=sys.stderr, flush=True)
    if rank:
        return
    print(f"ExDyna density bench: P={P}, synthetic numel={a.numel} density={a.density}, up to {a.steps} steps "
          f"({time.perf_counter() - t_start:.0f} s). After step 20: steps within +-10 % of k, selected / k "
          "mean, min, max; median imbalance.")
    hdr = ("stream", "k", "controller", "in band", "mean", "min", "max", "imbalance (median)", "empty steps")
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for r in rows:
        print(f"| {r['stream']} | {r['k']} | {r['controller']} | {100 * r['in_band']:.0f} % | {r['mean']:.3f} | "
              f"{r['min']:.3f} | {r['max']:.3f} | {r['imbalance_median']:.3f} | {r['empty_steps']} |")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"density_bench_P{P}.json")
    with open(path, "w") as f:
        json.dump({"args": vars(a), "nranks": P, "rows": rows}, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
