"""PyTorch adapter: sparse gradient exchange in two lines, Horovod style.

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    opt = exdyna_mpi.adapters.torch.DistributedOptimizer(opt, model, sparsifier="exdyna", density=0.01)

How it works (no copies on the hot path):
- every parameter's ``.grad`` is a view into one flat buffer (``FlatGrad``), so ``backward()``
  accumulates straight into it;
- ``opt.step()`` first calls ``sparsifier.step(flat, out=flat)``: the buffer is replaced, in place,
  by the averaged sparse gradient (error feedback on the raw gradient inside the sparsifier), then
  the wrapped optimizer runs, so its momentum and weight decay act on the aggregated gradient, as in
  the authors' training scripts (kljp/exdyna);
- ``opt.zero_grad()`` zeroes the flat buffer (it never sets ``.grad`` to None, which would make the
  next ``backward()`` allocate fresh tensors outside the buffer).

Construction broadcasts rank 0's parameters (and buffers) so every rank starts identical. All of it
is collective over ``comm``. torch is imported lazily, so ``import exdyna_mpi`` never imports it.

For ``DistributedDataParallel``, a communication hook instead (``_torch_hook.py``)::

    ddp.register_comm_hook(exdyna_mpi.adapters.torch.ExDynaHookState("exdyna", density=0.01),
                           exdyna_mpi.adapters.torch.exdyna_hook)
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import exdyna_mpi

from ._torch_common import (_broadcast_model, _flat_layout, _from_torch, _OptimizerMixinBase, _to_torch, _torch, _wrap,
                            _wrapped_params, broadcast_parameters)
from ._torch_adam import ADAM_KEY, AdamPath, make_adam_path
from ._torch_adam import check_mode as check_adam_mode
from ._torch_hook import ExDynaHookState, exdyna_hook
from ._torch_options import OPTIONS_KEY, TrainingOptions, move_momentum, recipe_for
from .torch_diloco import DiLoCo, nesterov_sgd, plain_sgd
from .torch_wagma import FlatParams, GroupAveragingOptimizer

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI

__all__ = ["DiLoCo", "DistributedOptimizer", "ExDynaHookState", "FlatGrad", "FlatParams", "GroupAveragingOptimizer",
           "broadcast_parameters", "exdyna_hook", "nesterov_sgd", "plain_sgd"]


class FlatGrad:
    """One contiguous gradient buffer; each parameter's ``.grad`` is a view into it.

    Args:
        params: the parameters (those that require grad), of one dtype and device.

    Raises:
        ValueError: no parameter requires grad, or they differ in dtype or device.

    Example::

        >>> fg = FlatGrad(model.parameters())
        >>> loss.backward()                 # accumulates into fg.flat
        >>> sp.step(fg.flat, out=fg.flat)   # averaged sparse gradient, in place
    """

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        torch = _torch()
        self.params, self.numel = _flat_layout(params, "FlatGrad")
        self.flat = torch.zeros(self.numel, dtype=self.params[0].dtype, device=self.params[0].device)
        self._views: list[Any] = []
        self._ptrs: list[int] = []
        off = 0
        for p in self.params:
            n = p.numel()
            self._views.append(self.flat[off:off + n].view_as(p))
            off += n
        self.attach()

    def attach(self) -> None:
        """Point every ``.grad`` at its view (after someone replaced or dropped it)."""
        for p, v in zip(self.params, self._views):
            if p.grad is None or p.grad.data_ptr() != v.data_ptr():
                if p.grad is not None:
                    with _torch().no_grad():
                        v.copy_(p.grad)  # keep a gradient computed outside the buffer
                else:
                    v.zero_()
                p.grad = v

    def zero(self) -> None:
        """Zero the flat buffer and point every ``.grad`` back at its view."""
        self.flat.zero_()
        self.attach()


_SPARSIFIER_KEY = "exdyna_sparsifier"


def _from_torch_keep_tensors(d):
    """The recipe options' state: velocity and carry stay tensors, the sparsifiers' states go to NumPy."""
    d = dict(d)
    for key in ("dense", "stage_state"):
        if d.get(key) is not None:
            d[key] = _from_torch(d[key])
    return d


def _stats_of(sp: exdyna_mpi.Sparsifier) -> exdyna_mpi.Stats:
    """The stats of the step ``sp`` just took (set by every completed or skipped step)."""
    assert sp.stats is not None
    return sp.stats


class _DistributedMixin(_OptimizerMixinBase):
    """Methods put in front of the wrapped optimizer's class (see ``DistributedOptimizer``)."""

    # set by ``DistributedOptimizer`` through ``_wrap`` on the wrapped instance
    _exdyna_grads: FlatGrad
    sparsifier: exdyna_mpi.Sparsifier
    _exdyna_options: TrainingOptions
    _exdyna_moved_momentum: bool
    _exdyna_adam: AdamPath | None
    _exdyna_last: exdyna_mpi.Sparsifier

    def synchronize(self) -> exdyna_mpi.Stats:
        """Replace the flat gradient by the averaged sparse gradient, in place. Collective.

        Returns:
            The stats of the exchange that ran (the live warm-up stage's, if any).

        Raises:
            StepError: the exchange refused the step (on every rank; say, NaN in one rank's gradient).
        """
        torch = _torch()
        self._exdyna_grads.attach()
        flat, opts, adam = self._exdyna_grads.flat, self._exdyna_options, self._exdyna_adam
        prepare = None if adam is None else (lambda g, dense: adam.prepare(self, g, dense))
        with torch.no_grad():
            sp = opts.exchange(self.sparsifier, flat, prepare)   # _torch_options.py, _torch_adam.py
        self._exdyna_last = sp
        return _stats_of(sp)

    def step(self, closure: None = None) -> Any:   # type: ignore[override]  # no closures
        """``synchronize()``, then the wrapped optimizer's step (momentum, weight decay, ...). Collective.

        Args:
            closure: must be None (a closure would re-evaluate the loss between exchanges).

        Returns:
            The wrapped optimizer's ``step()`` result (None when ``adam=`` steps the parameters itself).

        Raises:
            ValueError: a closure was given.
            StepError: the exchange refused the step (on every rank).
        """
        if closure is not None:
            raise ValueError("DistributedOptimizer.step: closures are not supported "
                             "(the gradient exchange must happen once per step)")
        stats = self.synchronize()
        adam = self._exdyna_adam
        if adam is not None and adam.owns_step:
            adam.apply(self._exdyna_grads.flat, stats.skipped, self._exdyna_last)
            return None
        return super().step()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the flat gradient buffer; ``.grad`` stays a view into it.

        Args:
            set_to_none: ignored: ``.grad`` must stay a view into the buffer.
        """
        self._exdyna_grads.zero()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state plus this rank's sparsifier state.

        The sparsifier's state (residual, controller, layout, iteration) is under
        ``"exdyna_sparsifier"``, as tensors and plain Python values, so
        ``torch.save(opt.state_dict(), f"ckpt.{rank}")`` and ``torch.load`` (``weights_only=True``
        included) round-trip it. Every rank saves its own: the residuals differ between ranks.

        Returns:
            The state dict (the recipe's state under ``"exdyna_options"`` and the Adam path's under
            ``"exdyna_adam"`` when they are on).
        """
        d = super().state_dict()
        d[_SPARSIFIER_KEY] = _to_torch(self.sparsifier.state_dict())
        if self._exdyna_options.active:
            d[OPTIONS_KEY] = _to_torch(self._exdyna_options.state_dict())
        if self._exdyna_adam is not None:
            d[ADAM_KEY] = self._exdyna_adam.state_dict()
        return d

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output; resumes bit-exactly.

        Collective over the sparsifier's communicator: every rank loads its own rank's dict, and a
        mismatch (other P, sparsifier, density or rank) raises the same ``ValueError`` on every rank
        before anything changes.

        Args:
            state_dict: this rank's ``state_dict()`` output.

        Raises:
            ValueError: this rank's dict lacks the sparsifier's state, or the recipe's or the Adam
                path's state that this optimizer runs.
            CollectiveError: any rank's dict is refused (a ``ValueError``, on every rank); nothing changes.
        """
        state_dict = dict(state_dict)
        sp_state = state_dict.pop(_SPARSIFIER_KEY, None)
        opt_state = state_dict.pop(OPTIONS_KEY, None)
        adam_state = state_dict.pop(ADAM_KEY, None)
        adam = self._exdyna_adam
        if adam is not None and adam_state is None:   # same config on every rank: all raise
            raise ValueError(f"DistributedOptimizer.load_state_dict: this optimizer runs adam={adam.mode!r} "
                             f"but the dict has no {ADAM_KEY!r}")
        if self._exdyna_options.active and opt_state is None:   # same config on every rank: all raise
            raise ValueError("DistributedOptimizer.load_state_dict: this optimizer uses recipe options "
                             "(clip_norm/warmup_steps/momentum_correction/density_warmup) "
                             f"but the dict has no {OPTIONS_KEY!r}")
        if sp_state is None:
            raise ValueError("DistributedOptimizer.load_state_dict: no sparsifier state in this dict "
                             f"(key {_SPARSIFIER_KEY!r}); it was not saved by DistributedOptimizer.state_dict()")
        sp_state = _from_torch(sp_state)
        if adam is not None:
            try:
                adam.check(adam_state)
            except ValueError as e:   # refused on this rank: the collective check below makes all raise
                sp_state = dict(sp_state, name=f"<{e}>")
        before = copy.deepcopy(super().state_dict())
        # the sparsifier's state, to roll back to if the recipe options refuse after it loaded
        sp_before = self.sparsifier.state_dict() if self._exdyna_options.active else None
        try:
            super().load_state_dict(state_dict)
            if self._exdyna_moved_momentum:   # a dict saved before the momentum moved must not bring it back
                move_momentum(self)
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            # a local refusal must still reach the collective check, so every rank raises together
            sp_state = dict(sp_state, name=f"<optimizer state refused on this rank: {e}>")
        try:
            self.sparsifier.load_state_dict(sp_state)
        except Exception:
            super().load_state_dict(before)   # leave this rank exactly as it was
            raise
        if self._exdyna_options.active:
            opts_before = self._exdyna_options.state_dict()
            try:   # refusals here are collective (agreed), so every rank rolls back together
                self._exdyna_options.load_state_dict(_from_torch_keep_tensors(opt_state))
            except ValueError:
                self._exdyna_options.load_state_dict(opts_before)
                assert sp_before is not None   # taken whenever the options are active
                self.sparsifier.load_state_dict(sp_before)
                super().load_state_dict(before)
                raise
        if adam is not None:
            flat = self._exdyna_grads.flat
            adam.load_state_dict({k: v.to(flat.device) if hasattr(v, "to") else v for k, v in adam_state.items()})

    @property
    def stats(self) -> exdyna_mpi.Stats | None:
        """The last step's sparsifier stats (``counts``, ``density``, ``bytes_sent``, ...); None before it."""
        return getattr(self, "_exdyna_last", self.sparsifier).stats

    @property
    def flat_grad(self) -> torch.Tensor:
        """The flat gradient buffer that every ``.grad`` is a view into."""
        return self._exdyna_grads.flat


def DistributedOptimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None, *,
                         sparsifier: str = "exdyna", density: float = 0.01, comm: MPI.Comm | None = None,
                         broadcast: bool = True, clip_norm: float | None = None, warmup_steps: int = 0,
                         momentum_correction: float | str = "auto", momentum_masking: bool = True,
                         density_warmup: Sequence[float] | None = None, density_warmup_steps: int | None = None,
                         adam: str = "live", **options: Any) -> torch.optim.Optimizer:
    """Wrap a torch optimizer so ``step()`` exchanges a sparse gradient first. Collective.

    ``model`` (optional): a ``torch.nn.Module`` whose parameters and buffers are broadcast from rank
    0; without it the optimizer's parameters are used. ``sparsifier``: any name of
    ``exdyna_mpi.available()`` (``"dense"`` is the allreduce baseline); ``options`` go to it. The
    result is an instance of a subclass of the optimizer's class (so LR schedulers accept it) sharing
    its state; use it in place of the original. ``opt.sparsifier`` and ``opt.stats`` give the
    sparsifier and its last stats.

    Training-recipe options (see ``_torch_options.py``; off, the step is bit-identical to having
    none): ``momentum_correction="auto"`` (the default) with ``momentum_masking``: for ExDyna with an
    SGD of momentum ``m``, DGC's momentum correction and momentum-factor masking, the momentum moved
    before the exchange, ``m`` for 0.01 <= d < 0.02 and ``min(m, 0.8)`` below (the optimizer's own
    momentum becomes 0), and with it ExDyna's ``max_imbalance=0.2`` unless given; off from d = 0.02
    and for other sparsifiers and optimizers; a number ``m`` sets it (wrap an optimizer
    with ``momentum=0``), ``0`` turns it off. Off by default: ``clip_norm`` (clip this rank's
    gradient before accumulation), ``warmup_steps`` (dense exchange for the first steps),
    ``density_warmup=(d1, d2, ...)`` with ``density_warmup_steps=n`` (DGC's decaying-density warm-up:
    after any dense warm-up, ``n`` steps at each density ``d_i`` > ``density`` with a fresh sparsifier
    of the same kind and options, the error-feedback residual carried from stage to stage and into
    the configured sparsifier; ``opt.stats`` shows the live stage's stats).

    ``adam`` (for ``torch.optim.Adam``/``AdamW``; see ``_torch_adam.py``): ``"live"`` (the default)
    exchanges the raw gradient and lets the wrapped optimizer update its moments from the sparse
    average; ``"update"`` runs Adam's moments on each rank's own gradient and exchanges the update
    they give, with error feedback, then applies the average on every rank (the wrapped optimizer's
    ``lr``, betas, eps and weight decay; its own ``state`` is not used); ``"frozen"`` runs
    ``warmup_steps`` (required, >= 1) dense steps of exact Adam, then freezes the second moment,
    exchanges the gradient divided by it (selection by update size) with error feedback and applies
    Adam with the frozen variance; ``"frozen-gradient"`` the same with the division after the
    exchange; ``"demo"`` is DeMo's decoupled momentum: the sparsifier's residual is the momentum
    (decayed by ``betas[0]`` after each exchange), and every rank applies ``lr * sign`` of the
    exchanged average after AdamW's decay (no second moment).

    Args:
        optimizer: the ``torch.optim`` optimizer to wrap (its state is shared, not copied).
        model: a module whose parameters and buffers rank 0 broadcasts (optional).
        sparsifier, density, **options: the sparsifier (``exdyna_mpi.make``).
        comm: the communicator (``MPI.COMM_WORLD`` when None).
        broadcast: broadcast rank 0's parameters at construction.
        clip_norm, warmup_steps, momentum_correction, momentum_masking, density_warmup,
            density_warmup_steps: the training recipe (above; docs/reference.md).
        adam: the Adam path (above), for ``torch.optim.Adam``/``AdamW`` only.

    Returns:
        The optimizer, now an instance of a subclass of its class whose ``step()`` exchanges first.

    Raises:
        ValueError: a recipe option or ``adam`` out of range or not for this optimizer;
            ``CollectiveError`` (on every rank) when the ranks' arguments disagree.

    Example::

        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> opt = DistributedOptimizer(opt, model, sparsifier="exdyna", density=0.01)
        >>> for x, y in batches:
        ...     opt.zero_grad()
        ...     loss_fn(model(x), y).backward()
        ...     opt.step()
        >>> opt.stats.density, opt.stats.bytes_sent
    """
    comm, params = _wrapped_params(optimizer, model, comm, "DistributedOptimizer")
    check_adam_mode(optimizer, adam, warmup_steps, "DistributedOptimizer")
    grads = FlatGrad(params)
    adam_path = make_adam_path(optimizer, grads.params, adam)
    recipe = recipe_for(optimizer, sparsifier, density, options, who="DistributedOptimizer", clip_norm=clip_norm,
                        warmup_steps=warmup_steps, momentum_correction=momentum_correction,
                        momentum_masking=momentum_masking, density_warmup=density_warmup,
                        density_warmup_steps=density_warmup_steps)
    opts = TrainingOptions(recipe, [p.shape for p in grads.params], grads.numel, comm)
    if broadcast:
        _broadcast_model(model, grads.params, comm)
    sp = exdyna_mpi.make(sparsifier, grads.numel, density, comm, **recipe.options)
    if recipe.moves_momentum:   # only now, once nothing above can refuse: a refusal leaves the optimizer as it was
        move_momentum(optimizer)
    return _wrap(optimizer, _DistributedMixin, "Distributed", _exdyna_grads=grads, sparsifier=sp,
                 _exdyna_options=opts, _exdyna_moved_momentum=recipe.moves_momentum, _exdyna_adam=adam_path)

