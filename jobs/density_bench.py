"""Density and imbalance of ExDyna's controllers, faithful vs histogram, side by side in one run.

Runs the real ExDyna on synthetic heavy-tailed gradient streams (Student-t, 3 degrees of freedom,
the head eighth of the vector scaled up), one stream per rank:
  stationary   head 3x, statistics fixed over time
  scale        as stationary, gradient scale x0.1 at step S/3 (a learning-rate drop), x1 again at 2S/3
  skewed       head 4x (strong skew, for the rebalancing)
and prints per stream and controller: density / target after step 20 (mean, min, max), the step
from which it stays within +-10 %, recovery steps after each scale change, mean imbalance over the
last steps. Writes JSON and a PNG of density over steps.

    timeout 900 mpiexec -n 4 python -m mpi4py jobs/density_bench.py --numel 1048576 --steps 400 --out out/density
"""
import json
import os
import time

import numpy as np

import exdyna_mpi
from common import parser, world

CONFIGS = (("faithful", {"controller": "faithful", "balance": True}),
           ("histogram", {"controller": "histogram", "balance": True}),
           # the authors' one-block rule under the new controller: the rebalancing compared at the target density
           ("histogram+faithful-balance", {"controller": "histogram", "balance": "faithful"}))


def stream(name, numel, steps, rank, seed):
    """Yields this rank's gradient per step (float32): a random window of a t(3) pool, scaled."""
    rng = np.random.default_rng([seed, rank])
    pool = rng.standard_t(3, numel + (1 << 20)).astype(np.float32)
    head = np.ones(numel, np.float32)
    head[: numel // 8] = 4.0 if name == "skewed" else 3.0
    for t in range(steps):
        s = 1.0
        if name == "scale" and steps // 3 <= t < 2 * steps // 3:
            s = 0.1
        start = int(rng.integers(0, 1 << 20))
        g = pool[start:start + numel] * head
        if rng.integers(2):
            g = -g
        yield g * np.float32(s)


def run(name, opts, stream_name, a, comm):
    sp = exdyna_mpi.ExDyna(a.numel, a.density, comm, **opts)
    dens, imb = [], []
    for g in stream(stream_name, a.numel, a.steps, comm.Get_rank(), a.seed):
        sp.step(g)
        dens.append(sp.stats.density / a.density)
        imb.append(sp.stats.imbalance)
    return np.array(dens), np.array(imb)


def summarise(d, imb, steps, stream_name):
    after = d[20:]
    out_band = np.nonzero(np.abs(d - 1.0) > 0.1)[0]
    row = {"mean": float(after.mean()), "min": float(after.min()), "max": float(after.max()),
           "in_band_from": int(out_band[-1] + 1) if len(out_band) else 0,
           "steps_out_after_20": int(np.sum(np.abs(after - 1.0) > 0.1)),
           "imbalance_last": float(imb[max(steps - 100, steps // 2):].mean())}
    if stream_name == "scale":
        for at in (steps // 3, 2 * steps // 3):
            seg = d[at:at + steps // 3]
            bad = np.nonzero(np.abs(seg - 1.0) > 0.1)[0]
            row[f"recovery_{at}"] = int(bad[-1] + 1) if len(bad) else 0
    return row


def main():
    ap = parser(__doc__, numel=1 << 20, density=0.001, steps=400, seed=0, out="out/density", raw=True)
    ap.add_argument("--streams", default="stationary,scale,skewed")
    a = ap.parse_args()
    comm, rank, _ = world(a)
    results, curves = {}, {}
    t0 = time.perf_counter()
    for s in a.streams.split(","):
        for name, opts in CONFIGS:
            if name.endswith("faithful-balance") and s != "skewed":
                continue
            d, imb = run(name, opts, s, a, comm)
            results[f"{s}/{name}"] = summarise(d, imb, a.steps, s)
            curves[f"{s}/{name}"] = d.tolist()
    if rank:
        return
    print(f"ExDyna density bench: P={comm.Get_size()} numel={a.numel} density={a.density} steps={a.steps} "
          f"({time.perf_counter() - t0:.0f} s)")
    hdr = ("stream/controller", "mean", "min", "max", "in band from", "out after 20", "recovery",
           "imbalance")
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for key, r in results.items():
        rec = " / ".join(str(v) for k, v in r.items() if k.startswith("recovery")) or "-"
        print(f"| {key} | {r['mean']:.3f} | {r['min']:.3f} | {r['max']:.3f} | {r['in_band_from']} | "
              f"{r['steps_out_after_20']} | {rec} | {r['imbalance_last']:.3f} |")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "density_bench.json"), "w") as f:
        json.dump({"args": vars(a), "results": results, "curves": curves}, f)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    streams = a.streams.split(",")
    fig, axes = plt.subplots(len(streams), 1, figsize=(9, 3 * len(streams)), squeeze=False)
    for ax, s in zip(axes[:, 0], streams):
        for name, _ in CONFIGS:
            if f"{s}/{name}" not in curves:
                continue
            ax.semilogy(curves[f"{s}/{name}"], label=name, lw=0.8)
        ax.axhspan(0.9, 1.1, color="g", alpha=0.15)
        ax.set_title(s)
        ax.set_ylabel("density / target")
        ax.legend()
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "density_bench.png"), dpi=110)
    print("wrote", os.path.join(a.out, "density_bench.png"))


if __name__ == "__main__":
    main()
