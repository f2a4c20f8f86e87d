#!/usr/bin/env python
"""Gradient streams for the density benchmark and the controller tests: synthetic and recorded.

A stream gives, for rank ``r`` of ``P`` and step ``t``, the gradient that rank would pass to
``sp.step``. The same (name, numel, P, seed) gives the same bits on every machine.

Synthetic (any ``numel``, any P):

    iid          a fresh Gaussian every step (the easy case the old figures came from)
    ar0.5 ar0.9 ar0.99 ar0
                 g_t = rho g_{t-1} + sqrt(1 - rho^2) noise: correlated from step to step
    constant     the same gradient every step
    rotate3      three gradients in rotation
    heavy        Student-t with 2 degrees of freedom (heavy tails), i.i.d. over steps
    skewed       32 "layers" whose scales span 1000x (log-uniform), AR(0.9) inside
    scale10      i.i.d., 10x smaller from step 60, back up from step 90

Every synthetic stream mixes a part shared by all ranks (the true gradient) with a part of each
rank's own (its minibatch noise), ``SHARED`` of the variance shared, as data-parallel gradients do.

Recorded (from real training with the project's models, dense data-parallel SGD simulated in one
process, every rank's gradient kept): ``cnn16``, ``cnn48``, ``mlp``, and ``lstm`` (the fidelity
benchmark's byte-level LSTM on the standard library's source: 2.04M parameters, its embedding rows
touched only by the bytes in the batch, so the gradient is sparse by row). Recordings live under
``out/streams/`` (not in git) and are made on first use, deterministically::

    python jobs/streams.py record cnn48 --ranks 8 --steps 200   # out/streams/cnn48.npy
    python jobs/streams.py list
"""
import argparse
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STREAM_DIR = os.environ.get("EXDYNA_STREAMS", os.path.join(ROOT, "out", "streams"))
SHARED = 0.5

SYNTHETIC = ("iid", "ar0", "ar0.5", "ar0.9", "ar0.99", "constant", "rotate3", "heavy", "skewed", "scale10")
# name -> (model, width, batch per rank, lr, default steps, default ranks recorded)
RECORDED = {
    "cnn16": ("cnn", 16, 32, 0.1, 200, 8),
    "cnn48": ("cnn", 48, 32, 0.1, 150, 8),
    "mlp": ("big", 1, 64, 0.05, 100, 8),
    "lstm": ("lstm", 0, 16, 1.0, 60, 8),   # 3.9 GB at 8 ranks x 60 steps
}


class Synthetic:
    """One rank's view of a synthetic stream; ``next()`` gives step 0, 1, 2, ... in order."""

    def __init__(self, name, numel, rank, nranks, seed=0):
        if name not in SYNTHETIC:
            raise ValueError(f"unknown synthetic stream {name!r}; one of {SYNTHETIC}")
        self.name, self.numel, self.rank, self.nranks = name, numel, rank, nranks
        self.t = 0
        self._shared = np.random.default_rng([seed, 7, 0])           # same on every rank
        self._own = np.random.default_rng([seed, 7, 1 + rank])       # this rank's
        self._prev = None
        self._fixed = None
        self._scales = None
        if name == "skewed":
            layer = np.sort(np.random.default_rng([seed, 8]).integers(0, 32, numel))
            scale = np.exp(np.random.default_rng([seed, 9]).uniform(0, math.log(1000.0), 32))
            self._scales = scale[layer].astype(np.float32)

    def _noise(self, kind="normal"):
        """sqrt(SHARED) * common + sqrt(1 - SHARED) * own, one draw of each."""
        def draw(rng):
            if kind == "t":
                return rng.standard_t(2, self.numel).astype(np.float32)
            return rng.standard_normal(self.numel, dtype=np.float32)
        return (np.float32(math.sqrt(SHARED)) * draw(self._shared)
                + np.float32(math.sqrt(1 - SHARED)) * draw(self._own))

    def next(self):
        n, t = self.name, self.t
        self.t += 1
        if n in ("iid", "ar0"):
            g = self._noise()
        elif n.startswith("ar") or n == "skewed":
            rho = 0.9 if n == "skewed" else float(n[2:])
            z = self._noise()
            g = z if self._prev is None else np.float32(rho) * self._prev + np.float32(math.sqrt(1 - rho * rho)) * z
            self._prev = g
            if n == "skewed":
                g = g * self._scales
        elif n == "constant":
            if self._fixed is None:
                self._fixed = [self._noise()]
            g = self._fixed[0]
        elif n == "rotate3":
            if self._fixed is None:
                self._fixed = [self._noise() for _ in range(3)]
            g = self._fixed[t % 3]
        elif n == "heavy":
            g = self._noise("t")
        elif n == "scale10":
            g = self._noise() * np.float32(0.1 if 60 <= t < 90 else 1.0)
        return np.ascontiguousarray(g, dtype=np.float32)


