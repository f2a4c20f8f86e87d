"""Training-recipe options of ``DistributedOptimizer`` and of the DDP hook given ``optimizer=``
(``ExDynaHookState``): what sparse training needs besides the sparsifier, after DGC (Lin et al.,
ICLR 2018). Both entry points build one ``Recipe`` with ``recipe_for`` and run it through one
``TrainingOptions``, over the same flat vector in the optimizer's parameter order, so they train
bit for bit alike. Every option but momentum correction for ExDyna is off by default, and with all
of them off nothing here runs: the optimizer steps exactly as before, bit for bit.

- ``clip_norm=c``: ``torch.nn.utils.clip_grad_norm_(params, c)``'s norm and scale on this rank's own
  gradient, before it enters the sparsifier (and its error-feedback accumulation). Local clipping,
  as DGC does; the DDP hook applies it to the model-wide vector (the same bits).
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
  ``momentum_correction="auto"`` (the default) applies a density rule for a sparsifier that
  declares the tuned defaults (ExDyna): the wrapped ``torch.optim.SGD``'s own momentum ``m`` moves
  before the exchange (the optimizer steps without it, inside ``momentum_moved``), as ``m`` for
  ``0.01 <= density < 0.02`` and ``min(m, 0.8)`` below (a high momentum before the exchange is less
  stable at the lowest densities), and with it ExDyna's per-rank quotas ``max_imbalance=0.2``
  unless ``max_imbalance`` is given. From ``density >= 0.02`` it is off: masking resets the velocity
  of every coordinate sent, and at high density most useful ones are sent every step, so they would
  step without momentum. It is also off (as 0) for every other sparsifier (the baselines stay as
  their papers run them), for another optimizer, SGD without momentum, with Nesterov or dampening,
  and param groups of different momenta. ``momentum_correction=0`` keeps the optimizer's own
  momentum after the exchange. The measurements behind the rule and its thresholds:
  docs/controller.md and docs/training.md.
- ``density_warmup=(d1, d2, ...)`` with ``density_warmup_steps=n``: DGC's decaying-density warm-up
  (25 %, 6.25 %, 1.5625 %, 0.4 % over the first epochs, then the target). After any dense warm-up,
  stage ``i`` runs ``n`` steps with a sparsifier of the configured kind and options at density
  ``d_i`` (each in (0, 1] and above the target ``density``), made when the stage starts (the
  previous one is dropped); then the configured sparsifier. The error-feedback residual carries from
  stage to stage and into the configured sparsifier, as in DGC: it is added to the first gradient
  the next sparsifier steps on (after clipping and momentum correction: it is residual, not
  gradient). Its residual is still zero then and its first step computes
  ``acc = 0 + (grad + carried)``, the same bits as a residual loaded with ``carried`` would give
  (``carried + grad``: IEEE addition commutes, and ``0 + x == x`` up to the sign of an exact zero),
  on any device (a DLPack view of the old buffer, no host round trip), for every sparsifier kind,
  with nothing new in the sparsifier. The carry is dropped only after a step of the new sparsifier
  completes: a refused or skipped step (``nonfinite="skip"``) hands it on again.

State (step counter, velocity, the live stage's sparsifier and a pending carry) goes into
``opt.state_dict()`` under ``"exdyna_options"`` so a checkpoint resumes bit-exactly; with every
option off the state dict is unchanged.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from numbers import Real
from typing import Any

import numpy as np

import exdyna_mpi
from exdyna_mpi import transport

from ._torch_common import _torch
from .torch_adam import tuned_defaults

OPTIONS_KEY = "exdyna_options"
#: ``momentum_correction="auto"``: below ``AUTO_DENSITY`` the moved momentum is at most ``AUTO_LOW``;
#: from ``AUTO_OFF`` on nothing moves; with it, ExDyna's quotas default to ``AUTO_MAX_IMBALANCE``
AUTO_DENSITY, AUTO_LOW, AUTO_OFF, AUTO_MAX_IMBALANCE = 0.01, 0.8, 0.02, 0.2


def auto_momentum(optimizer, sparsifier, density):
    """The momentum ``momentum_correction="auto"`` moves before the exchange: the density rule on the
    wrapped SGD's momentum (module docstring), 0.0 where nothing moves. Changes nothing: the
    optimizer steps without its own momentum inside ``momentum_moved`` only."""
    groups = optimizer.param_groups
    momenta = {float(g.get("momentum", 0.0) or 0.0) for g in groups}
    if (not tuned_defaults(sparsifier) or not isinstance(optimizer, _torch().optim.SGD) or len(momenta) != 1
            or any(g.get("nesterov") or g.get("dampening", 0) for g in groups) or not isinstance(density, Real)
            or density >= AUTO_OFF):
        return 0.0
    m = momenta.pop()
    return m if density >= AUTO_DENSITY else min(m, AUTO_LOW)


def auto_options(options):
    """ExDyna's options once ``momentum_correction="auto"`` moved the momentum: its quotas
    (``max_imbalance=0.2``) unless ``max_imbalance`` is given or the controller is not the measured
    one (quotas need it). The evidence for the pair: docs/controller.md, "The defaults"."""
    if "max_imbalance" in options or options.get("controller", "measured") != "measured":
        return options
    return dict(options, max_imbalance=AUTO_MAX_IMBALANCE)


def take_momentum(optimizer, recipe: "Recipe | None"):
    """Take the momentum the recipe moved before the exchange out of the optimizer's param groups,
    for its step; returns the groups' own values for ``give_back_momentum`` (None: nothing taken).
    Only for the step: the user's optimizer state (and every checkpoint of it) keeps the user's
    momentum, so a run resumed in torch's usual order (optimizer state loaded before the entry point
    is built) resolves ``"auto"`` as the first did."""
    if recipe is None or not recipe.moves_momentum:
        return None
    saved = [g.get("momentum", 0.0) for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["momentum"] = 0.0
    return saved


def give_back_momentum(optimizer, saved) -> None:
    """The param groups' own momentum back (``take_momentum``'s return)."""
    for g, m in zip(optimizer.param_groups, saved):
        g["momentum"] = m


@contextmanager
def momentum_moved(optimizer, recipe: "Recipe | None"):
    """Inside: the optimizer steps without the momentum the recipe moved (``take_momentum``); its
    param groups get their values back on exit."""
    saved = take_momentum(optimizer, recipe)
    try:
        yield
    finally:
        if saved is not None:
            give_back_momentum(optimizer, saved)


@dataclass(frozen=True, eq=False)
class Recipe:
    """The recipe options of one entry point, checked and with ``"auto"`` resolved: what
    ``TrainingOptions`` runs. Holds no communicator and no state; ``recipe_for`` builds it.

    Attributes:
        clip_norm: local clipping norm, or None.
        warmup_steps: dense steps before the sparsifier starts.
        momentum: momentum applied before the exchange (0.0: off).
        masking: momentum-factor masking with it.
        stages: the density warm-up's densities (empty: off); ``stage_steps`` steps each.
        options: the sparsifier's options (with the quotas ``"auto"`` adds).
        moves_momentum: whether ``"auto"`` takes the optimizer's own momentum (``momentum_moved``).
    """
    clip_norm: float | None
    warmup_steps: int
    momentum: float
    masking: bool
    stages: tuple[float, ...]
    stage_steps: int | None
    sparsifier: str
    density: float
    options: dict[str, Any]
    moves_momentum: bool

    @property
    def active(self) -> bool:
        """Whether any option is on (off: the step is the sparsifier's alone, bit for bit)."""
        return self.clip_norm is not None or self.warmup_steps > 0 or self.momentum > 0.0 or bool(self.stages)

    def items(self) -> dict[str, str]:
        """What changes the bits, as configuration items (``_torch_config.EntryConfig``): the
        sparsifier, its density and options, and every recipe option as resolved."""
        out = {"sparsifier": self.sparsifier, "density": repr(self.density)}
        out.update((f"option.{k}", repr(v)) for k, v in sorted(self.options.items()))
        out.update({"recipe.clip_norm": repr(self.clip_norm), "recipe.warmup_steps": repr(self.warmup_steps),
                    "recipe.momentum_correction": repr(self.momentum), "recipe.momentum_masking": repr(self.masking),
                    "recipe.density_warmup": repr(self.stages), "recipe.density_warmup_steps": repr(self.stage_steps)})
        return out


def recipe_for(optimizer, sparsifier, density, options, *, who, clip_norm=None, warmup_steps=0,
               momentum_correction="auto", momentum_masking=True, density_warmup=None,
               density_warmup_steps=None) -> Recipe:
    """The recipe ``optimizer`` gets with these options (module docstring), checked. Changes
    nothing (the optimizer steps inside ``momentum_moved``).

    Args:
        optimizer: the user's ``torch.optim`` optimizer (read for ``"auto"`` and the momentum check).
        sparsifier, density, options: the sparsifier's name, density and options.
        who: the entry point's name, for messages.

    Returns:
        The ``Recipe``.

    Raises:
        ValueError: an option out of range, or momentum that would count twice.
    """
    if clip_norm is not None and not clip_norm > 0:
        raise ValueError(f"{who}: clip_norm must be > 0 or None, got {clip_norm!r}")
    if isinstance(warmup_steps, bool) or int(warmup_steps) != warmup_steps or warmup_steps < 0:
        raise ValueError(f"{who}: warmup_steps must be an integer >= 0, got {warmup_steps!r}")
    auto = isinstance(momentum_correction, str) and momentum_correction == "auto"
    moves = False
    if auto:   # the rule decides; where it moves the momentum, ExDyna's quotas come with it
        m = auto_momentum(optimizer, sparsifier, density)
        moves = m > 0
        if moves:
            options = auto_options(options)
    else:
        m = float(momentum_correction or 0.0) if isinstance(momentum_correction, (Real, type(None))) else -1.0
        if not 0.0 <= m < 1.0:
            raise ValueError(f"{who}: momentum_correction must be in [0, 1) or 'auto', got {momentum_correction!r}")
        if m > 0 and any(g.get("momentum", 0) for g in optimizer.param_groups):
            raise ValueError(f"{who}: momentum_correction applies momentum before the exchange; "
                             "build the wrapped optimizer with momentum=0 (else momentum counts twice)")
    stages, stage_steps = _density_stages(density_warmup, density_warmup_steps, density, who)
    return Recipe(clip_norm=None if clip_norm is None else float(clip_norm), warmup_steps=int(warmup_steps),
                  momentum=m, masking=bool(momentum_masking), stages=stages, stage_steps=stage_steps,
                  sparsifier=sparsifier, density=density, options=dict(options), moves_momentum=moves)


#: the recipe options and their defaults (as ``recipe_for`` takes them, and both entry points)
RECIPE_DEFAULTS = {name: p.default for name, p in inspect.signature(recipe_for).parameters.items()
                   if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not inspect.Parameter.empty}


class TrainingOptions:
    """The state and logic of a ``Recipe`` over one flat gradient (see the module docstring).

    Args:
        recipe: what to run (``recipe_for``).
        shapes: the parameters' shapes in the flat gradient's order (clipping's per-parameter norms).
        numel: the flat gradient's length.
        comm: the communicator of the sparsifiers it makes (the dense warm-up, the density stages).
        who: the entry point's name, for messages.
    """

    def __init__(self, recipe: Recipe, shapes, numel: int, comm, who: str = "DistributedOptimizer") -> None:
        self.recipe, self.who = recipe, who
        self.shapes = [tuple(s) for s in shapes]
        self.numel = numel
        self.clip_norm = recipe.clip_norm
        self.warmup_steps = recipe.warmup_steps
        self.momentum = recipe.momentum
        self.masking = recipe.masking
        self.stages, self.stage_steps = recipe.stages, recipe.stage_steps
        self.active = recipe.active
        self.step = 0            # steps exchanged through this object (counted only when active)
        self.velocity = None     # momentum correction's u, allocated at the first step
        self._velocity_next = None   # this step's u, the velocity once the step is agreed and not skipped
        self.dense = exdyna_mpi.make("dense", numel, 1.0, comm) if self.warmup_steps else None
        self._make_stage = lambda d: exdyna_mpi.make(recipe.sparsifier, numel, d, comm, **recipe.options)
        self._exchange = transport.Exchange(comm)
        self.stage: Any = None   # the live density warm-up sparsifier, and its index in ``stages``
        self.stage_index: int | None = None
        self.carry = None        # a residual not yet handed to the sparsifier that follows
        self._views_of: tuple[Any, list] = (None, [])

    def close(self) -> None:
        """Close the sparsifiers this object made (collective in deadline mode)."""
        for sp in (self.dense, self.stage):
            if sp is not None:
                sp.close()

    def sparsifier(self, main):
        """The sparsifier of this step: dense warm-up, then the density stages, then ``main``."""
        if self.step < self.warmup_steps:
            return self.dense
        i = (self.step - self.warmup_steps) // self.stage_steps if self.stages else 0
        if i < len(self.stages):
            if i != self.stage_index:
                self._leave(self.stage)
                self.stage, self.stage_index = self._make_stage(self.stages[i]), i   # collective
            return self.stage
        if self.stage is not None:
            self._leave(self.stage)
            self.stage, self.stage_index = None, None
        return main

    def _leave(self, sp):
        """Keep ``sp``'s residual (a view: ``sp`` never steps again) for the next sparsifier. One that
        never completed a step holds nothing new: an older pending carry stays."""
        if sp is not None and sp.iteration > 0:
            r = sp.memory.residual   # None: loaded from a checkpoint and left before a step (on the host)
            self.carry = _torch().from_dlpack(r) if r is not None else _torch().from_numpy(sp.residual)

    def exchange(self, main, flat, prepare=None):
        """This step's exchange of ``flat`` (this rank's gradient) in place, inside the recipe: the
        step's sparsifier (``sparsifier(main)``), ``before``, ``prepare(flat, dense)`` (an Adam path
        turning the gradient into its exchanged units; ``dense``: a warm-up step), the exchange,
        ``after``. Both entry points run their step through here, so they exchange the same bits.

        Returns:
            The sparsifier that ran (its ``stats`` are the step's).
        """
        if not self.active and prepare is None:   # no recipe: the sparsifier's step alone, bit for bit
            main.step(flat, out=flat)
            return main
        sp = self.sparsifier(main) if self.active else main
        if self.active:
            self.before(flat)
        if prepare is not None:
            prepare(flat, sp is self.dense)
        sp.step(flat, out=flat)
        if self.active:
            self.after(flat, sp)
        return sp

    def before(self, flat):
        """Clip, then momentum-correct ``flat`` (this rank's gradient) in place; add a pending carry."""
        torch = _torch()
        if self.clip_norm is not None:
            self._clip(flat)
        if self.momentum > 0:
            if self.velocity is None:
                self.velocity = torch.zeros_like(flat)
            elif self.velocity.device != flat.device:   # loaded from a host copy
                self.velocity = self.velocity.to(flat.device)
            nxt = self._velocity_next
            if nxt is None or nxt.device != flat.device or nxt.dtype != flat.dtype:
                nxt = self._velocity_next = torch.empty_like(flat)
            # into the spare buffer: a refused or skipped step (a NaN on some rank) leaves u as it was
            torch.mul(self.velocity, self.momentum, out=nxt).add_(flat)
            flat.copy_(nxt)
        if self.carry is not None:
            flat.add_(self.carry.to(flat.device))

    def _clip(self, flat):
        """``torch.nn.utils.clip_grad_norm_`` on the parameters' gradients as views of ``flat``
        (the same norm and scale, whether the parameters' ``.grad`` are those views, as in
        ``DistributedOptimizer``, or not, as in the DDP hook's model-wide vector)."""
        torch = _torch()
        key = (flat.data_ptr(), flat.numel(), flat.dtype)
        if self._views_of[0] != key:
            views, off = [], 0
            for shape in self.shapes:
                n = int(np.prod(shape, dtype=np.int64))
                views.append(flat[off:off + n].view(shape))
                off += n
            self._views_of = (key, views)
        views = self._views_of[1]
        total = torch.nn.utils.get_total_norm(views)
        coef = torch.clamp(self.clip_norm / (total + 1e-6), max=1.0)   # torch's clip_grads_with_norm_
        flat.mul_(coef.to(flat.device))

    def after(self, out, sp):
        """After a step every rank completed: commit this step's velocity, with momentum-factor
        masking on the exchanged gradient ``out`` (not after a dense step); drop the carry once
        ``sp`` holds it; count the step. A skipped step (``nonfinite="skip"``) changes nothing."""
        if sp.stats.skipped:
            return
        if self.momentum > 0:
            self.velocity, self._velocity_next = self._velocity_next, self.velocity
            if self.masking and sp is not self.dense:
                self.velocity.masked_fill_(out != 0, 0.0)
        self.carry = None
        self.step += 1

    def state_dict(self):
        d = {"step": self.step, "velocity": None if self.velocity is None else self.velocity.clone()}
        if self.dense is not None:
            d["dense"] = self.dense.state_dict()
        if self.stages:
            d.update(stage=self.stage_index, stage_state=None if self.stage is None else self.stage.state_dict(),
                     carry=None if self.carry is None else self.carry.clone())
        return d

    def load_state_dict(self, d):
        """Collective (the live stage's sparsifier is made and loaded on every rank), all or nothing:
        every rank checks its dict before one agreement; a problem on any rank raises the same
        ``ValueError`` on every rank, naming it, and nothing changes."""
        problem = None
        try:
            step, stage = check_state(d, self.recipe, self.numel)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            problem, step, stage = f"exdyna_options is malformed ({e})", -1, None
        got = transport.agree_problems(self._exchange, problem, f"{self.who}.load_state_dict refused",
                                       [step, -1 if stage is None else int(stage)])
        if (got != got[0]).any():   # else ranks would build different sparsifiers and hang
            raise exdyna_mpi.CollectiveError(f"{self.who}.load_state_dict: ranks hold different recipe steps/stages "
                                             f"{got.tolist()} (checkpoints of different steps?)")
        self.step = step
        v = d["velocity"]
        self.velocity = None if v is None else v.detach().clone()
        if self.dense is not None and "dense" in d:
            self.dense.load_state_dict(d["dense"])
        if self.stages:
            self.stage, self.stage_index = None, None
            if stage is not None:
                self.stage, self.stage_index = self._make_stage(self.stages[stage]), int(stage)
                self.stage.load_state_dict(d["stage_state"])
            c = d.get("carry")
            self.carry = None if c is None else c.detach().clone()


def check_state(d, recipe: Recipe, numel: int):
    """``(step, stage)`` of a ``TrainingOptions.state_dict()`` output after this rank's checks (no
    communication). Raises ``KeyError``/``TypeError``/``ValueError`` on a dict that cannot load."""
    step = int(d["step"])
    stage = d.get("stage") if recipe.stages else None
    if stage is not None and not 0 <= int(stage) < len(recipe.stages):
        raise ValueError(f"the dict is in density_warmup stage {stage}, this optimizer has "
                         f"{len(recipe.stages)} stages")
    for key in ("velocity",) + (("carry",) if recipe.stages else ()):
        v = d.get(key)
        if v is not None and tuple(v.shape) != (numel,):
            raise ValueError(f"exdyna_options.{key} has shape {tuple(v.shape)}, the model {numel} elements")
        if v is not None and not bool(_torch().isfinite(v).all()):
            raise ValueError(f"exdyna_options.{key} holds non-finite values")
    return step, None if stage is None else int(stage)


def _density_stages(stages, steps, density, who):
    """``(tuple of stage densities, steps per stage)`` after the checks; ``((), None)`` when off."""
    if stages is None:
        if steps is not None:
            raise ValueError(f"{who}: density_warmup_steps={steps!r} given without density_warmup")
        return (), None
    if not isinstance(stages, (tuple, list)) or not stages:
        raise ValueError(f"{who}: density_warmup must be a non-empty tuple or list of densities, got {stages!r}")
    if steps is None:
        raise ValueError(f"{who}: density_warmup needs density_warmup_steps (steps per stage), an integer >= 1")
    if isinstance(steps, bool) or not isinstance(steps, Real) or int(steps) != steps or steps < 1:
        raise ValueError(f"{who}: density_warmup_steps must be an integer >= 1, got {steps!r}")
    target = float(density) if isinstance(density, Real) else 0.0   # a bad density: make() names it
    for d in stages:
        if isinstance(d, bool) or not isinstance(d, Real) or not (target < d <= 1.0):
            raise ValueError(f"{who}: every density_warmup density must be a number in (density, 1] = "
                             f"({target:g}, 1], got {d!r} in {stages!r}")
    return tuple(float(d) for d in stages), int(steps)

