#!/usr/bin/env python
"""Time to accuracy across communication methods, each at its own tuned learning rate, on one model.

    bash jobs/run_e2e.sh --no-testbed --tune-lrs 1e-3,2e-3,4e-3 --seed 100 --out out/tune   # the search
    bash jobs/run_e2e.sh --rate 1000 --tuned out/tune/tuned.json --seed 1 --out out/e2e      # a held-out seed
    srun python -m mpi4py jobs/e2e.py --tuned tuned.json --seed 1          # a cluster's real network
    python jobs/e2e.py --report out/e2e --docs docs/e2e.md --readme README.md   # tables, plots, pages
    python jobs/e2e.py --choose-lrs out/tune out/tune_8e-3 --methods M --out out/tuned  # a widened grid

The protocol (docs/e2e.md): every method is searched over the same learning-rate grid on tuning seeds
(``--tune-lrs``: each method at each rate for ``--steps``, the lowest validation loss at the budget,
mean over the file's tuning seeds, goes to ``DIR/tuned.json``); timed runs take those rates
(``--tuned``, which refuses a method it has no rate for) on other seeds. A grid widened at its edge in
a later launch is chosen from both launches' records by ``--choose-lrs``. Every method trains with the
same optimiser (``--optimizer``), clipping (``--clip``: ``clip_grad_norm_`` over the model's
parameters before every optimiser step, as a user's loop does it) and schedule (``--lr-warmup``
batches of linear warm-up, then ``--schedule`` constant or cosine to a tenth at ``--steps``).
A method that trades batches for bytes (local steps) may get a longer budget of its own
(``--steps-of sloco-h16=2400``: its schedule ends there), tuned at that budget; the target stays
DDP's loss at ``--steps``.

Workloads (offline, no downloads):
- ``lm`` (default): a GPT-style byte-level transformer (jobs/models.py ``GPT``, default d_model 128,
  4 layers, 2 heads, context 64: 834,304 parameters) on the Python standard library's source, split
  by file into train and validation (``models.stdlib_corpus``), AdamW (betas 0.9, 0.95, weight decay
  0.1), clipping at 1.0, cosine, 600 batches of 8 sequences per rank; the metric is the validation
  loss (nats per byte) on ``--val-windows`` 512 held-out windows (32,768 predictions). The setup
  record carries count-based unigram, bigram and interpolated trigram losses on the same predictions
  (jobs/ngram.py): a target above the trigram's measures the warm-up, not training.
- ``cnn``: the digits CNN at width 48 (141k parameters), SGD with momentum 0.9, no clipping, 264
  batches of 32 per rank (24 epochs at P=4: at 8, DDP's test loss still falls by half and every
  sparsifier is still in its transient); the metric is the test cross-entropy (accuracy beside).

Methods (``--methods``, run one after another in one launch, ``ddp`` first and, unless
``--no-ddp-last``, again last so that drift within the launch shows):
- ``ddp``: torch ``DistributedDataParallel`` over gloo, default buckets (25 MB, the first 1 MB),
  its allreduce overlapped with backward; ``ddp-bv``: the same with ``gradient_as_bucket_view=True``
  (the same arithmetic, one copy fewer); ``ddp-accum``: gradient accumulation, ``--accum`` batches per
  optimiser step under ``no_sync`` but the last (the budget counts batches, so it sees the same data).
- ``ddp-powersgd``: DDP with torch's ``powerSGD_hook``, rank 4, error feedback and warm start (the
  defaults), ``start_powerSGD_iter`` = a tenth of the steps (torch's advice: vanilla allreduce for
  the first part of training), and ONE bucket (``bucket_cap_mb`` above the model's size). On gloo
  the hook issues its second allreduce (of Q) from the completion callback of the first (of P);
  with several buckets those callbacks race the next buckets' hooks, the ranks issue gloo
  collectives in different orders, and gloo aborts ("Received data size doesn't match expected
  size") or hangs (0.5 MB buckets on 3 ranks).
- ``ddp-bf16``: DDP with torch's ``bf16_compress_hook`` (values cast to bfloat16 for the allreduce).
- ``diloco-h4``, ``-h8``, ``-h16``, ``-h64``: DiLoCo as torchft runs it: H local steps of the run's optimiser
  (no communication), then the pseudo-gradient (global minus local parameters) averaged in one dense
  float32 allreduce and applied to the global parameters by Nesterov SGD (lr 0.7, momentum 0.9);
  the global parameters are what is evaluated. ``diloco-exdyna-h16``/``-h64`` (``-bf16-h16``: 16-bit
  values) and ``diloco-dense-h16``: the library's ``DiLoCo`` with the delta exchanged by ExDyna at
  ``--density`` (error feedback) or densely, the same outer Nesterov SGD. ``sloco-h16``: SparseLoCo's
  recipe on the library's ``DiLoCo`` (its default for a sparse exchange, spelt out): ExDyna on the
  delta, the residual decayed by 0.95 after each outer step (``error_decay``), a plain outer SGD at
  lr 1 in place of Nesterov momentum;
  ``sloco-ef-h16``: the same without the decay; ``sloco-h4``, ``-h8``, ``-h64``: the recipe with 4, 8, 64 inner steps;
  ``sloco-bf16-h16``: with 16-bit values.
- ``dense``, ``exdyna``, ``topk``, ``oktopk``, ``micro``: ``exdyna_mpi.adapters.torch.
  DistributedOptimizer`` with that sparsifier at ``--density`` (the library's defaults for the
  optimiser given), the exchange after backward; ``exdyna-q``: ExDyna with ``max_imbalance=0.05``
  (no momentum correction); ``exdyna-bf16`` and ``dense-bf16``: float32 gradients, values sent in
  bfloat16 (``wire_dtype="bfloat16"``, error feedback keeps the rounding); the SGD recipe's parts,
  one at a time (each with ``momentum_correction=0`` but ``exdyna-mc``): ``exdyna-mc`` (momentum
  correction with the run's momentum, DGC's masking), ``exdyna-q02`` (``max_imbalance=0.2``),
  ``exdyna-dw`` (density warm-up 25 %, 6.25 %, 1.5625 %, each stage an eighth of ``--steps``);
  ``exdyna-mcq``: momentum correction and ``max_imbalance=0.05`` (``exdyna-mcq02``: 0.2);
  ``exdyna-plain``: no momentum correction and no quotas. ``exdyna-mc``/``-mcq``/``-mcq02`` move
  SGD's momentum and run with ``--optimizer sgd`` only. ``exdyna-adam``: ``adam="frozen"``
  (``--adam-warmup`` dense Adam steps, then the second moment frozen, the gradient divided by it
  before ExDyna's selection and error feedback); ``exdyna-adam-g``: ``adam="frozen-gradient"`` (the
  division after the exchange); ``exdyna-adam-u``: ``adam="update"`` (Adam's moments on each rank,
  its update exchanged by ExDyna with error feedback, the average applied); ``dense-adam-u``: the
  same update averaged densely (what the per-rank moments cost without sparsity);
  ``exdyna-demo``: ``adam="demo"`` (DeMo's decoupled momentum: the residual as the momentum, decayed
  by beta1 = 0.9, ``lr * sign`` of the average applied); ``exdyna-demo99``/``-demo999``: the same with
  beta1 = 0.99/0.999; ``exdyna-demo999-ov``: ``-demo999`` with ``overlap=True`` (each exchange on a
  worker thread while the next gradient is computed, its update applied one step late);
  ``exdyna-demo999-mean``: ``-demo999`` gathering the 32-bit means rather than their signs
  (``output="mean"``: the same losses, more bytes); ``exdyna-demo999-bf16``: ``-demo999`` with
  its values summed in bfloat16 (``wire_dtype="bfloat16"``, the rounding kept in the momentum; signs
  gathered as by default); ``exdyna-demoage``/``-demoage999``: ``adam="demo-age"`` at beta1 = 0.9/0.999
  (each sign scaled by the root of the steps since the coordinate last moved), ``exdyna-demoage999-bf16``
  the same with bfloat16 values; all thirteen with ``--optimizer adamw`` only.
  ``exdyna`` is the library's default, which for AdamW is ``adam="demo-age"`` since 2026-11-29
  (``adam="demo"`` from 2026-11-28, ``adam="live"`` before: records of ``exdyna`` on the LM made
  earlier measured those);
  ``exdyna-live``: ``adam="live"`` by name.
- ``ddp-exdyna``: DDP (default buckets) with the library's hook, ``exdyna_hook`` and
  ``ExDynaHookState("exdyna", density, optimizer=opt)``: one sparsifier over the whole model, exchanged
  on the hook's worker thread once the last bucket is ready, inside the same training recipe as
  ``exdyna`` (under SGD its momentum moved before the exchange, under AdamW ``adam="demo"``, both
  entry points' default since 2026-11-28, ``"live"`` in the hook before), clipping each rank's
  gradient before the exchange (``clip_norm=``) as ``exdyna``'s loop does; ``ddp-exdyna-bucket``:
  ``scope="bucket"``, a plain sparsifier per bucket, each exchanged as soon as its bucket is ready
  (overlapping backward); ``ddp-exdyna-demo999``: the model-scope hook with ``adam="demo"`` at
  beta1 = 0.999 (``exdyna-demo999`` through DDP: the same losses, AdamW only).
- ``wagma``: WAGMA-SGD's group averaging (groups of 2, wait-avoiding, a global average every 10).

Timing: a step is forward, backward and the optimiser step with its exchange; evaluation is not
timed. ``step_s`` is the median over steps after ``--warmup`` of the slowest rank's step, per batch.
``compute_s`` (a step with no communication, all ranks at once) is measured before every method's
run, ``allreduce_s`` (gloo's allreduce of the model's float32 gradient) once; ``comm_compute_ratio`` =
allreduce_s / compute_s, and each method's ``comm_share`` = 1 - compute_s / step_s (the exposed
communication). Bytes per step are the wire bytes each rank's interface sent
(``EXDYNA_TESTBED_IFACE``, set by the testbed), else the library's count (``bytes_source``).

Target: ``--target``, else the validation loss ``ddp`` reaches at the end of ``--steps``. Every method
trains ``--steps``; one that has not reached the target by then goes on, at the same evaluation
cadence, up to ``--max-steps`` and stops at the first evaluation at or below it.
``time_to_target_s`` is the training time (slowest rank) at that evaluation, null if never.

Rank 0 writes ``DIR/e2e.jsonl`` (a ``setup`` record, then a ``run`` record per method; with
``--tune-lrs`` a ``tune`` record per method and rate and a ``tuned`` record), ``DIR/e2e.md`` (the
table), ``DIR/e2e_summary.md`` (over seeds), ``DIR/e2e_loss.png``, ``DIR/e2e_ttt.png`` and
``DIR/e2e_regime.png`` (speed-up against link rate: the alpha-beta model and the measured points).
This file trains and writes the records; jobs/e2e_report.py reads them back.
"""
import argparse
import contextlib
import copy
import datetime
import hashlib
import json
import math
import os
import platform
import socket
import sys
import time

