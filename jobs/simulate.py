"""Simulate P ranks in one process: ExDyna, MiCRO and Top-k at scale, plus an alpha-beta cost model.

    python jobs/simulate.py --out out/simulate            # P = 8..4096, numel 2^22, 100 steps

Runs the ALGORITHM LAYER of the real sparsifiers — ``BlockLayout`` (rotation, the authors'
rebalancing and the per-block rule of the default controller), ``EqualLayout`` (MiCRO),
``make_controller`` (the threshold controllers; the default measured controller through its real
``plan``/``resolve`` path, histograms made by the host kernel, zooms included) and the top-k
threshold ``kth_largest_magnitude`` that ``TopK`` uses — on synthetic gradient streams, and
reports density error, imbalance and per-rank payload, plus a modelled step time: the exchange
(alpha-beta) plus the local compute measured here on this machine (one rank's per-element work
for its share, ``--numel`` elements, owned range numel/P). ExDyna's layout has
``max(1024, 16 P)`` blocks here (the default 1024 is too few from P = 128: see docs/controller.md).

Gradient model (vectorised mean field; every rank's accumulator is never stored):
- element i has a scale s_i (64 "layers", log-uniform 1e-3..1e-2, a hot region x4 at 10-20 %);
- the gradient of rank r at step t is ``s_i (0.5 z_t,i + e_r,t,i)``: a shared part z (what all
  batches agree on) and the rank's own part e, both standard normal;
- error feedback: since element i was last selected (m_i steps ago) every rank carried the same
  shared sum S_i and its own sum of m_i own parts, so rank r's accumulator is modelled as
  ``S_i + s_i sqrt(m_i) e'`` with a fresh e' (right in distribution, ignoring time correlation).
  Selected elements reset S and m on every rank (the union is zeroed everywhere).
ExDyna / MiCRO: each element is owned by one rank per step, so ONE draw of e' for the whole
vector is every owner's accumulator on its own partition: O(numel) per step for any P.
Top-k: every rank selects from the whole vector, so the union (gradient build-up) needs P draws;
it is simulated on a fixed random sample of ``--topk-sample`` elements with k scaled to it, for
``--topk-steps`` steps.

Cost model (alpha-beta; alpha = 2 us, beta = 8 / bandwidth; 4-byte values, int32 indices):
- count exchange (Allgather of 4 words; 1 word after the measured controller's sum):
  ceil(log2 P) alpha + (P-1) 32 beta (8 beta);
- the measured controller's words (Allreduce of 3 + 128 int32, and its zooms' words):
  2 ceil(log2 P) alpha + 2 (P-1)/P words 4 beta: constant in P;
- Allgatherv of counts c: recursive doubling below 512 KiB in total, ``ceil(log2 P) alpha +
  (sum c - c_min) 4 beta``; ring above, ``(P-1)(alpha + max c 4 beta)`` (each ring step waits for
  the largest block: where imbalance costs time);
- sum of U values (reduce-scatter + allgatherv): 2 ceil(log2 P) alpha + 2 (P-1)/P U 4 beta;
- dense allreduce: the same with U = numel; Ok-Topk: its paper's bound
  ``(2P + 2 log2 P) alpha + 6k (P-1)/P 4 beta`` (not simulated, for reference).
"""
import math
import os
import time

import numpy as np

from common import command, log, parser, write_json
from exdyna_mpi import ExDyna
# the algorithm layer is what this job measures at scale, on one process without MPI
from exdyna_mpi.algorithm import BlockLayout, EqualLayout, make_controller, partition_of, target_count
# the host ops the sparsifiers run (accumulate, histogram, select), driven here directly
from exdyna_mpi.arrays import HostOps
# the marks the measuring pass leaves for the select, as ExDyna's step keeps them
from exdyna_mpi.arrays.ops import Marks
# TopK's exact threshold, for the Top-k rows
from exdyna_mpi.sparsifiers.baselines.topk import kth_largest_magnitude

ALPHA = 2e-6
RD_LIMIT = 512 * 1024


def parse():
    ap = parser(__doc__, out="out/simulate", numel=1 << 22, steps=100, warmup=20, density=0.01, seed=0,
                threads=False)
    ap.add_argument("--ranks", default="8,32,128,512,1024,4096")
    ap.add_argument("--bandwidths", default="25,100,400", help="Gb/s")
    ap.add_argument("--topk-sample", type=int, default=1 << 15)
    ap.add_argument("--topk-steps", type=int, default=20)
    return ap.parse_args()


