#!/usr/bin/env python
"""The bits every sparsifier gives on the recorded gradient streams: one sha256 per (stream, setting).

A refactor that must not change behaviour runs this before and after and compares the lines::

    mpiexec -n 4 python -m mpi4py jobs/bit_hashes.py --out results/bit_hashes/P4.jsonl
    mpiexec -n 2 python -m mpi4py jobs/bit_hashes.py --streams skewed,ar0.9 \
        --out results/bit_hashes/synthetic_P2.jsonl   # synthetic streams: the same bits on any machine
    NUMBA_ENABLE_CUDASIM=1 python jobs/bit_hashes.py --device cuda --streams cnn16 --steps 3 \
        --sparsifiers exdyna,micro          # the CUDA kernels, simulated
    python jobs/bit_hashes.py --compare cpu.jsonl cuda.jsonl cuda_again.jsonl   # exit 1 on a difference

On a real GPU ``--device cuda`` feeds each step a CuPy copy of the recorded gradient; the lane
``hashes`` of ``jobs/gpu_lane.sh`` runs the CPU once and the GPU twice and compares them.

Each setting steps a fresh sparsifier through ``--steps`` steps of a stream (jobs/streams.py): a
recorded one (recorded on first use, deterministically, with torch's CPU kernels, whose bits depend
on the CPU: compare recorded-stream hashes only between runs on one machine) or a synthetic one
(``--numel`` elements, NumPy's generator: the same bits on every machine). The hash covers every
step's output and the final residual on every rank, in rank order, so any difference anywhere
changes it.
"""
import argparse
import hashlib
import json
import os

import numpy as np
from mpi4py import MPI

import exdyna_mpi
import streams  # jobs/streams.py, beside this script

SETTINGS = [(name, {}) for name in exdyna_mpi.available()] + [
    ("exdyna", {"balance": "faithful"}),
    ("exdyna", {"max_imbalance": 0.05}),
    ("exdyna", {"controller": "faithful"}),
    ("exdyna", {"deadline_ms": 1000.0}),
]


def run(stream, name, options, density, steps, comm, device, numel=0):
    rank, size = comm.Get_rank(), comm.Get_size()
    src = streams.open_stream(stream, numel, rank, size)
    sp = exdyna_mpi.make(name, src.numel, density, comm, device=device, **options)
    h = hashlib.sha256()
    for _ in range(steps):
        h.update(np.ascontiguousarray(sp.ops.to_host(sp.step(sp.ops.from_host(src.next())))).tobytes())
    residual = getattr(sp, "residual", None)      # dense keeps none
    if residual is not None:
        h.update(np.ascontiguousarray(residual).tobytes())   # a host copy on every device
    digests = comm.gather(h.hexdigest(), root=0)
    return hashlib.sha256("".join(digests).encode()).hexdigest() if rank == 0 else None


def compare(paths):
    """Every (stream, ranks, sparsifier, options, density, steps, numel) found in more than one of the files
    ``paths``, with its hash in each; returns the lines that differ (printed), one per setting."""
    seen = {}
    for i, path in enumerate(paths):
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    key = json.dumps({k: r.get(k) for k in ("stream", "ranks", "sparsifier", "options", "density",
                                                            "steps", "numel")}, sort_keys=True)
                    seen.setdefault(key, {})[i] = r["sha256"][:16]
    bad = []
    for key, by_file in sorted(seen.items()):
        if len(by_file) > 1 and len(set(by_file.values())) > 1:
            bad.append(f"DIFFERS {key}: " + ", ".join(f"{paths[i]} {h}" for i, h in sorted(by_file.items())))
    compared = sum(len(v) > 1 for v in seen.values())
    for line in bad:
        print(line)
    print(f"{compared} settings compared across {len(paths)} files, {len(bad)} differ")
    return bad


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="cnn16,mlp")
    ap.add_argument("--numel", type=int, default=200_000,
                    help="length of the synthetic streams (recorded ones have their own)")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (a GPU, or the simulator)")
    ap.add_argument("--sparsifiers", default=None, help="comma-separated names (default: every setting)")
    ap.add_argument("--out", default=None, help="JSON lines (rank 0); stdout too")
    ap.add_argument("--compare", nargs="+", metavar="JSONL", default=None,
                    help="compare earlier --out files setting by setting (no run); exit 1 on a difference")
    args = ap.parse_args(argv)
    if args.compare:
        raise SystemExit(1 if compare(args.compare) else 0)
    comm = MPI.COMM_WORLD
    lines = []
    for stream in args.streams.split(","):
        if comm.Get_rank() == 0:
            streams.ensure(stream, comm.Get_size())
        comm.Barrier()
        for name, options in SETTINGS:
            if args.sparsifiers and name not in args.sparsifiers.split(","):
                continue
            digest = run(stream, name, options, args.density, args.steps, comm, args.device, args.numel)
            if comm.Get_rank() == 0:
                rec = {"stream": stream, "ranks": comm.Get_size(), "device": args.device,
                       "sparsifier": name, "options": options,
                       "density": args.density, "steps": args.steps, "sha256": digest}
                if stream not in streams.RECORDED:
                    rec["numel"] = args.numel
                lines.append(json.dumps(rec, sort_keys=True))
                print(lines[-1], flush=True)
    if args.out and comm.Get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