import numpy as np

from e2e_report import powersgd_start, report, table

#: the protocol's methods: the library's default against what users would run instead
DEFAULT_METHODS = ("ddp", "ddp-bv", "ddp-accum", "ddp-bf16", "ddp-powersgd", "diloco-h16", "diloco-h64", "exdyna")
# The library's other sparsifiers and recipe parts; for a slow link ExDyna's deadline exchange (DLCP
# analogue) and WAGMA-SGD's group averaging; the DDP hook.
ALL_METHODS = DEFAULT_METHODS + ("dense", "ddp-exdyna", "topk", "oktopk", "micro", "exdyna-q", "exdyna-deadline",
                                 "wagma", "ddp-exdyna-bucket", "exdyna-bf16", "dense-bf16", "exdyna-mc",
                                 "exdyna-q02", "exdyna-dw", "exdyna-mcq", "exdyna-plain", "exdyna-mcq02",
                                 "exdyna-adam", "exdyna-adam-g", "exdyna-adam-u", "dense-adam-u", "diloco-exdyna-h16",
                                 "diloco-exdyna-h64", "diloco-exdyna-bf16-h16", "diloco-dense-h16", "sloco-h16",
                                 "sloco-ef-h16", "sloco-h64", "sloco-bf16-h16", "sloco-h4", "sloco-h8",
                                 "diloco-h4", "diloco-h8", "exdyna-demo", "exdyna-demo99",
                                 "exdyna-demo999", "ddp-exdyna-demo999", "exdyna-demo999-ov", "exdyna-demo999-mean",
                                 "exdyna-demo999-bf16", "exdyna-live", "exdyna-demoage",
                                 "exdyna-demoage999", "exdyna-demoage999-bf16")
DDP_METHODS = ("ddp", "ddp-bv", "ddp-accum", "ddp-powersgd", "ddp-bf16")
#: DiLoCo (Douillard et al. 2023; torchft): H local steps of the inner optimiser, then the averaged
#: parameter delta applied by an outer Nesterov SGD (lr 0.7, momentum 0.9, the paper's values)
DILOCO = {"diloco-h4": 4, "diloco-h8": 8, "diloco-h16": 16, "diloco-h64": 64}


def _nesterov(params):
    """DiLoCo's outer step (Nesterov SGD, lr 0.7, momentum 0.9): the library's default for a dense
    exchange only, named here so that ``diloco-exdyna-*`` keep it on a sparse one."""
    from exdyna_mpi.adapters.torch import nesterov_sgd

    return nesterov_sgd(params)


def _plain_sgd(params):
    """SparseLoCo's outer step (SGD at lr 1, no momentum): the library's default for a sparse
    exchange, named here so that ``sloco-*`` keep it if that default moves."""
    from exdyna_mpi.adapters.torch import plain_sgd

    return plain_sgd(params)


#: the library's ``DiLoCo`` (exdyna_mpi.adapters.torch): (H, sparsifier, DiLoCo's and the sparsifier's
#: options); ``diloco-exdyna-*``: the outer delta exchanged by ExDyna at ``--density`` with plain error
#: feedback under DiLoCo's Nesterov step (``-bf16``: 16-bit values on the wire), or densely
#: (``diloco-dense-h16``: the library's exact mean, against torchft's recipe above); ``sloco-*``: the
#: library's default for a sparse exchange, SparseLoCo's recipe, spelt out
DILOCO_LIB = {"diloco-exdyna-h16": (16, "exdyna", {"outer_optimizer": _nesterov, "error_decay": 1.0}),
              "diloco-exdyna-h64": (64, "exdyna", {"outer_optimizer": _nesterov, "error_decay": 1.0}),
              "diloco-exdyna-bf16-h16": (16, "exdyna", {"wire_dtype": "bfloat16", "outer_optimizer": _nesterov,
                                                        "error_decay": 1.0}),
              "diloco-dense-h16": (16, "dense", {}),
              # SparseLoCo's recipe (Sarfi et al. 2025): the error feedback decayed by 0.95 before the delta
              # joins it, and a plain outer SGD at lr 1 (the decayed accumulator is the outer momentum)
              "sloco-h16": (16, "exdyna", {"error_decay": 0.95, "outer_optimizer": _plain_sgd}),
              "sloco-ef-h16": (16, "exdyna", {"outer_optimizer": _plain_sgd}),
              "sloco-h64": (64, "exdyna", {"error_decay": 0.95, "outer_optimizer": _plain_sgd}),
              "sloco-h4": (4, "exdyna", {"error_decay": 0.95, "outer_optimizer": _plain_sgd}),
              "sloco-h8": (8, "exdyna", {"error_decay": 0.95, "outer_optimizer": _plain_sgd}),
              "sloco-bf16-h16": (16, "exdyna", {"wire_dtype": "bfloat16", "error_decay": 0.95,
                                                "outer_optimizer": _plain_sgd})}
#: methods that only exist for momentum SGD (they move SGD's momentum in front of the exchange)
SGD_ONLY = ("exdyna-mc", "exdyna-mcq", "exdyna-mcq02")
HOOK_METHODS = {"ddp-exdyna": "model", "ddp-exdyna-bucket": "bucket",   # DDP + exdyna_hook, by scope
                "ddp-exdyna-demo999": "model"}
#: the hook's Adam path where it runs one (``ExDynaHookState(optimizer=opt, adam=...)``)
HOOK_ADAM = {"ddp-exdyna-demo999": "demo"}
LIBRARY = {"dense": ("dense", {}), "exdyna": ("exdyna", {}), "topk": ("topk", {}), "oktopk": ("oktopk", {}),
           "micro": ("micro", {}), "exdyna-q": ("exdyna", {"max_imbalance": 0.05, "momentum_correction": 0.0}),
           "exdyna-deadline": ("exdyna", {"deadline_ms": "auto", "max_loss": 0.01}),
           "exdyna-bf16": ("exdyna", {"wire_dtype": "bfloat16"}), "dense-bf16": ("dense", {"wire_dtype": "bfloat16"}),
           "exdyna-mc": ("exdyna", {"max_imbalance": None}),
           "exdyna-q02": ("exdyna", {"max_imbalance": 0.2, "momentum_correction": 0.0}),
           "exdyna-dw": ("exdyna", {"momentum_correction": 0.0}),
           "exdyna-mcq": ("exdyna", {"max_imbalance": 0.05}), "exdyna-mcq02": ("exdyna", {"max_imbalance": 0.2}),
           "exdyna-plain": ("exdyna", {"momentum_correction": 0.0, "max_imbalance": None}),
           "exdyna-adam": ("exdyna", {"adam": "frozen"}), "exdyna-adam-g": ("exdyna", {"adam": "frozen-gradient"}),
           "exdyna-adam-u": ("exdyna", {"adam": "update"}), "dense-adam-u": ("dense", {"adam": "update"}),
           "exdyna-demo": ("exdyna", {"adam": "demo"}), "exdyna-demo99": ("exdyna", {"adam": "demo"}),
           "exdyna-demo999": ("exdyna", {"adam": "demo"}),
           "exdyna-demo999-ov": ("exdyna", {"adam": "demo", "overlap": True}),
           "exdyna-demo999-mean": ("exdyna", {"adam": "demo", "output": "mean"}),
           "exdyna-demo999-bf16": ("exdyna", {"adam": "demo", "wire_dtype": "bfloat16"}),
           "exdyna-live": ("exdyna", {"adam": "live"}),
           "exdyna-demoage": ("exdyna", {"adam": "demo-age"}), "exdyna-demoage999": ("exdyna", {"adam": "demo-age"}),
           "exdyna-demoage999-bf16": ("exdyna", {"adam": "demo-age", "wire_dtype": "bfloat16"})}
