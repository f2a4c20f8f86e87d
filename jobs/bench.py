"""Rank every sparsifier on the same gradient streams: density, imbalance, bytes and time per step.

    timeout 1200 mpiexec -n 4 python -m mpi4py jobs/bench.py --out out/bench

Each sparsifier the factory makes (plus ExDyna with ``controller="faithful"`` when that is not the
default) runs ``--steps`` steps on the same per-rank gradient stream, and the table shows, over the
steps after ``--warmup``:

- density / target: the achieved density over the target, mean and [min, max] over steps
  (for ``fft``: the reals each rank sends over numel; for ``dense``: 1 by definition);
- imbalance: ``max count x P / total - 1`` of what the ranks send in the variable-size exchange
  (0 = perfectly balanced; the padding an allgather without ``v`` would waste);
- bytes/dense: the bytes this rank moves per step (sent + received, the transport's ring model)
  over dense allreduce's, measured in the same run;
- sparsify and exchange time per step (median over steps of the slowest rank; phases from
  ``stats.seconds``: select/gather/scatter/decode vs counts/indices/reduce/p2p/allgatherv);
- err vs dense: ``||out - dense average|| / ||dense average||`` of this step (error feedback carries
  the rest to later steps, so this is the per-step compression error, not a loss in accuracy).

Gradients: synthetic by default: per element a layer scale (log-uniform 1e-3..1e-2 over 64 "layers"),
a shared Student-t(3) component (what every rank's batch agrees on) plus a per-rank Student-t(3)
component, and a hot region (elements 10-20 %, x4) where most of the large values sit: heavy tails
and a skewed distribution, the regime where partitions are imbalanced. ``--grads file.npy`` (shape
(steps, numel), e.g. recorded from a small model) uses rank r's row ``(t P + r) mod steps``.
``--accuracy-from metrics.json`` adds an accuracy column from a training run's metrics.
Writes ``OUT/bench.json`` and ``OUT/bench.png``.
"""
import json
import os
import time

import numpy as np
from mpi4py import MPI

import exdyna_mpi
from common import command, log, mpi_library, parser, world, write_json

SPARSIFY = ("select", "gather", "scatter", "decode")
EXCHANGE = ("counts", "indices", "reduce", "split_reduce", "allgatherv", "exchange")


def parse():
    ap = parser(__doc__, out="out/bench", numel=1 << 20, steps=60, warmup=10, density=0.01, seed=0, dtype="float32")
    ap.add_argument("--names", default="", help="comma-separated subset (default: all, + exdyna[faithful])")
    ap.add_argument("--grads", default=None, help=".npy of shape (steps, numel): recorded gradients")
    ap.add_argument("--accuracy-from", default=None, help="metrics JSON from jobs/train.py")
    return ap.parse_args()


class SyntheticStream:
    """Rank r's gradient at step t: layer scale x (shared t(3) + own t(3)), hot region x4."""

    def __init__(self, numel, rank, seed, dtype):
        rng = np.random.default_rng([seed, 99])
        layers = 64
        edges = np.sort(rng.choice(np.arange(1, numel), layers - 1, replace=False))
        scales = 10.0 ** rng.uniform(-3, -2, layers)
        self.scale = np.repeat(scales, np.diff(np.concatenate(([0], edges, [numel])))).astype(dtype)
        lo, hi = numel // 10, numel // 5
        self.scale[lo:hi] *= 4
        self.numel, self.rank, self.seed, self.dtype = numel, rank, seed, dtype

    def __call__(self, t):
        shared = np.random.default_rng([self.seed, t, 1 << 20]).standard_t(3, self.numel)
        own = np.random.default_rng([self.seed, t, self.rank]).standard_t(3, self.numel)
        g = (0.5 * shared + own).astype(self.dtype)
        g *= self.scale
        return g


class RecordedStream:
    def __init__(self, path, rank, nranks, dtype):
        self.grads = np.load(path, mmap_mode="r")
        self.rank, self.nranks, self.dtype = rank, nranks, dtype
        self.numel = self.grads.shape[1]

    def __call__(self, t):
        row = (t * self.nranks + self.rank) % self.grads.shape[0]
        return np.array(self.grads[row], dtype=self.dtype)


