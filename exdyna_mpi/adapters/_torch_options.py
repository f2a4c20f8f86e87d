"""Training-recipe options of ``DistributedOptimizer`` (issue 13): what sparse training needs besides
the sparsifier, after DGC (Lin et al., ICLR 2018). Every option is off by default, and with all of
them off nothing here runs: the optimizer steps exactly as before, bit for bit.

- ``clip_norm=c``: ``torch.nn.utils.clip_grad_norm_(params, c)`` on this rank's own gradient,
  before it enters the sparsifier (and its error-feedback accumulation). Local clipping, as DGC does.
- ``warmup_steps=n``: the first ``n`` steps exchange the dense average (the ``"dense"`` sparsifier,
  a ring allreduce of everything); the configured sparsifier starts at step ``n`` with a fresh
  residual, controller and iteration 0. The cheap, robust part of DGC's warm-up: dense training
  through the first, fastest-moving steps.
- ``momentum_correction=m`` (0 < m < 1): momentum is applied *before* the exchange, on each rank's
  own gradient, ``u <- m*u + g``, and ``u`` is what the sparsifier accumulates and sends (DGC's
  momentum correction: the residual then accumulates velocity, not raw gradient). The wrapped
  optimizer must run without momentum (``momentum=0``), else momentum would count twice.
  ``momentum_masking=True`` (default with it) zeroes ``u`` wherever the exchanged gradient is
  nonzero (the selected set, DGC's momentum-factor masking) so stale momentum does not push
  coordinates that were just sent. During a dense warm-up nothing is masked: averaging ``u`` densely
  is exactly momentum SGD on the averaged gradient.

State (step counter, velocity) goes into ``opt.state_dict()`` under ``"exdyna_options"`` so a
checkpoint resumes bit-exactly; with every option off the state dict is unchanged.
"""
import exdyna_mpi

OPTIONS_KEY = "exdyna_options"


class TrainingOptions:
    """The per-optimizer state and logic of the recipe options (see the module docstring)."""

    def __init__(self, params, numel, comm, *, clip_norm=None, warmup_steps=0, momentum_correction=0.0,
                 momentum_masking=True):
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"DistributedOptimizer: clip_norm must be > 0 or None, got {clip_norm!r}")
        if int(warmup_steps) != warmup_steps or warmup_steps < 0:
            raise ValueError(f"DistributedOptimizer: warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        m = float(momentum_correction or 0.0)
        if not 0.0 <= m < 1.0:
            raise ValueError(f"DistributedOptimizer: momentum_correction must be in [0, 1), got {momentum_correction!r}")
        self.params = params
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.warmup_steps = int(warmup_steps)
        self.momentum = m
        self.masking = bool(momentum_masking)
        self.active = self.clip_norm is not None or self.warmup_steps > 0 or m > 0.0
        self.step = 0            # steps exchanged through this optimizer (counted only when active)
        self.velocity = None     # momentum correction's u, allocated at the first step
        self.dense = exdyna_mpi.make("dense", numel, 1.0, comm) if self.warmup_steps else None

    def check_optimizer(self, optimizer):
        if self.momentum > 0 and any(g.get("momentum", 0) for g in optimizer.param_groups):
            raise ValueError("DistributedOptimizer: momentum_correction applies momentum before the exchange; "
                             "build the wrapped optimizer with momentum=0 (else momentum counts twice)")

    def sparsifier(self, main):
        """The sparsifier of this step: dense during the warm-up, ``main`` after."""
        return self.dense if self.step < self.warmup_steps else main

    def before(self, flat):
        """Clip, then momentum-correct ``flat`` (this rank's gradient) in place."""
        torch = _torch()
        if self.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip_norm)
        if self.momentum > 0:
            if self.velocity is None:
                self.velocity = torch.zeros_like(flat)
            self.velocity.mul_(self.momentum).add_(flat)
            flat.copy_(self.velocity)

    def after(self, out, dense_step):
        """Momentum-factor masking on the exchanged gradient ``out``; count the step."""
        if self.momentum > 0 and self.masking and not dense_step:
            self.velocity.masked_fill_(out != 0, 0.0)
        self.step += 1

    def state_dict(self):
        d = {"step": self.step, "velocity": None if self.velocity is None else self.velocity.clone()}
        if self.dense is not None:
            d["dense"] = self.dense.state_dict()
        return d

    def load_state_dict(self, d):
        self.step = int(d["step"])
        v = d["velocity"]
        self.velocity = None if v is None else v.detach().clone()
        if self.dense is not None and "dense" in d:
            self.dense.load_state_dict(d["dense"])


def _torch():
    import torch

    return torch