#: methods whose arithmetic is another's to the bit, so they take its tuned rate: DDP's bucket views change
#: memory, and ``output="mean"`` gathers the means where ``"demo"``'s default gathers their signs (bytes)
SAME_ARITHMETIC = {"ddp-bv": "ddp", "exdyna-demo999-mean": "exdyna-demo999"}
#: DeMo's momentum decay where it is not AdamW's beta1 of 0.9 (``adam="demo"`` reads it from ``betas[0]``)
DEMO_MOMENTUM = {"exdyna-demo99": 0.99, "exdyna-demo999": 0.999, "ddp-exdyna-demo999": 0.999,
                 "exdyna-demo999-ov": 0.999, "exdyna-demo999-mean": 0.999, "exdyna-demo999-bf16": 0.999,
                 "exdyna-demoage999": 0.999, "exdyna-demoage999-bf16": 0.999}
#: Adam's own paths (``DistributedOptimizer(adam=...)``): the update exchanged, the variance frozen, DeMo's
#: decoupled momentum (the residual as momentum, sign of the average applied); AdamW only
ADAM_ONLY = ("exdyna-adam", "exdyna-adam-g", "exdyna-adam-u", "dense-adam-u", "exdyna-demo", "exdyna-demo99",
             "exdyna-demo999", "ddp-exdyna-demo999", "exdyna-demo999-ov", "exdyna-demo999-mean",
             "exdyna-demo999-bf16", "exdyna-demoage", "exdyna-demoage999", "exdyna-demoage999-bf16")
#: the training recipe's options, set from the run's arguments in _build: momentum correction with the
#: run's momentum (the wrapped SGD then runs without it); DGC's density warm-up, 25 %, 6.25 %, 1.5625 %,
#: each stage an eighth of the step budget (an epoch of the CNN's)
RECIPES = {"exdyna-mc": lambda args: {"momentum_correction": args.momentum},
           "exdyna-mcq": lambda args: {"momentum_correction": args.momentum},
           "exdyna-mcq02": lambda args: {"momentum_correction": args.momentum},
           "exdyna-dw": lambda args: {"density_warmup": (0.25, 0.0625, 0.015625),
                                      "density_warmup_steps": max(1, args.steps // 8)},
           "exdyna-adam": lambda args: {"warmup_steps": args.adam_warmup},
           "exdyna-adam-g": lambda args: {"warmup_steps": args.adam_warmup}}


# --- workloads -----------------------------------------------------------------------------------------

class LMWork:
    name = "lm"
    defaults = {"batch": 8, "optimizer": "adamw", "lr": 1e-3, "clip": 1.0, "schedule": "cosine", "steps": 600,
                "momentum": 0.9, "weight_decay": 0.1, "lr_warmup": 30}

    def __init__(self, args, rank, nranks):
        import models

        self.seed, self.rank = args.seed, rank
        self.dims = dict(d_model=args.d_model, layers=args.layers, heads=args.heads, context=args.context)
        train, val = models.stdlib_corpus()
        self.data = models.TextData(train, val, seq=args.context, val_windows=args.val_windows, val_seq=args.context)
        self.batch = args.batch
        self.info = {"model": "GPT " + ", ".join(f"{k} {v}" for k, v in self.dims.items()),
                     "data": "stdlib *.py, split by file", "corpus": models.corpus_id(train, val),
                     "val_predictions": int(self.data.val_y.numel())}
        # the floor a target must be below (count models of the same split, on the same predictions)
        import ngram
        from mpi4py import MPI

        base = ngram.baselines(train, self.data.val_x.numpy(), self.data.val_y.numpy()) if rank == 0 else None
        self.info["ngram"] = MPI.COMM_WORLD.bcast(base)

    def model(self):
        import models

        return models.GPT(**self.dims)

    def batch_at(self, step):
        return self.data.batch(step, self.batch, self.seed, self.rank)

    def loss(self, model, x, y):
        import models

        return models.text_loss(model, x, y)

    def evaluate(self, model, comm):
        import models

        return {"val_loss": models.text_val_loss(model, self.data, comm)}


class CNNWork:
    name = "cnn"
    defaults = {"batch": 32, "optimizer": "sgd", "lr": 0.1, "clip": 0.0, "schedule": "constant", "steps": 264,
                "momentum": 0.9, "weight_decay": 1e-4, "lr_warmup": 0}

    def __init__(self, args, rank, nranks):
        import models
        from mpi4py import MPI

        self.seed, self.rank, self.batch = args.seed, rank, args.batch
        self.data = models.digits(args.seed, rank, nranks)
        shard = MPI.COMM_WORLD.allreduce(self.data.x_train.shape[0], op=MPI.MIN)
        self.per_epoch = max(1, shard // self.batch)
        self._next, self._it = None, None
        self.info = {"model": "DigitsCNN width 48", "data": "sklearn digits, 20 % test",
                     "steps_per_epoch": self.per_epoch}

    def model(self):
        import models

        return models.DigitsCNN(width=48)

    def batch_at(self, step):
        """The batch of ``step``, the same whichever steps came before (each method starts at 0)."""
        epoch, pos = divmod(step, self.per_epoch)
        if (epoch, pos) != self._next:
            self._it = self.data.batches(epoch, self.batch, self.per_epoch, self.seed, self.rank)
            for _ in range(pos):
                next(self._it)
        self._next = (epoch, pos + 1) if pos + 1 < self.per_epoch else None
        return next(self._it)

    def loss(self, model, x, y):
        import torch

        return torch.nn.functional.cross_entropy(model(x), y)

    def evaluate(self, model, comm):
        import models

        acc, loss = models.evaluate(model, self.data, comm)
        return {"val_loss": loss, "val_acc": acc}


WORKLOADS = {"lm": LMWork, "cnn": CNNWork}


# --- methods -------------------------------------------------------------------------------------------

class Method:
    """One method's training state and how it takes a step.

    ``runner`` runs forward and backward (the model, or DDP around it); ``opt`` is what the loop steps;
    ``stride``: batches per optimiser step (gradient accumulation takes several, with DDP's ``no_sync``
    on all but the last); ``outer``: DiLoCo's outer step (None otherwise); ``stats()``: the library's
    last ``Stats`` (None for torch's own methods); ``collectives``: collective calls per step, for the
    latency term of the performance model (an estimate, see ``collectives``).
    """

    def __init__(self, runner, model, opt, *, stats=None, stride=1, outer=None, collectives=1.0, loop_clips=True):
        self.runner, self.model, self.opt, self.loop_clips = runner, model, opt, loop_clips
        self.stats = stats or (lambda: None)
        self.stride, self.outer, self.collectives = stride, outer, collectives

    def step(self, wl, step, clip):
        """One optimiser step on batches ``step`` .. ``step + stride - 1``; ``clip``: the norm that
        ``clip_grad_norm_`` holds the model's gradient to before the optimiser step (None: off), for
        every method alike, as a user's training loop does it (DDP: the averaged gradient; the
        library's optimizer: this rank's gradient, before the exchange; DiLoCo: the local one). The
        model-scope hook clips inside (``loop_clips=False``): the same rank's gradient, before the
        exchange."""
        import torch

        self.opt.zero_grad()
        for i in range(self.stride):
            x, y = wl.batch_at(step + i)
            last = i == self.stride - 1
            with contextlib.nullcontext() if last else self.runner.no_sync():
                loss = wl.loss(self.runner, x, y)
                (loss if self.stride == 1 else loss / self.stride).backward()
        if clip and self.loop_clips:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        self.opt.step()
        if self.outer is not None:
            self.outer.after_inner_step()

    def evaluated(self):
        """A context in which ``model`` holds the parameters to evaluate (DiLoCo: the global ones)."""
        return self.outer.global_model() if self.outer is not None else contextlib.nullcontext()

    def param_hash(self):
        with self.evaluated():
            return param_hash(self.model)

    def close(self):
        """Stop what the method started (the hook's worker, a deadline exchange's pending messages, an
        overlapped exchange still in flight)."""
        getattr(self.opt, "flush", lambda: None)()
        hook = getattr(self.runner, "_exdyna_hook_state", None)
        if hook is not None:
            hook.close()
        getattr(getattr(self.opt, "sparsifier", self.opt), "close", lambda: None)()


class DiLoCoOuter:
    """DiLoCo's outer step, as torchft's ``DiLoCo`` takes it: every ``h`` inner steps the pseudo-gradient
    ``global - local`` is averaged over the ranks (one dense float32 allreduce), set as the gradient of
    the global parameters and applied by the outer optimiser (Nesterov SGD); the local model then
    restarts from the new global parameters, the inner optimiser keeping its own state.
    """

    def __init__(self, model, h, lr=0.7, momentum=0.9):
        import torch
        import torch.distributed as dist

        self.h, self.count, self.ranks = h, 0, dist.get_world_size()
        self.params = list(model.parameters())
        self.glob = [torch.nn.Parameter(p.detach().clone()) for p in self.params]
        self.outer = torch.optim.SGD(self.glob, lr=lr, momentum=momentum, nesterov=True)

    def after_inner_step(self):
        self.count += 1
        if self.count % self.h == 0:
            self.sync()

    def sync(self):
        import torch
        import torch.distributed as dist

        with torch.no_grad():
            delta = torch.cat([(g - p).reshape(-1) for g, p in zip(self.glob, self.params)])
            dist.all_reduce(delta)
            delta /= self.ranks
            off = 0
            for g in self.glob:
                g.grad = delta[off:off + g.numel()].view_as(g)
                off += g.numel()
        self.outer.step()
        with torch.no_grad():
            for g, p in zip(self.glob, self.params):
                p.copy_(g)

    @contextlib.contextmanager
    def global_model(self):
        import torch

        with torch.no_grad():
            local = [p.detach().clone() for p in self.params]
            for g, p in zip(self.glob, self.params):
                p.copy_(g)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, x in zip(self.params, local):
                    p.copy_(x)


class GlobalView:
    """Evaluation of the library's ``DiLoCo`` on its global parameters (``DiLoCoOuter``'s interface)."""

    def __init__(self, opt):
        self.global_model = opt.global_model

    def after_inner_step(self):
        pass


def make_optimizer(params, args, lr, momentum=None):
    """The run's optimiser: AdamW with betas (0.9, 0.95) (GPT practice; ``momentum`` replaces beta1)
    or SGD with momentum."""
    import torch

    if args.optimizer == "adamw":
        beta1 = 0.9 if momentum is None else momentum
        return torch.optim.AdamW(params, lr=lr, betas=(beta1, 0.95), weight_decay=args.weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=args.momentum if momentum is None else momentum,
                           weight_decay=args.weight_decay)


def lr_factor(step, args):
    """The learning-rate multiplier before optimiser step at batch ``step``: a linear warm-up over
    ``--lr-warmup`` batches, then constant or a cosine to a tenth at ``--steps`` (held after it)."""
    warm = min(1.0, (step + 1) / args.lr_warmup) if args.lr_warmup > 0 else 1.0
    if args.schedule == "cosine":
        return warm * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, step / args.steps))))
    return warm