def variants(names_arg):
    names = exdyna_mpi.available()
    runs = [(n, n, {}) for n in names]
    probe = exdyna_mpi.ExDyna.OPTIONS["controller"].default
    if probe != "faithful":
        runs.insert(names.index("exdyna") + 1, ("exdyna[faithful]", "exdyna", {"controller": "faithful"}))
    if names_arg:
        want = names_arg.split(",")
        runs = [r for r in runs if r[0] in want]
    # dense first: the others' bytes are quoted relative to it
    runs.sort(key=lambda r: r[0] != "dense")
    return runs


def run_one(label, name, opts, args, stream, comm):
    P = comm.Get_size()
    sp = exdyna_mpi.make(name, stream.numel, args.density, comm, **opts)
    rows = []
    avg = np.empty(stream.numel, dtype=np.float64)
    for t in range(args.steps):
        g = stream(t)
        dense = g.astype(np.float64)
        comm.Allreduce(MPI.IN_PLACE, dense, op=MPI.SUM)
        dense /= P
        comm.Barrier()
        out = sp.step(g)
        st = sp.stats
        sec = st.seconds
        np.subtract(out, dense, out=avg)
        dn = float(np.linalg.norm(dense))
        counts = np.asarray(st.counts, dtype=np.int64)
        imb = st.imbalance if getattr(st, "imbalance", None) is not None else (
            float(counts.max()) * P / counts.sum() - 1 if counts.sum() else 0.0)
        local = [sum(sec.get(k, 0.0) for k in SPARSIFY), sum(sec.get(k, 0.0) for k in EXCHANGE),
                 sec.get("total", 0.0), (st.bytes_sent + st.bytes_received) / 2]
        slowest = np.array(local[:3])
        comm.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
        rows.append(dict(step=t, density=float(st.density), imbalance=float(imb),
                         sparsify_s=float(slowest[0]), exchange_s=float(slowest[1]), total_s=float(slowest[2]),
                         bytes=float(comm.allreduce(local[3], op=MPI.SUM) / P),
                         err=float(np.linalg.norm(avg) / dn) if dn > 0 else 0.0))
    return rows


def summarise(label, rows, args, dense_bytes, accuracy):
    post = rows[args.warmup:] or rows
    dens = np.array([r["density"] for r in post]) / args.density
    if label == "dense":
        dens = np.ones_like(dens)
    s = dict(name=label,
             density_ratio_mean=float(dens.mean()), density_ratio_min=float(dens.min()),
             density_ratio_max=float(dens.max()),
             imbalance_mean=float(np.mean([r["imbalance"] for r in post])),
             bytes_per_step=float(np.mean([r["bytes"] for r in post])),
             sparsify_ms=1e3 * float(np.median([r["sparsify_s"] for r in post])),
             exchange_ms=1e3 * float(np.median([r["exchange_s"] for r in post])),
             total_ms=1e3 * float(np.median([r["total_s"] for r in post])),
             err_vs_dense=float(np.mean([r["err"] for r in post])))
    s["bytes_vs_dense"] = s["bytes_per_step"] / dense_bytes if dense_bytes else float("nan")
    if accuracy is not None:
        s["accuracy"] = accuracy.get(label, accuracy.get(label.split("[")[0]))
    return s


