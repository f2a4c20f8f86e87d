"""Record sha256 fingerprints of every sparsifier's behaviour, for before/after equivalence checks.

For every name in ``exdyna_mpi.available()`` (and ExDyna/MiCRO option variants) this runs a few
steps on fixed seeded inputs (an i.i.d. stream and a correlated one with a scale change), and writes
one line per fingerprint: the output of every step, the step's stats (every field except timings),
the final ``state_dict()`` field by field, a state round trip (resume from step 7's state, replay the
rest) and the text of refused steps (bad input). One file per rank.

    mpiexec -n P python -m mpi4py tests/equivalence/record.py OUTDIR
    diff -r BEFORE AFTER        # identical files: identical behaviour on these inputs

Not a test (it asserts nothing by itself); refactorings diff its output before and after.
"""
import copy
import hashlib
import os
import pickle
import sys

import numpy as np
from mpi4py import MPI

import exdyna_mpi

NUMEL, DENSITY, STEPS, RESUME_AT = 6007, 0.02, 15, 7


def configs():
    out = []
    for name in exdyna_mpi.available():
        out.append((name, name, {}))
    for ctl in ("faithful", "symmetric"):
        for bal in (True, False, "faithful", "adaptive"):
            out.append((f"exdyna-{ctl}-{bal}", "exdyna", {"controller": ctl, "balance": bal}))
    out.append(("exdyna-small-blocks", "exdyna", {"n_blocks": 64, "block_align": 8}))
    out.append(("oktopk-periods", "oktopk", {"local_period": 3, "global_period": 4, "region_period": 5,
                                             "warmup": 2}))
    out.append(("fft-16", "fft", {"bits": 16, "block": 256}))
    out.append(("fft-32", "fft", {"bits": 32, "block": 512}))
    out.append(("dgc-sample", "dgc", {"sample_ratio": 0.1}))
    out.append(("threshold-fixed", "threshold", {"threshold": 0.05}))
    return out


def grads(stream, rank, dtype):
    """The gradient sequence of one rank: ``iid`` or ``corr`` (AR(1) around a shared signal)."""
    rng = np.random.default_rng(1000 + 17 * rank + (0 if stream == "iid" else 7))
    base = np.random.default_rng(42).standard_normal(NUMEL)
    g = base.copy()
    seq = []
    for t in range(STEPS):
        if stream == "iid":
            x = rng.standard_normal(NUMEL) * (1.0 + 0.1 * t)
        else:
            g = 0.9 * g + 0.3 * rng.standard_normal(NUMEL)
            scale = 10.0 if t >= 9 else 1.0      # a 10x change of scale mid-run
            x = g * scale * (1.0 + np.abs(base)) ** 2
        seq.append((x * 1e-2).astype(dtype))
    return seq


def h(*parts):
    s = hashlib.sha256()
    for p in parts:
        if isinstance(p, np.ndarray):
            s.update(str(p.dtype).encode() + str(p.shape).encode())
            s.update(np.ascontiguousarray(p).tobytes())
        else:
            s.update(repr(p).encode())
    return s.hexdigest()


def stats_fields(st):
    d = st.as_dict()
    d.pop("seconds", None)
    if d.get("imbalance") is None:   # skipped steps had no imbalance field before the restructuring
        d.pop("imbalance", None)
    return {k: d[k] for k in sorted(d)}


def state_fields(sd):
    out = {}
    for k in sorted(sd):
        v = sd[k]
        if isinstance(v, dict):
            for k2 in sorted(v):
                out[f"{k}.{k2}"] = h(v[k2]) if isinstance(v[k2], np.ndarray) else h(repr(v[k2]))
        else:
            out[k] = h(v) if isinstance(v, np.ndarray) else h(repr(v))
    return out


def run(tag, name, opts, stream, dtype, comm, lines):
    rank = comm.Get_rank()
    seq = grads(stream, rank, dtype)
    sp = exdyna_mpi.make(name, NUMEL, DENSITY, comm, **opts)
    outs, saved = [], None
    key = f"{tag}|{stream}|{np.dtype(dtype).name}"
    for t, g in enumerate(seq):
        if t == RESUME_AT:
            saved = pickle.loads(pickle.dumps(sp.state_dict()))
        out = sp.step(g.copy())
        outs.append(h(out))
        lines.append(f"{key}|step{t}|out {outs[-1]}")
        for k, v in stats_fields(sp.stats).items():
            lines.append(f"{key}|step{t}|stats.{k} {h(v)}")
    for k, v in state_fields(sp.state_dict()).items():
        lines.append(f"{key}|final|state.{k} {v}")
    sp2 = exdyna_mpi.make(name, NUMEL, DENSITY, comm, **opts)
    sp2.load_state_dict(copy.deepcopy(saved))
    replay = [h(sp2.step(g.copy())) for g in seq[RESUME_AT:]]
    lines.append(f"{key}|resume {replay == outs[RESUME_AT:]}")
    lines.append(f"{key}|resume_state {state_fields(sp2.state_dict()) == state_fields(sp.state_dict())}")


def refusals(comm, lines):
    """Bad input: the error text of refused steps, a skipped step, and state untouched."""
    rank, P = comm.Get_rank(), comm.Get_size()
    for name in exdyna_mpi.available():
        sp = exdyna_mpi.make(name, NUMEL, DENSITY, comm, nonfinite="skip")
        g = grads("iid", rank, np.float32)
        sp.step(g[0])
        bad = g[1].copy()
        if rank == P - 1:
            bad[3] = np.nan
        out = sp.step(bad)
        lines.append(f"refuse|{name}|skip out {h(out)} stats {h(sorted(stats_fields(sp.stats).items()))}")
        for what, x in (("length", g[2][:-1] if rank == 0 else g[2]),
                        ("dtype", g[2].astype(np.float64) if rank == P - 1 else g[2]),
                        ("ndim", g[2].reshape(1, -1) if rank == 0 else g[2])):
            try:
                sp.step(x)
                msg = "no error"
            except Exception as e:   # noqa: BLE001 - the text is what we record
                msg = f"{type(e).__name__}: {e}"
            lines.append(f"refuse|{name}|{what} {h(msg)}")
        lines.append(f"refuse|{name}|state {h(sorted(state_fields(sp.state_dict()).items()))}")
        out = sp.step(g[3])
        lines.append(f"refuse|{name}|after {h(out)}")
    for bad_opts in ({"nope": 1}, {"density": 2.0}):
        try:
            d = bad_opts.pop("density", DENSITY)
            exdyna_mpi.make("exdyna", NUMEL, d, comm, **bad_opts)
            msg = "no error"
        except Exception as e:   # noqa: BLE001
            msg = f"{type(e).__name__}: {e}"
        lines.append(f"refuse|construct|{sorted(bad_opts)} {h(msg)}")


def main():
    outdir = sys.argv[1]
    comm = MPI.COMM_WORLD
    rank, P = comm.Get_rank(), comm.Get_size()
    only = sys.argv[2] if len(sys.argv) > 2 else None
    lines = []
    for tag, name, opts in configs():
        if only and only not in tag:
            continue
        for stream in ("iid", "corr"):
            run(tag, name, opts, stream, np.float32, comm, lines)
        if tag in ("exdyna", "micro", "topk", "dense", "oktopk"):
            run(tag, name, opts, "corr", np.float64, comm, lines)
    if not only:
        refusals(comm, lines)
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, f"P{P}.rank{rank}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