def collectives(method, numel, stride=1):
    """Collective calls per step (an estimate for the model's latency term): DDP one per bucket (the
    first 1 MB, then 25 MB), PowerSGD three (P, Q, the uncompressed tensors), a library sparsifier
    five (counts, controller, indices, the two halves of the value sum), DiLoCo one per ``h`` steps."""
    if method in DILOCO:
        return 1.0 / DILOCO[method]
    if method in DILOCO_LIB:
        return (2.0 if DILOCO_LIB[method][1] == "dense" else 5.0) / DILOCO_LIB[method][0]
    if method == "ddp-powersgd":
        return 3.0
    if method in DDP_METHODS or method in HOOK_METHODS:
        return (1 + math.ceil(max(0, 4 * numel - 2**20) / (25 * 2**20))) / stride
    return 2.0 if method.startswith("dense") else 5.0


def build(method, wl, args, comm, numel):
    """``Method`` for ``method``, the model initialised from ``args.seed`` on every rank, at the
    method's learning rate (``args.lr_of``, else ``--lr``)."""
    import torch

    torch.manual_seed(args.seed)
    model = wl.model()
    lr = args.lr_of.get(method, args.lr)
    n = collectives(method, numel, args.accum if method == "ddp-accum" else 1)
    if method in HOOK_METHODS:
        from torch.nn.parallel import DistributedDataParallel as DDP

        from exdyna_mpi.adapters.torch import ExDynaHookState, exdyna_hook

        ddp = DDP(model)
        opt = make_optimizer(ddp.parameters(), args, lr, DEMO_MOMENTUM.get(method))
        scope = HOOK_METHODS[method]
        # model scope: the optimizer's recipe, as DistributedOptimizer runs it (bucket scope has none)
        state = ExDynaHookState("exdyna", density=args.density, comm=comm, scope=scope,
                                optimizer=opt if scope == "model" else None, **hook_options(method, scope, args))
        ddp.register_comm_hook(state, exdyna_hook)
        ddp._exdyna_hook_state = state
        return Method(ddp, model, opt, stats=lambda: merged_stats(state.stats), collectives=n,
                      loop_clips=scope != "model")
    if method in DDP_METHODS:
        from torch.nn.parallel import DistributedDataParallel as DDP

        if method == "ddp-powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

            # One bucket: see the module docstring (gloo and the hook's chained allreduce).
            ddp = DDP(model, bucket_cap_mb=4 * numel / 2**20 + 1)
            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                       start_powerSGD_iter=powersgd_start(args.steps))
            ddp.register_comm_hook(state, psgd.powerSGD_hook)
        else:
            ddp = DDP(model, gradient_as_bucket_view=method == "ddp-bv")
            if method == "ddp-bf16":
                ddp.register_comm_hook(None, bf16_compress_hook_gloo)
        return Method(ddp, model, make_optimizer(ddp.parameters(), args, lr),
                      stride=args.accum if method == "ddp-accum" else 1, collectives=n)
    from exdyna_mpi.adapters.torch import DistributedOptimizer, GroupAveragingOptimizer

    if method in DILOCO:
        return Method(model, model, make_optimizer(model.parameters(), args, lr),
                      outer=DiLoCoOuter(model, DILOCO[method]), collectives=n)
    if method in DILOCO_LIB:
        from exdyna_mpi.adapters.torch import DiLoCo

        h, name, options = DILOCO_LIB[method]
        opt = DiLoCo(make_optimizer(model.parameters(), args, lr), model, sync_every=h, sparsifier=name,
                     density=args.density, comm=comm, **options)
        # stats of the step that just took an outer step (bytes per outer step), None between them
        return Method(model, model, opt, stats=lambda: opt.stats if opt.inner_steps == 0 else None,
                      outer=GlobalView(opt), collectives=n)
    if method == "wagma":
        # WAGMA-SGD as its authors run it: a local step, then the model averaged within rotating
        # groups of 2, wait-avoiding, a global average every 10 steps.
        opt = GroupAveragingOptimizer(make_optimizer(model.parameters(), args, lr), model, group_size=2,
                                      sync_every=10, mode="wait_avoiding", comm=comm)
        return Method(model, model, opt, collectives=n)
    name, options = LIBRARY[method]
    momentum = DEMO_MOMENTUM.get(method)
    if method in RECIPES:
        options = dict(options, **RECIPES[method](args))
        if options.get("momentum_correction"):
            momentum = 0.0
    opt = DistributedOptimizer(make_optimizer(model.parameters(), args, lr, momentum), model, sparsifier=name,
                               density=1.0 if name == "dense" else args.density, comm=comm, **options)
    return Method(model, model, opt, stats=lambda: opt.stats, collectives=n)


def hook_options(method, scope, args):
    """The hook's recipe options for ``method``: at model scope (``optimizer=``), ``clip_norm=`` clips
    each rank's gradient before the exchange, where ``DistributedOptimizer``'s loop clips it (the
    Adam paths compute their update from the exchanged vector, and refuse a ``.grad`` clipped after
    ``backward()``), and ``adam=`` where the method names a path."""
    if scope != "model":
        return {}
    return {"clip_norm": args.clip, **({"adam": HOOK_ADAM[method]} if method in HOOK_ADAM else {})}