def load_accuracy(path):
    """{name: accuracy} from a metrics JSON: {name: acc}, {name: {...accuracy...}} or a list of runs."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict) and "runs" in data:
        data = data["runs"]
    items = data.items() if isinstance(data, dict) else [
        (d.get("sparsifier", d.get("name")), d) for d in data]
    acc = {}
    for name, v in items:
        if isinstance(v, dict):
            v = next((v[k] for k in ("accuracy", "test_accuracy", "final_accuracy", "acc") if k in v), None)
        if isinstance(v, (int, float)):
            acc[name] = float(v)
    return acc


def table(summary, with_acc):
    head = ("sparsifier", "density/target mean [min, max]", "imbalance", "bytes/dense", "sparsify ms",
            "exchange ms", "step ms", "err vs dense") + (("accuracy",) if with_acc else ())
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summary:
        cells = [s["name"],
                 f"{s['density_ratio_mean']:.3f} [{s['density_ratio_min']:.3f}, {s['density_ratio_max']:.3f}]",
                 f"{s['imbalance_mean']:.3f}", f"{s['bytes_vs_dense']:.4f}", f"{s['sparsify_ms']:.2f}",
                 f"{s['exchange_ms']:.2f}", f"{s['total_ms']:.2f}", f"{s['err_vs_dense']:.3f}"]
        if with_acc:
            a = s.get("accuracy")
            cells.append("" if a is None else f"{a:.4f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(path, results, summary, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    for label, rows in results.items():
        if label == "dense":
            continue
        a.plot([r["step"] for r in rows], [r["density"] / args.density for r in rows], label=label)
    a.axhline(1.0, color="k", lw=0.8, ls=":")
    a.set_yscale("log")
    a.set_xlabel("step")
    a.set_ylabel("achieved density / target")
    a.legend(fontsize=7, ncol=2)
    names = [s["name"] for s in summary]
    x = np.arange(len(names))
    b.bar(x - 0.2, [s["bytes_vs_dense"] for s in summary], 0.4, label="bytes / dense")
    b2 = b.twinx()
    b2.bar(x + 0.2, [s["total_ms"] for s in summary], 0.4, color="tab:orange", label="step ms")
    b.set_yscale("log")
    b.set_xticks(x, names, rotation=45, ha="right", fontsize=8)
    b.set_ylabel("bytes per step / dense (log)")
    b2.set_ylabel("step time, ms (median, slowest rank)")
    b.legend(loc="upper left", fontsize=8)
    b2.legend(loc="upper right", fontsize=8)
    fig.suptitle(f"P={args.nranks}, numel={args.numel_used}, density={args.density}, {args.source}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    args = parse()
    comm, rank, P = world(args)
    dtype = np.dtype(args.dtype)
    if args.grads:
        stream = RecordedStream(args.grads, rank, P, dtype)
        args.source = f"recorded {os.path.basename(args.grads)}"
    else:
        stream = SyntheticStream(args.numel, rank, args.seed, dtype)
        args.source = "synthetic t(3), layer scales 1e-3..1e-2, hot region"
    args.nranks, args.numel_used = P, stream.numel
    accuracy = load_accuracy(args.accuracy_from) if args.accuracy_from else None
    results, summary = {}, []
    dense_bytes = None
    t_all = time.perf_counter()
    for label, name, opts in variants(args.names):
        t0 = time.perf_counter()
        rows = run_one(label, name, opts, args, stream, comm)
        results[label] = rows
        if label == "dense":
            dense_bytes = float(np.mean([r["bytes"] for r in rows[args.warmup:] or rows]))
        if dense_bytes is None:  # dense not run: quote against the ring-allreduce model
            dense_bytes = 2 * (P - 1) / P * stream.numel * dtype.itemsize
        summary.append(summarise(label, rows, args, dense_bytes, accuracy))
        if rank == 0:
            log("bench", f"{label}: {time.perf_counter() - t0:.1f} s")
    if rank == 0:
        meta = dict(nranks=P, numel=stream.numel, steps=args.steps, warmup=args.warmup,
                    density=args.density, dtype=args.dtype, source=args.source, command=command(),
                    mpi=mpi_library(), seconds=time.perf_counter() - t_all)
        write_json(os.path.join(args.out, "bench.json"), dict(meta=meta, summary=summary, steps=results))
        print(f"P={P} numel={stream.numel} steps={args.steps} (summary over steps >= {args.warmup}) "
              f"density={args.density} dtype={args.dtype} source: {args.source}")
        print(table(summary, accuracy is not None))
        try:
            plot(os.path.join(args.out, "bench.png"), results, summary, args)
        except ImportError as e:
            log("bench", f"no PNG: {e}")
    comm.Barrier()


if __name__ == "__main__":
    main()