def scales(numel, seed):
    rng = np.random.default_rng([seed, 99])
    edges = np.sort(rng.choice(np.arange(1, numel), 63, replace=False))
    s = np.repeat(10.0 ** rng.uniform(-3, -2, 64), np.diff(np.concatenate(([0], edges, [numel]))))
    s[numel // 10: numel // 5] *= 4
    return s.astype(np.float32)


class Noise:
    """Standard normal vectors, cheaply: a pool of draws, rolled by a random offset each call."""

    def __init__(self, numel, seed, pool=6):
        self.rng = np.random.default_rng([seed, 7])
        self.pool = [self.rng.standard_normal(numel, dtype=np.float32) for _ in range(pool)]

    def __call__(self):
        v = self.pool[self.rng.integers(len(self.pool))]
        return np.roll(v, int(self.rng.integers(v.shape[0])))


def simulate_owned(kind, P, args, s, controller):
    """ExDyna (BlockLayout + rebalancing) or MiCRO (EqualLayout): per-step density, imbalance, max count."""
    n = args.numel
    # at scale, n_blocks grows with P (the default 1024 blocks are fewer than 8 per partition from P=128)
    layout = BlockLayout(n, P, n_blocks=max(1024, 16 * P)) if kind == "exdyna" else EqualLayout(n, P)
    ctl = make_controller(controller, n, args.density, P)
    k = target_count(args.density, n)
    measured = getattr(ctl, "name", "") == "measured"
    zero, buf = np.zeros(n, np.float32), np.empty(n, np.float32)
    shared, own = Noise(n, args.seed), Noise(n, args.seed + 1)
    S = np.zeros(n, np.float32)
    m = np.zeros(n, np.float32)
    rows = []
    ranks = np.arange(P)
    for t in range(args.steps):
        S += 0.5 * s * shared()
        m += 1
        acc = S + s * np.sqrt(m) * own()
        zoom_words = 0
        if measured:
            # the owners' ranges tile the vector, so the summed histograms are those of the whole
            # mean-field accumulator: the same host kernel and the same resolve as a real step
            plan = ctl.plan(t, np.float32)
            words = np.zeros(plan.n_words, np.int64)
            nb = plan.hist[0]
            fine = (plan.fine[1], plan.fine[2], words[nb:]) if plan.fine else None
            HostOps.accumulate_measure(zero, acc, buf, 0, n, (plan.hist[1], plan.hist[2], words[:nb]), fine,
                                       plan.stride)
            plan = ctl.resolve(plan, words, _WholeVector(buf))
            zoom_words = sum(plan.zoom_words)
        sel = np.flatnonzero(np.abs(acc) >= np.float32(plan.threshold if measured else ctl.threshold))
        b = layout.bounds()
        per_part = np.diff(np.searchsorted(sel, b))
        counts = per_part[[partition_of(r, t, P) for r in ranks]]
        S[sel] = 0
        m[sel] = 0
        total = int(counts.sum())
        rows.append((total / k, float(counts.max()) * P / total - 1 if total else 0.0, int(counts.max()),
                     int(counts.min()), total, zoom_words))
        if measured:
            ctl.update(counts, plan)
        else:
            ctl.update(counts)
        if kind == "exdyna":
            if measured:
                layout.rebalance_blocks(sel, t + 1)
            else:
                layout.rebalance_faithful(counts, t + 1)
    return rows


class _WholeVector:
    """The ``OwnedRange`` a controller's ``resolve`` zooms through, over the whole vector (the sum of
    every owner's histogram of its range) with no exchange."""

    def __init__(self, acc):
        self.acc = acc

    def histogram(self, window):
        h = np.zeros(window.buckets, np.int64)
        HostOps.hist_range(self.acc, 0, self.acc.shape[0], window.shift, window.key0, h)
        return h

    def sum(self, words):
        return np.asarray(words, np.int64)


def local_compute(P, args):
    """Seconds of one rank's per-element work, measured here (best of 5): ExDyna's measuring pass
    over ``numel`` with the owned range numel/P and the select from its marks; top-k's add + argpartition."""
    n = args.numel
    rng = np.random.default_rng(0)
    r, g = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
    acc, idx = np.empty(n, np.float32), np.empty(n // P + 1, np.int32)
    ctl = make_controller("measured", n, args.density, P)
    ctl.threshold, ctl.seen = 3.0, True
    plan = ctl.plan(1, np.float32)
    k = target_count(args.density, n)
    marks = Marks()   # where the pass keeps its marks for the select (as ExDyna's step does)

    def exdyna():
        w = np.zeros(plan.n_words, np.int64)
        nb = plan.hist[0]
        HostOps.accumulate_measure(r, g, acc, 0, n // P, (plan.hist[1], plan.hist[2], w[:nb]),
                                   (plan.fine[1], plan.fine[2], w[nb:]), plan.stride, ctl.mark(plan), 1, marks)
        HostOps.select_marked(acc, 0, n // P, np.float32(3.0), idx, marks=marks)

    def topk():
        a = r + g
        np.argpartition(np.abs(a), n - k)

    def floor():
        np.add(r, g, out=acc)

    out = {}
    for name, f in (("exdyna", exdyna), ("topk", topk), ("floor", floor)):
        f()
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        out[name] = float(np.min(ts))   # the least disturbed run: this machine is shared
    return out


def simulate_topk(P, args, s):
    """Top-k on a sample of the vector: union size over k (build-up) per step."""
    rng = np.random.default_rng([args.seed, 11])
    M = min(args.topk_sample, args.numel)
    ss = s[rng.choice(args.numel, M, replace=False)]
    ks = max(1, int(round(args.density * M)))
    S = np.zeros(M, np.float32)
    m = np.zeros(M, np.float32)
    rows = []
    chunk = max(1, (1 << 22) // M)
    for t in range(args.topk_steps):
        S += 0.5 * ss * rng.standard_normal(M, dtype=np.float32)
        m += 1
        sd = ss * np.sqrt(m)
        union = np.zeros(M, bool)
        for r0 in range(0, P, chunk):
            e = rng.standard_normal((min(chunk, P - r0), M), dtype=np.float32)
            acc = S + sd * e
            for a in acc:  # each rank's exact top-k threshold, TopK's own function
                union |= np.abs(a) >= kth_largest_magnitude(a, ks)
        S[union] = 0
        m[union] = 0
        rows.append(union.sum() / ks)
    return rows


def allgatherv_time(counts_bytes, P, beta):
    total = sum(counts_bytes)
    lg = math.ceil(math.log2(P))
    if total < RD_LIMIT:
        return lg * ALPHA + (total - min(counts_bytes)) * beta
    return (P - 1) * (ALPHA + max(counts_bytes) * beta)


def sum_time(nvals, P, beta):
    return 2 * math.ceil(math.log2(P)) * ALPHA + 2 * (P - 1) / P * nvals * 4 * beta


def agree_time(P, beta, words=4):
    return math.ceil(math.log2(P)) * ALPHA + (P - 1) * 8 * words * beta


def allreduce_time(nwords, P, beta):
    """An Allreduce of ``nwords`` int32 (Rabenseifner): the measured controller's summed words."""
    return 2 * math.ceil(math.log2(P)) * ALPHA + 2 * (P - 1) / P * nwords * 4 * beta


def costs(P, args, res, bw_gbps, local):
    """Modelled seconds per step for each method: exchange (from the simulated counts) + local compute."""
    beta = 8 / (bw_gbps * 1e9)
    n, k = args.numel, target_count(args.density, args.numel)
    out = {"dense": sum_time(n, P, beta) + local["floor"]}
    for label, r in res.items():
        if label.startswith(("exdyna", "micro")):
            mx, mn, tot = r["max_count"], r["min_count"], r["selected"]
            # the ring waits for the largest block; RD moves the total: approximate blocks by mean + max
            blocks = [mx * 4] + [max(0, (tot - mx) // max(1, P - 1)) * 4] * (P - 1)
            blocks[-1] = mn * 4
            if r.get("controller") == "measured":
                words = allreduce_time(3 + 128, P, beta) + allreduce_time(r["zoom_words"], P, beta) * (
                    r["zoom_words"] > 0) + agree_time(P, beta, 1)
                comp = local["exdyna"]
            else:
                words, comp = agree_time(P, beta), local["exdyna"]
            out[label] = words + allgatherv_time(blocks, P, beta) + sum_time(tot, P, beta) + comp
    tk = res["topk"]
    out["topk"] = (agree_time(P, beta) + allgatherv_time([k * 4] * P, P, beta)
                   + sum_time(tk["union_over_k"] * k, P, beta) + local["topk"])
    out["oktopk (paper bound)"] = ((2 * P + 2 * math.log2(P)) * ALPHA + 6 * k * (P - 1) / P * 4 * beta
                                   + local["topk"])
    return out


def main():
    args = parse()
    t_all = time.perf_counter()
    s = scales(args.numel, args.seed)
    default_ctl = ExDyna.OPTIONS["controller"].default
    variants = [("exdyna", "exdyna", default_ctl), ("micro[faithful]", "micro", "faithful")]
    if default_ctl != "faithful":
        variants.insert(1, ("exdyna[faithful]", "exdyna", "faithful"))
    bws = [float(b) for b in args.bandwidths.split(",")]
    results = []
    for P in [int(p) for p in args.ranks.split(",")]:
        t0 = time.perf_counter()
        res = {}
        for label, kind, ctl in variants:
            rows = np.array(simulate_owned(kind, P, args, s, ctl)[args.warmup:], dtype=np.float64)
            res[label] = dict(controller=ctl, zoom_words=float(rows[:, 5].mean()),
                              density_ratio=float(rows[:, 0].mean()),
                              density_error=float(np.abs(rows[:, 0] - 1).mean()),
                              imbalance=float(rows[:, 1].mean()), max_count=int(rows[:, 2].mean()),
                              min_count=int(rows[:, 3].mean()), selected=int(rows[:, 4].mean()),
                              payload_max_bytes=int(rows[:, 2].mean() * 4))
        tk = np.array(simulate_topk(P, args, s)[args.topk_steps // 4:])
        k = target_count(args.density, args.numel)
        res["topk"] = dict(density_ratio=float(tk.mean()), union_over_k=float(tk.mean()),
                           density_error=float(np.abs(tk - 1).mean()), imbalance=0.0, max_count=k,
                           payload_max_bytes=4 * k)
        local = local_compute(P, args)
        model = {f"{bw:g}": costs(P, args, res, bw, local) for bw in bws}
        results.append(dict(P=P, methods=res, model_seconds=model, local_seconds=local))
        log("simulate", f"P={P}: {time.perf_counter() - t0:.1f} s")
    meta = dict(numel=args.numel, steps=args.steps, warmup=args.warmup, density=args.density,
                topk_sample=args.topk_sample, topk_steps=args.topk_steps, alpha=ALPHA, bandwidths_gbps=bws,
                exdyna_default_controller=default_ctl, seconds=time.perf_counter() - t_all,
                command=command())
    write_json(os.path.join(args.out, "simulate.json"), dict(meta=meta, results=results))
    print(f"numel={args.numel} density={args.density} steps={args.steps} (mean over steps >= {args.warmup}); "
          f"alpha={ALPHA * 1e6:g} us; ExDyna default controller: {default_ctl}")
    print(render(results, [f"{b:g}" for b in bws]))
    print()
    print(render_beats(results, [f"{b:g}" for b in bws]))
    log("simulate", f"total {time.perf_counter() - t_all:.1f} s")


def render(results, bws):
    labels = list(results[0]["methods"])
    head = ["P", "method", "density/target", "imbalance", "max payload KiB"] + [f"ms @{b} Gb/s" for b in bws]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        for lab in ["dense"] + labels + ["oktopk (paper bound)"]:
            m = r["methods"].get(lab)
            cells = [str(r["P"]), lab]
            if m is None:
                cells += ["1" if lab == "dense" else "(1)", "", ""]
            else:
                cells += [f"{m['density_ratio']:.3f}", f"{m['imbalance']:.3f}", f"{m['payload_max_bytes'] / 1024:.1f}"]
            ms = [1e3 * r["model_seconds"][b][lab] for b in bws]
            best = [min(r["model_seconds"][b].values()) == r["model_seconds"][b][lab] for b in bws]
            cells += [f"**{x:.3f}**" if w else f"{x:.3f}" for x, w in zip(ms, best)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_beats(results, bws):
    """Per method and bandwidth: the ranks P at which it is faster than dense allreduce."""
    labels = [lab for lab in results[0]["model_seconds"][bws[0]] if lab != "dense"]
    lines = ["| method | " + " | ".join(f"beats dense @{b} Gb/s at P =" for b in bws) + " |",
             "|" + "---|" * (len(bws) + 1)]
    for lab in labels:
        cells = []
        for b in bws:
            ps = [str(r["P"]) for r in results if r["model_seconds"][b][lab] < r["model_seconds"][b]["dense"]]
            cells.append(", ".join(ps) if ps else "none")
        lines.append(f"| {lab} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