def merged_stats(stats):
    """One ``Stats``-like view of the hook's stats (``scope="bucket"``: a dict of them, summed)."""
    if not isinstance(stats, dict):
        return stats
    from types import SimpleNamespace

    parts = list(stats.values())
    seconds = {}
    for s in parts:
        for k, v in s.seconds.items():
            seconds[k] = seconds.get(k, 0.0) + v
    return SimpleNamespace(bytes_sent=sum(s.bytes_sent for s in parts),
                           counts=np.sum([np.asarray(s.counts, dtype=np.float64) for s in parts], axis=0),
                           seconds=seconds)


def bf16_compress_hook_gloo(state, bucket):
    """torch's ``bf16_compress_hook``, unchanged, under another name: DDP refuses to register the hook
    by that name unless the backend is NCCL ("required CUDA 11+ and NCCL 2.10+"), yet gloo reduces
    bfloat16 tensors correctly (tests/unit/test_e2e_cli.py checks the result against ddp's)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


def prime_library(method, wl, args, comm, numel):
    """One untimed step of ``method`` on a throwaway model: Numba compiles the sparsifier's kernels on
    first use (seconds), a cost paid once per process, not per training step."""
    if method in LIBRARY or method in HOOK_METHODS or method in DILOCO_LIB:
        m = build(method, wl, args, comm, numel)
        m.step(wl, 0, args.clip)
        if method in DILOCO_LIB:
            m.opt.sync()   # the outer exchange, whose kernels the first step did not reach
        m.close()


def max_over_ranks(comm, values):
    """Element-wise maximum over the ranks of equally long float sequences."""
    from mpi4py import MPI

    a = np.ascontiguousarray(values, dtype=np.float64)
    out = np.empty_like(a)
    comm.Allreduce(a, out, op=MPI.MAX)
    return out


def param_hash(model):
    import torch

    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


class WireCounter:
    """Bytes this rank's testbed interface sent (None when not on the testbed)."""

    def __init__(self):
        iface = os.environ.get("EXDYNA_TESTBED_IFACE")
        self.path = f"/sys/class/net/{iface}/statistics/tx_bytes" if iface else None
        if self.path and not os.path.exists(self.path):
            self.path = None

    def read(self):
        if self.path is None:
            return 0
        with open(self.path) as f:
            return int(f.read())