class Recorded:
    """One rank's view of a recorded stream (a memory-mapped (P, steps, numel) float32 file)."""

    def __init__(self, name, rank, nranks, path=None):
        path = path or recording_path(name)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no recording {path}: run `python jobs/streams.py record {name}`")
        self.data = np.load(path, mmap_mode="r")
        rec_p, self.steps, self.numel = self.data.shape
        if nranks > rec_p:
            raise ValueError(f"{path} holds {rec_p} ranks' gradients; {nranks} ranks asked for")
        self.name, self.rank, self.t = name, rank, 0
        # P < recorded ranks: rank r replays recorded rank r (a P-rank job with the same step sizes)

    def next(self):
        if self.t >= self.steps:
            raise IndexError(f"{self.name}: only {self.steps} steps recorded")
        g = np.array(self.data[self.rank, self.t], dtype=np.float32)
        self.t += 1
        return g


def recording_path(name):
    return os.path.join(STREAM_DIR, f"{name}.npy")


def open_stream(name, numel, rank, nranks, seed=0):
    """The stream ``name`` for this rank (``numel`` is ignored for recorded streams: theirs is fixed)."""
    if name in RECORDED:
        return Recorded(name, rank, nranks)
    return Synthetic(name, numel, rank, nranks, seed)


def record(name, ranks=None, steps=None, seed=0, out=None, quiet=False):
    """Train the stream's model with dense data-parallel SGD over ``ranks`` simulated ranks and keep
    every rank's gradient at every step. Deterministic: torch's CPU kernels, one thread."""
    import models   # jobs/models.py, beside this module (see jobs/common.py: how jobs import each other)
    import torch

    model_name, width, batch, lr, d_steps, d_ranks = RECORDED[name]
    ranks, steps = ranks or d_ranks, steps or d_steps
    torch.set_num_threads(1)
    if model_name == "lstm":   # fidelity.py's LSTM workload: seq 64, SGD lr 1.0, momentum 0.9, clip 0.25
        torch.manual_seed(seed)
        model, clip = models.CharLSTM(), 0.25
        text = models.TextData(*models.stdlib_corpus(), seq=64)

        def minibatches(r):
            for t in range(steps):
                yield text.batch(t, batch, seed, r)

        def loss(out, y):
            return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        iters = [minibatches(r) for r in range(ranks)]
        per_epoch = steps
    else:
        model, _ = models.build(model_name, width, seed, 0, ranks)
        shards = [models.build(model_name, width, seed, r, ranks)[1] for r in range(ranks)]
        clip, loss = None, torch.nn.functional.cross_entropy
        per_epoch = max(1, min(s.x_train.shape[0] for s in shards) // batch)
        iters = [None] * ranks
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=0.0 if clip else 1e-4)
    path = out or recording_path(name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp.npy"
    data = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(ranks, steps, numel))
    for t in range(steps):
        epoch, s = divmod(t, per_epoch)
        total = [torch.zeros_like(p) for p in params]
        for r in range(ranks):
            if s == 0 and model_name != "lstm":
                iters[r] = shards[r].batches(epoch, batch, per_epoch, seed, r)
            x, y = next(iters[r])
            model.zero_grad()
            loss(model(x), y).backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            data[r, t] = flat.numpy()
            for acc, p in zip(total, params):
                acc += p.grad
        for acc, p in zip(total, params):
            p.grad = acc / ranks
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        if not quiet and (t % 20 == 0 or t == steps - 1):
            print(f"[record {name}] step {t + 1}/{steps}", file=sys.stderr, flush=True)
    data.flush()
    del data
    os.replace(tmp, path)
    return path


def ensure(name, nranks=None):
    """Make the recording of ``name`` if it is missing (same bits every time)."""
    if name in RECORDED and not os.path.exists(recording_path(name)):
        record(name, ranks=max(nranks or 0, RECORDED[name][5]))
    return name


def main(argv=None):
    ap = argparse.ArgumentParser(description="record or list gradient streams")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("names", nargs="+", choices=sorted(RECORDED))
    r.add_argument("--ranks", type=int, default=None)
    r.add_argument("--steps", type=int, default=None)
    r.add_argument("--seed", type=int, default=0)
    sub.add_parser("list")
    a = ap.parse_args(argv)
    if a.cmd == "list":
        for n in SYNTHETIC:
            print(f"{n:10s} synthetic")
        for n in RECORDED:
            p = recording_path(n)
            have = f"{os.path.getsize(p) / 1e6:.0f} MB at {p}" if os.path.exists(p) else "not recorded yet"
            print(f"{n:10s} recorded ({have})")
        return 0
    for n in a.names:
        print(record(n, a.ranks, a.steps, a.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