def method_args(args, method):
    """``args`` as ``method`` runs them: its own ``--density-of``; its own budget where ``--steps-of``
    gives one (the schedule, the budget's evaluation and the methods' warm-ups follow it), at least to
    ``--max-steps``; evaluated every ``--eval-every`` (default: the launch's ``--steps`` / 10), so that
    every method's time to target has the same resolution."""
    own = copy.copy(args)
    own.eval_every = args.eval_every or max(1, args.steps // 10)
    own.density = args.density_of.get(method, args.density)
    if method in args.steps_of:
        own.steps = args.steps_of[method]
        own.max_steps = max(own.steps, args.max_steps)
    return own


def train(method, wl, args, comm, numel, target, log):
    """One method's run: the ``run`` record (the same on every rank).

    The loop counts batches per rank (``step``); an optimiser step takes ``Method.stride`` of them, so
    gradient accumulation sees the same data per step budget as the others. Every method trains
    its budget (``--steps``, or its ``--steps-of``); one that has not reached ``target`` by then goes
    on to ``--max-steps``.
    """
    from mpi4py import MPI

    import exdyna_mpi

    args = method_args(args, method)
    P = comm.Get_size()
    prime_library(method, wl, args, comm, numel)
    m = build(method, wl, args, comm, numel)
    base_lr = [g["lr"] for g in m.opt.param_groups]
    wire = WireCounter()
    step_times, wire_bytes, lib_bytes, imbalance, phases = [], [], [], [], {}
    evals = []
    elapsed = 0.0

    def evaluate(step):
        if method == "wagma":
            m.opt.synchronize_model()    # the ranks' models differ between global averages
        m.runner.eval()
        with m.evaluated():
            res = wl.evaluate(m.model, comm)
        m.runner.train()
        t = comm.allreduce(elapsed, op=MPI.MAX)
        evals.append([step, round(t, 4), res["val_loss"]] + ([res["val_acc"]] if "val_acc" in res else []))
        log(f"{method}: step {step} val_loss {res['val_loss']:.4f} at {t:.1f} s")
        return res["val_loss"]

    every = args.eval_every
    diverged = False
    comm.Barrier()
    loss = evaluate(0)
    reached = target is not None and loss <= target
    step = 0
    while step < args.max_steps:
        for g, lr in zip(m.opt.param_groups, base_lr):
            g["lr"] = lr * lr_factor(step, args)
        b0 = wire.read()
        t0 = time.perf_counter()
        try:
            m.step(wl, step, args.clip)
        except exdyna_mpi.StepError as e:
            # raised on every rank together (a library method refusing a non-finite gradient or delta):
            # the run diverged; DDP's would go on with NaN, which the records also count as diverged
            log(f"{method}: diverged at step {step} ({e})")
            evals.append([step, round(comm.allreduce(elapsed, op=MPI.MAX), 4), float("nan")])
            diverged = True
            break
        dt = time.perf_counter() - t0
        wire_bytes.append(wire.read() - b0)
        step_times.append(dt)
        elapsed += dt
        prev, step = step, step + m.stride
        st = m.stats()
        if st is not None:
            lib_bytes.append(st.bytes_sent)
            counts = np.asarray(st.counts, dtype=np.float64)
            if counts.mean() > 0:
                imbalance.append(float(counts.max() / counts.mean() - 1.0))
            for k, v in st.seconds.items():
                phases.setdefault(k, []).append(v)
        crossed = step // every > prev // every
        if crossed or prev < args.steps <= step or step >= args.max_steps:
            loss = evaluate(step)
            reached = reached or (target is not None and loss <= target)
            if step >= args.steps and (reached or target is None) or args.stop_at_target and reached:
                break
    times = max_over_ranks(comm, step_times)
    budget = [e for e in evals if e[0] >= args.steps]     # none where --stop-at-target ended the run early
    loss_at_steps = float("nan") if diverged else budget[0][2] if budget else None
    hit = next((e for e in evals if target is not None and e[2] <= target), None)
    hashes = comm.allgather(m.param_hash())
    w = np.mean(comm.allgather(float(np.mean(wire_bytes[args.warmup:] or wire_bytes))))
    warm = max(0, min(args.warmup, len(times) - 1))
    per_step = float(np.median(times[warm:]))
    rec = {"kind": "run", "method": method, "workload": wl.name, "ranks": P, "rate_mbit": args.rate,
           "seed": args.seed, "lr": args.lr_of.get(method, args.lr), "params": numel, "steps": args.steps,
           "steps_run": step, "stride": m.stride, "step_s": per_step / m.stride,
           "final_loss": evals[-1][2], "loss_at_steps": loss_at_steps, "target": target,
           "time_to_target_s": None if hit is None else hit[1], "steps_to_target": None if hit is None else hit[0],
           "evals": evals, "params_identical": len(set(hashes)) == 1, "diverged": diverged,
           "collectives_per_step": m.collectives,
           "density": None if method in DDP_METHODS or method in DILOCO or method.startswith(("dense", "diloco-dense"))
           else args.density}
    if wire.path is not None:
        rec["bytes_per_step"], rec["bytes_source"] = float(w) / m.stride, "wire"
    elif lib_bytes:
        per_outer = DILOCO_LIB[method][0] if method in DILOCO_LIB else 1   # lib_bytes: one per outer step
        rec["bytes_per_step"] = float(np.mean(comm.allgather(float(np.mean(lib_bytes))))) / per_outer
        rec["bytes_source"] = "model"
    else:
        per = {"ddp": 4, "ddp-bv": 4, "ddp-accum": 4 / m.stride, "ddp-bf16": 2}.get(method)
        if method in DILOCO:
            per = 4 / DILOCO[method]
        rec["bytes_per_step"] = 2 * (P - 1) / P * per * numel if per else None
        rec["bytes_source"] = "model" if per else None
    if lib_bytes:
        sl = slice(args.warmup, None)
        rec["phase_s"] = {k: float(np.median(max_over_ranks(comm, v)[sl] if len(v) > args.warmup else v))
                          for k, v in sorted(phases.items())}
        rec["imbalance_median"] = float(np.median(imbalance)) if imbalance else None
    m.close()
    return rec


def measure_compute(wl, args, comm, steps=7):
    """Seconds of a step without communication (forward, backward, the run's optimiser step), every
    rank at once; the median of the slowest rank's steps after two."""
    import torch

    torch.manual_seed(args.seed)
    model = wl.model()
    opt = make_optimizer(model.parameters(), args, args.lr)
    ts = []
    comm.Barrier()
    for s in range(steps):
        x, y = wl.batch_at(s)
        t0 = time.perf_counter()
        opt.zero_grad()
        wl.loss(model, x, y).backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        ts.append(time.perf_counter() - t0)
    return float(np.median(max_over_ranks(comm, ts[2:])))


def measure_setup(wl, args, comm, numel):
    """``compute_s`` (``measure_compute``) and ``allreduce_s`` (gloo's allreduce of the model's float32
    gradient), medians."""
    import torch
    import torch.distributed as dist

    compute = measure_compute(wl, args, comm)
    buf = torch.ones(numel)
    dist.all_reduce(buf)
    ar = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        ar.append(time.perf_counter() - t0)
    allreduce = float(np.median(max_over_ranks(comm, ar)))
    return compute, allreduce


def init_torch_distributed(comm):
    """gloo over the rendezvous the testbed names (MASTER_ADDR/PORT), else loopback and a port from rank 0."""
    import torch.distributed as dist

    addr = os.environ.get("MASTER_ADDR")
    port = os.environ.get("MASTER_PORT")
    if not addr:
        addr = "127.0.0.1"
    if addr.startswith("127.") and not os.environ.get("GLOO_SOCKET_IFNAME"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if not port:
        port = None
        if comm.Get_rank() == 0:
            with socket.socket() as s:
                s.bind((addr, 0))
                port = s.getsockname()[1]
        port = comm.bcast(port)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=comm.Get_rank(),
                            world_size=comm.Get_size())


# --- main ----------------------------------------------------------------------------------------------

def _density(text):
    """``text`` as a density in (0, 1], else None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0.0 < value <= 1.0 else None


def _method_values(ap, flag, items, methods, expected, parse):
    """``{method: value}`` from ``flag``'s ``METHOD=VALUE`` items; ``parse`` gives None for a bad value.
    An item whose method is not launched, or whose value is bad, is refused (argparse's exit 2)."""
    values = {}
    for item in items:
        method, _, text = item.partition("=")
        value = parse(text)
        if method not in methods or value is None:
            ap.error(f"{flag} {item}: expected {expected} and METHOD one of --methods")
        values[method] = value
    return values


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="lm")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help=f"comma-separated, of {', '.join(ALL_METHODS)} (default: {', '.join(DEFAULT_METHODS)})")
    ap.add_argument("--ranks", type=int, help="checked against the MPI world's size")
    ap.add_argument("--rate", type=float, help="link rate for the records (default: EXDYNA_TESTBED_RATE_MBIT)")
    ap.add_argument("--steps", type=int, help="budget in batches per rank (lm 600, cnn 264: 24 epochs at P=4)")
    ap.add_argument("--max-steps", type=int, help="batches a method may run to reach the target (default 2 x steps)")
    ap.add_argument("--steps-of", dest="steps_of_items", action="append", default=[], metavar="METHOD=N",
                    help="another budget for one method (repeatable): its schedule ends at N batches, it trains N "
                         "(to --max-steps for the target); local-step methods trade batches for bytes")
    ap.add_argument("--stop-at-target", action="store_true",
                    help="end each run when it reaches the target (else it trains its whole budget): times to "
                         "target only, no loss at the budget for the runs that stop early")
    ap.add_argument("--density-of", dest="density_of_items", action="append", default=[], metavar="METHOD=D",
                    help="another --density for one method (repeatable): each at the density it was tuned at")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--target", type=float, help="validation loss to reach (default: ddp's at --steps)")
    ap.add_argument("--batch", type=int, help="per-rank batch (lm 8 sequences, cnn 32 images)")
    ap.add_argument("--optimizer", choices=("adamw", "sgd"),
                    help="lm: adamw (betas 0.9, 0.95), cnn: sgd (with --momentum)")
    ap.add_argument("--lr", type=float, help="learning rate of every method without a tuned one (lm 1e-3, cnn 0.1)")
    ap.add_argument("--tuned", metavar="JSON", action="append",
                    help="per-method learning rates chosen by --tune-lrs (tuned.json; repeatable, a later file's "
                         "rate wins); each must have been tuned at the method's budget")
    ap.add_argument("--tune-lrs", metavar="LR,LR,...",
                    help="tune instead: every method at each learning rate for --steps, no target; writes tune "
                         "records and DIR/tuned.json (the lowest loss at the budget, mean over the file's seeds)")
    ap.add_argument("--clip", type=float, help="clip_grad_norm_ before every optimiser step (lm 1.0, cnn off; 0: off)")
    ap.add_argument("--schedule", choices=("constant", "cosine"), help="after the warm-up (lm cosine, cnn constant)")
    ap.add_argument("--momentum", type=float)
    ap.add_argument("--adam-warmup", type=int,
                    help="exdyna-adam/-adam-g: dense Adam steps before the variance freezes (default: --lr-warmup)")
    ap.add_argument("--lr-warmup", type=int, help="batches of linear learning-rate warm-up (lm 30, cnn 0)")
    ap.add_argument("--weight-decay", type=float)
    ap.add_argument("--accum", type=int, default=4, help="ddp-accum: batches accumulated per optimiser step")
    ap.add_argument("--no-ddp-last", dest="ddp_last", action="store_false",
                    help="do not run ddp again after the other methods (drift check)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=0, help="batches between evaluations (default steps/10)")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of step_s")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / ranks on the node)")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--val-windows", type=int, default=512, help="lm: held-out windows of --context predictions")
    ap.add_argument("--out", default="out/e2e")
    ap.add_argument("--report", nargs="+", metavar="JSONL_OR_DIR", help="rebuild table and plots, no MPI")
    ap.add_argument("--docs", metavar="MD", help="with --report: also write this results page (and --readme's table)")
    ap.add_argument("--readme", metavar="MD", help="with --docs: README whose e2e-results block is regenerated")
    ap.add_argument("--choose-lrs", nargs="+", metavar="JSONL_OR_DIR",
                    help="write OUT/tuned.json: each of --methods' rate chosen from its tune records in these "
                         "files (one grid spread over launches, e.g. an edge widened later); no MPI")
    ap.add_argument("--curves-from", nargs="+", metavar="JSONL_OR_DIR", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in ALL_METHODS]
    if bad:
        ap.error(f"unknown methods {bad}; choose from {', '.join(ALL_METHODS)}")
    args.methods = sorted(methods, key=lambda m: m != "ddp")          # ddp first: it sets the target
    for k, v in WORKLOADS[args.workload].defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.optimizer == "adamw":
        sgd_only = [m for m in args.methods if m in SGD_ONLY or m in RECIPES and m not in ("exdyna-dw",) + ADAM_ONLY]
        if sgd_only:
            ap.error(f"{sgd_only} move SGD's momentum; they run with --optimizer sgd only")
    elif any(m in ADAM_ONLY for m in args.methods):
        adam_only = [m for m in args.methods if m in ADAM_ONLY]
        ap.error(f"{adam_only} are Adam paths; they run with --optimizer adamw only")
    if args.adam_warmup is None:
        args.adam_warmup = max(1, args.lr_warmup)
    args.clip = args.clip or None
    if args.accum < 1:
        ap.error("--accum must be >= 1")
    args.max_steps = max(args.steps, args.max_steps or 2 * args.steps)
    if args.rate is None and os.environ.get("EXDYNA_TESTBED_RATE_MBIT"):
        args.rate = float(os.environ["EXDYNA_TESTBED_RATE_MBIT"])
    args.grid = [float(x) for x in args.tune_lrs.split(",")] if args.tune_lrs else None
    args.steps_of = _method_values(ap, "--steps-of", args.steps_of_items, args.methods, "METHOD=N with N >= 1",
                                   lambda n: int(n) if n.isdigit() and int(n) >= 1 else None)
    args.density_of = _method_values(ap, "--density-of", args.density_of_items, args.methods,
                                     "METHOD=D with 0 < D <= 1", _density)
    if args.steps_of and args.grid:
        ap.error("--steps-of with --tune-lrs: tune a method at another budget with --steps in its own launch")
    args.lr_of, chosen = {}, {}
    for path in args.tuned or []:
        with open(path) as f:
            tuned = json.load(f)
        if tuned.get("workload") != args.workload:
            ap.error(f"--tuned {path} is for workload {tuned.get('workload')!r}, not {args.workload!r}")
        for m, v in tuned["lr_of"].items():
            args.lr_of[m], chosen[m] = float(v), (path, tuned.get("steps"))
    for m, (path, steps) in chosen.items():
        budget = args.steps_of.get(m, args.steps)
        if m in args.methods and steps not in (None, budget):
            # a rate tuned for one schedule length is not the best for another (the cosine's pace)
            ap.error(f"--tuned {path} chose {m}'s rate at {steps} batches; it runs {budget} here: tune it at "
                     f"that budget")
    if args.tuned:
        for m, twin in SAME_ARITHMETIC.items():
            if twin not in args.lr_of:
                continue
            if m in args.methods and args.steps_of.get(m, args.steps) != args.steps_of.get(twin, args.steps):
                ap.error(f"{m} takes {twin}'s tuned rate: give both the same budget (--steps-of)")
            args.lr_of.setdefault(m, args.lr_of[twin])
        untuned = [m for m in args.methods if m not in args.lr_of]
        if untuned:
            ap.error(f"--tuned {', '.join(args.tuned)} has no learning rate for {untuned}: tune them first")
    return args


def choose(paths, methods, workload, out):
    """``OUT/tuned.json`` from tune records spread over several launches (a grid widened at its edge
    in a launch of its own): the records of ``methods`` only, held to the protocol by
    :func:`e2e_report.choose_lrs` (the same grid size, seeds and budget for each). Returns its table."""
    import common
    from e2e_report import _labels, choose_lrs, read_records, tuning_table

    records = [r for r in read_records(paths) if r.get("kind") == "tune" and r.get("method") in methods]
    missing = [m for m in methods if m not in {r["method"] for r in records}]
    if missing:
        raise SystemExit(f"e2e: no tune records of {missing} in {', '.join(paths)}")
    try:
        tuned = choose_lrs(records, workload)
    except ValueError as e:
        raise SystemExit(f"e2e: {e}") from None
    common.write_json(os.path.join(out, "tuned.json"), tuned)
    return tuning_table(tuned, _labels(records))


def main(argv=None):
    args = parse_args(argv)
    if args.choose_lrs:
        print(choose(args.choose_lrs, args.methods, args.workload, args.out))
        return 0
    if args.report:
        if args.curves_from:
            raise SystemExit("e2e: --curves-from is gone: composed times are not part of the protocol")
        print(report(args.report, args.out))
        if args.docs:
            from e2e_report import read_records, write_docs

            write_docs(read_records(args.report), args.docs, readme=args.readme, header=DOCS_HEADER)
        return 0
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    import common

    comm = MPI.COMM_WORLD
    rank, P = comm.Get_rank(), comm.Get_size()
    if args.ranks is not None and args.ranks != P:
        raise SystemExit(f"e2e: --ranks {args.ranks} but the MPI world has {P} ranks")
    # Ranks per host by host name: on the testbed MPICH runs with MPIR_CVAR_NOLOCAL=1 and sees every
    # rank as alone on its node, so a shared-memory split would give each rank all the cores.
    host = socket.gethostname()
    threads = args.threads or max(1, common.cores() // comm.allgather(host).count(host))
    torch.set_num_threads(threads)
    init_torch_distributed(comm)
    # After init_process_group, which replaces sys.excepthook with one that buffers the old hook's
    # output to prefix it with the rank: installed before it, an abort would drop the traceback.
    common.abort_on_exception(comm)
    wl = WORKLOADS[args.workload](args, rank, P)
    torch.manual_seed(args.seed)
    numel = sum(p.numel() for p in wl.model().parameters())

    def log(msg):
        if rank == 0:
            common.log("e2e", msg)

    compute_s, allreduce_s = measure_setup(wl, args, comm, numel)
    target = args.target
    launch = comm.bcast(f"{datetime.datetime.now():%Y%m%dT%H%M%S}-{args.workload}-s{args.seed}-r{args.rate}"
                        if rank == 0 else None)
    setup = {"kind": "setup", "launch": launch, "workload": args.workload, "ranks": P, "rate_mbit": args.rate,
             "params": numel, "compute_s": compute_s, "allreduce_s": allreduce_s,
             "comm_compute_ratio": allreduce_s / compute_s, "batch": args.batch, "steps": args.steps,
             "max_steps": args.max_steps, "optimizer": args.optimizer, "lr": args.lr, "lr_of": args.lr_of,
             "tuned_from": ", ".join(args.tuned) if args.tuned else None,
             "steps_of": args.steps_of, "density_of": args.density_of, "stop_at_target": args.stop_at_target,
             "clip": args.clip, "schedule": args.schedule, "momentum": args.momentum,
             "weight_decay": args.weight_decay, "lr_warmup": args.lr_warmup, "accum": args.accum,
             "density": args.density, "seed": args.seed, "target": target, "methods": args.methods,
             "tune_grid": args.grid, "threads_per_rank": threads, "torch": torch.__version__,
             "mpi": common.mpi_library(), "host": platform.node(), "cores": common.cores(),
             "cpu": common.cpu_model(), "date": datetime.date.today().isoformat(), "command": common.command(),
             **wl.info}
    log(f"{args.workload}: {numel:,} parameters, P={P}, rate {args.rate} Mbit/s: compute {compute_s:.3f} s/step, "
        f"dense allreduce {allreduce_s:.3f} s (ratio {allreduce_s / compute_s:.2f})")
    path = os.path.join(args.out, "e2e.jsonl")
    if args.grid:
        if rank == 0:
            common.append_json_line(path, setup)
        return tune(args, wl, comm, numel, setup, path, log)
    plan = [(m, 1) for m in args.methods]
    if args.ddp_last and "ddp" in args.methods and len(args.methods) > 1:
        plan.append(("ddp", 2))                 # DDP first and last: drift within the launch shows
    runs = []
    for method, npass in plan:
        method_compute = measure_compute(wl, args, comm)
        rec = train(method, wl, args, comm, numel, target, log)
        rec.update({"launch": launch, "pass": npass, "compute_s": method_compute,
                    "comm_share": max(0.0, 1.0 - method_compute / rec["step_s"])})
        if method == "ddp" and target is None:
            target = setup["target"] = rec["target"] = rec["loss_at_steps"]
            hit = next(e for e in rec["evals"] if e[2] <= target)
            rec["time_to_target_s"], rec["steps_to_target"] = hit[1], hit[0]
        runs.append(rec)
        if rank == 0:
            if len(runs) == 1:         # after the first run, so that it carries ddp's target
                common.append_json_line(path, setup)
            common.append_json_line(path, rec)
        log(f"{method}: step {rec['step_s']:.3f} s, comm share {rec['comm_share']:.2f}, "
            f"time to target {rec['time_to_target_s']}, identical {rec['params_identical']}")
        comm.Barrier()
    if rank == 0:
        print(table(setup, runs))
        report([path], args.out)
    dist.destroy_process_group()
    return 0


def tune(args, wl, comm, numel, setup, path, log):
    """The learning-rate search: every method at every grid value for ``--steps`` (no target), a ``tune``
    record each; then ``choose_lrs`` over every tune record of the file and workload (so tuning seeds
    run as separate launches add up), written as a ``tuned`` record and ``DIR/tuned.json``."""
    import torch.distributed as dist

    import common
    from e2e_report import choose_lrs, read_records

    for method in args.methods:
        for lr in args.grid:
            args.lr_of = dict(args.lr_of, **{method: lr})
            rec = train(method, wl, args, comm, numel, None, log)
            tune_rec = {"kind": "tune", "launch": setup["launch"], "workload": args.workload, "method": method,
                        "lr": lr, "seed": args.seed, "steps": args.steps, "loss_at_steps": rec["loss_at_steps"],
                        "final_loss": rec["final_loss"], "step_s": rec["step_s"], "evals": rec["evals"],
                        "params_identical": rec["params_identical"], "diverged": rec["diverged"]}
            if comm.Get_rank() == 0:
                common.append_json_line(path, tune_rec)
            log(f"tune {method} lr {lr:g}: loss at {args.steps} {rec['loss_at_steps']}")
    if comm.Get_rank() == 0:
        try:
            tuned = choose_lrs(read_records([path]), args.workload)
        except ValueError as e:     # a short grid: this launch widens another's (--choose-lrs joins them)
            log(f"no tuned.json: {e}; join these tune records with the rest of the grid: --choose-lrs")
        else:
            common.append_json_line(path, tuned)
            common.write_json(os.path.join(args.out, "tuned.json"), tuned)
            log(f"tuned: {tuned['lr_of']}")
    dist.destroy_process_group()
    return 0


#: the static part of the results page that ``--report ... --docs`` writes above the generated tables
DOCS_HEADER = """# Time to accuracy on a shaped network

The question users ask of a compressor: does my model, trained the way I train it, reach its target
sooner on my network than with what I already run? `jobs/e2e.py` answers it on one model, from the
same initial weights, on the same batches, with the same optimiser, clipping and schedule for every
method, and every method at its own tuned learning rate. `jobs/testbed.py` gives it a real network
on one machine. This page is generated from the records (`python jobs/e2e.py --report RECORDS --docs
docs/e2e.md --readme README.md`); the earlier, withdrawn protocol (momentum SGD without clipping,
untuned baselines) is kept as history in `results/e2e/2026-11-25-sgd-protocol.md`.

```bash
bash jobs/run_e2e.sh --no-testbed --tune-lrs 1e-3,2e-3,4e-3 --seed 100 --out out/tune  # the search
bash jobs/run_e2e.sh --rate 1000 --tuned out/tune/tuned.json --seed 1 --out out/e2e     # held-out seed
bash jobs/run_e2e.sh --workload cnn --no-testbed --tune-lrs 0.025,0.05,0.1,0.2,0.4 --seed 100 --out out/cnn_tune
bash jobs/run_e2e.sh --workload cnn --rate 20 --tuned out/cnn_tune/tuned.json --seed 1 --out out/cnn
```

## The protocol

- **Tuning.** Every method searches the same learning-rate grid (LM: three values a factor 2
  apart; CNN: five) at the full step budget on a tuning seed (100), without link shaping (the loss after a given step
  does not depend on the link); the lowest validation loss at the budget wins (`tuned.json`, the
  `tune` and `tuned` records). Timed runs use other seeds (1, 2, 3). `ddp-bv` takes DDP's rate: the
  two compute the same bits (tested).
- **The LM as GPT users train it.** AdamW (betas 0.9, 0.95, weight decay 0.1), `clip_grad_norm_(...,
  1.0)` before every optimiser step for every method, 30 batches of linear warm-up, then a cosine to
  a tenth at the budget (600 batches of 8 sequences of 64 bytes per rank, P = 4). Model: the
  GPT-style byte-level transformer at d_model 128, 4 layers, 2 heads (834,304 parameters). The
  target is DDP's validation loss at the budget, on 512 held-out windows (32,768 predictions); the
  setup record carries a count-based interpolated trigram of the same split on the same predictions
  (the floor: a target above it measures the warm-up), and the tables say where the target lies.
- **Why a small model, and why 200 Mbit/s.** On these two cores the 10.8M-parameter GPT needs
  about 0.57 s a step and several hundred steps to pass the trigram; the search and three seeds
  would take days. What decides the outcome is the communication/compute ratio (gloo's dense
  allreduce seconds over the compute seconds of one step without communication; each table's
  setup records it). Small matrices run at a lower FLOP rate on a CPU, so this model's ratio at a
  given link rate is lower than the 10.8M model's; the links were set to 200 Mbit/s, where this
  model's ratio on the AMD EPYC VM (1.12) matched the 10.8M model's at 1 Gbit/s (0.95, 2026-11-25).
  On the Intel Xeon VM, whose compute is faster, it is 3.2–3.3 at 200 Mbit/s: a more link-bound
  regime than 1 Gbit/s, which favours the compressed methods against DDP. Launches at 700 Mbit/s
  (ratio 1.8: latency keeps the allreduce from scaling with the rate) are in
  `results/e2e/2026-11-29-regimes.md`. The LM's
  tables below are the 2026-11-29 launches at 200 Mbit/s, three held-out seeds, every method in
  each launch (`results/e2e/2026-11-29-regimes.md`). The slow end (20 and 2 Mbit/s) was timed
  without DDP, whose 600 batches take about 22 minutes at 20 Mbit/s here; those launches, against
  DDP's loss on the same seed, are in that narrative and in `docs/results.md`.
- **The CNN as CNNs are trained.** The digits CNN at width 48 (141,066 parameters), momentum SGD
  (0.9, weight decay 1e-4, no clipping, constant learning rate), 264 batches of 32 per rank at P = 4
  (24 epochs). The target is DDP's test cross-entropy at the budget on the 360 held-out images
  (accuracy beside in the records). At 8 epochs, the earlier budget, DDP's test loss is still
  falling by half and every sparsifier is in its transient (ExDyna 0.27 against DDP's 0.05 on the
  tuning seed: `results/e2e/2026-11-26-cnn-8-epochs/`), so the budget is 24 epochs. 360 images make
  the test loss near 0.05 noisy (one image moves it by several per cent), so the spread over
  seeds is wide: on the Intel VM `exdyna` reaches the target on seeds 1 and 2, on the AMD VM on
  seed 2 only, with the same rates and batches (the CPUs' last bits differ). Links at 20, 200 and
  2000 Mbit/s put its communication/compute ratio near 21, 2 and 0.55 on the Intel VM (8, 0.8 and
  0.08 on the AMD VM, whose convolutions are slower): the slow, middle and fast ends, every one
  measured.
- **Each budget its own search.** A method on a schedule of its own is tuned at that length, so
  the learning-rate tables come one per budget. `sloco-h16`'s choice (4e-3) lies at its grid's edge
  there; 8e-3 at 2,400 batches ends at 1.9503 against 4e-3's 1.7152
  (`results/e2e/2026-11-29-regimes/tune_sloco_8e-3`), so the choice stands.
- **Reading the tables.** "not reached": the method did not reach DDP's loss within 1.5x the budget
  (LM 900 batches, CNN 396); its loss at the budget, beside, says how far it was. Ratios above 1 are sooner than
  DDP. The learning-rate table marks a choice at the grid's edge, where a wider grid might help.
- **A budget of its own.** Local-step methods (DiLoCo, SparseLoCo's recipe) trade batches for
  bytes: they need more batches than DDP to reach its loss, each far cheaper on a slow link.
  `--steps-of METHOD=N` gives such a method its own schedule (the cosine ends at N) in the same
  launch, `--density-of METHOD=D` its own density; its rate is tuned at that budget (`--tuned`
  refuses a rate chosen at another), the target stays DDP's loss at DDP's budget, and the tables
  name the budget beside the method. Its loss at its budget is not comparable with DDP's; its time
  to target is. `--stop-at-target` ends each run at the target (no loss at the budget then).
- **Baselines as their documentation advises.** DDP with its default buckets and with
  `gradient_as_bucket_view=True`; DDP with gradient accumulation (4 batches per optimiser step, the
  budget counted in batches); torch's `bf16_compress_hook`; torch's `powerSGD_hook` (rank 4, error
  feedback and warm start, `start_powerSGD_iter` a tenth of the budget, one bucket: with several
  buckets it aborts or hangs on gloo); DiLoCo (H = 16 and 64 local AdamW steps, then the averaged
  parameter delta applied by Nesterov SGD, lr 0.7, momentum 0.9, as in the DiLoCo paper and
  torchft; the global parameters are evaluated). `exdyna` is `DistributedOptimizer(SGD,
  sparsifier="exdyna", density=0.01)` on the CNN with the library's defaults for momentum SGD
  (momentum correction and quotas). On the LM, `exdyna-demoage999` is `DistributedOptimizer(AdamW,
  sparsifier="exdyna", density=0.05)` with the AdamW default `adam="demo-age"` and `betas[0]` 0.999
  (the value the docs advise for it), on a 1,200-batch schedule of its own; `diloco-h64` is
  torchft's dense DiLoCo and `sloco-h16` the library's `DiLoCo("exdyna", density=0.03)`, each on
  2,400 batches of its own.
- **Measured, not composed.** Every time to target is a full run at the rate shown; each CNN
  launch runs DDP first and last (`ddp (again)`) and its ratios are taken against the mean of the
  two; the LM's launches run DDP once, first (`--no-ddp-last`). Ratios are always taken within a
  launch, and every run records `compute_s` (a step without communication, measured just before
  it) so drift is visible.
- **The link's bucket.** tbf lets what its bucket holds cross at the veth's speed after an idle
  moment, which a real link never does. Until 2026-11-28 the bucket was at least 256 KiB: 256 KiB
  of each rank's exchange a step crossed unshaped (0.1 s of link time at 20 Mbit/s, 10 ms at 200;
  the dense allreduce probe at 20 Mbit/s took 2.10 s, 2.44 s with a smaller bucket). Launches
  with it flattered a method by the share of its step the gain was, most for a few hundred kB a step
  on little compute (`adam="demo"` at 20 Mbit/s needed 1.9x its time once re-measured), little for
  DDP. A 16 KiB
  bucket followed, which still let a 15 kB exchange (ExDyna's on the CNN) cross in 0.4 ms instead
  of 6; the bucket is now 2 KiB, or a quarter millisecond of the rate where that is more. The CNN's
  tables come from launches re-measured on 2026-11-28 on the Intel Xeon VM: at 20 Mbit/s with the
  2 KiB bucket, at 200 and 2000 Mbit/s with 16 KiB (at 200 Mbit/s a 45 kB exchange gained 0.5 ms
  of a 30 ms step; at 2000 Mbit/s the bucket is the quarter millisecond either way). Narrative:
  `results/e2e/2026-11-28-rebucket.md`. The LM's launches ran on 2026-11-29 with a 6.1 KiB bucket
  at 200 Mbit/s (a quarter millisecond).

Machine: the 2-core Intel Xeon VM (every launch below; the LM's search on seed 100 partly on a
2-core AMD EPYC VM, as its records' `cpu` says), no GPU, Python 3.11, torch 2.13.0 (CPU), MPICH 5.0.2 wheel,
gloo for torch.distributed; 4 ranks on 2 cores, one torch thread each; every rank in its own network
namespace behind a `tc tbf`-shaped veth (no added delay).
"""


if __name__ == "__main__":
    sys.exit(main())
