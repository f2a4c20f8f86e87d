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

This module builds ``DistributedOptimizer`` (the checks, the agreement, the construction); the methods
the wrapped optimizer gains are ``_torch_distributed.py``'s, ``FlatGrad`` is ``_torch_flat.py``'s and
the ``adam=`` paths are ``torch_adam``'s.

For ``DistributedDataParallel``, a communication hook instead (the ``torch_hook`` package)::

    ddp.register_comm_hook(exdyna_mpi.adapters.torch.ExDynaHookState("exdyna", density=0.01),
                           exdyna_mpi.adapters.torch.exdyna_hook)
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import exdyna_mpi
from exdyna_mpi import transport

from ._torch_common import _broadcast_model, _flat_layout, _wrap, _wrapped_params, broadcast_parameters
from ._torch_config import EntryConfig, agree_entry, layout_text, optimizer_items
from ._torch_distributed import _DistributedMixin
from ._torch_elastic import Elastic, elastic_problem
from ._torch_flat import FlatGrad
from ._torch_options import TrainingOptions, recipe_for
from ._torch_overlap import OverlappedExchange
from .torch_adam import AdamPath, make_adam_path
from .torch_adam import check_mode as check_adam_mode
from .torch_hook import ExDynaHookState, exdyna_hook
from .torch_diloco import DiLoCo, nesterov_sgd, plain_sgd
from .torch_wagma import FlatParams, GroupAveragingOptimizer

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI

__all__ = ["DiLoCo", "DistributedOptimizer", "ExDynaHookState", "FlatGrad", "FlatParams", "GroupAveragingOptimizer",
           "broadcast_parameters", "exdyna_hook", "nesterov_sgd", "plain_sgd"]


def DistributedOptimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None, *,
                         sparsifier: str = "exdyna", density: float = 0.01, comm: MPI.Comm | None = None,
                         broadcast: bool = True, clip_norm: float | None = None, warmup_steps: int = 0,
                         momentum_correction: float | str = "auto", momentum_masking: bool = True,
                         density_warmup: Sequence[float] | None = None, density_warmup_steps: int | None = None,
                         adam: str = "auto", overlap: bool = False, broadcast_buffers: bool = True,
                         elastic: bool = False, **options: Any) -> torch.optim.Optimizer:
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
    momentum is out of its param groups only while it steps), and with it ExDyna's
    ``max_imbalance=0.2`` unless given; off from d = 0.02 and for other sparsifiers and optimizers;
    a number ``m`` sets it (wrap an optimizer with ``momentum=0``), ``0`` turns it off. Off by
    default: ``clip_norm`` (clip this rank's gradient before accumulation), ``warmup_steps`` (dense
    exchange for the first steps),
    ``density_warmup=(d1, d2, ...)`` with ``density_warmup_steps=n`` (DGC's decaying-density warm-up:
    after any dense warm-up, ``n`` steps at each density ``d_i`` > ``density`` with a fresh sparsifier
    of the same kind and options, the error-feedback residual carried from stage to stage and into
    the configured sparsifier; ``opt.stats`` shows the live stage's stats).

    ``adam`` (for ``torch.optim.Adam``/``AdamW``; the paths are in ``exdyna_mpi.adapters.torch_adam``):
    ``"auto"`` (the default) is ``"demo-age"`` for an Adam/AdamW with ``sparsifier="exdyna"`` (one
    ``betas[0]`` over the groups, no ``amsgrad``/``maximize``) and ``"live"`` otherwise; ``"live"``
    exchanges the raw gradient and lets the wrapped optimizer update its moments from the sparse
    average; ``"update"`` runs Adam's moments on each rank's own gradient and exchanges the update
    they give, with error feedback, then applies the average on every rank (the wrapped optimizer's
    ``lr``, betas, eps and weight decay; its own ``state`` is not used); ``"frozen"`` runs
    ``warmup_steps`` (required, >= 1) dense steps of exact Adam, then freezes the second moment,
    exchanges the gradient divided by it (selection by update size) with error feedback and applies
    Adam with the frozen variance; ``"frozen-gradient"`` the same with the division after the
    exchange; ``"demo"`` is DeMo's decoupled momentum: the sparsifier's residual is the momentum
    (decayed by ``betas[0]`` after each exchange), and every rank applies ``lr * sign`` of the
    exchanged average after AdamW's decay (no second moment). ``"demo"`` moves a sent coordinate by
    ``lr`` however long it waited, so its learning rate and ``betas[0]`` are tuned for it rather
    than taken over from AdamW. ``"demo-age"`` is ``"demo"`` with each sign scaled by ``sqrt(a)``,
    ``a`` the steps since the coordinate last moved: a coordinate sent once in ``a`` steps moves
    about as far as a random walk of ``a`` of Adam's steps, not ``a`` times less than one sent every
    step, so a learning rate chosen for AdamW is the place to start. Measurements of each path:
    docs/training.md.

    ``overlap=True`` (see ``_torch_overlap.py``): ``step()`` hands this step's gradient to a worker
    thread and returns; the exchange runs while the caller computes the next gradient, and the next
    ``step()`` applies its result. Each update lands one step late (the next gradient is computed
    without it), and a step costs about the larger of compute and exchange rather than their sum.
    ``flush()`` applies the update still in flight: call it before evaluating or saving the final
    model. A refused exchange (``StepError``) is raised by the next ``step()``, on every rank, with
    nothing applied and the current gradient not yet handed over. ``synchronize()`` is not
    available. Needs ``MPI_THREAD_MULTIPLE`` (mpi4py's default).

    Args:
        optimizer: the ``torch.optim`` optimizer to wrap (its state is shared, not copied).
        model: a module whose parameters and buffers rank 0 broadcasts (optional).
        sparsifier, density, **options: the sparsifier (``exdyna_mpi.make``).
        comm: the communicator (``MPI.COMM_WORLD`` when None).
        broadcast: broadcast rank 0's parameters (and the model's buffers) at construction.
        clip_norm, warmup_steps, momentum_correction, momentum_masking, density_warmup,
            density_warmup_steps: the training recipe (above; docs/reference.md).
        adam: the Adam path (above), for ``torch.optim.Adam``/``AdamW`` only.
        overlap: run each exchange while the next gradient is computed (above).
        broadcast_buffers: after every ``step()``, rank 0's buffers of ``model`` (BatchNorm's running
            statistics) on every rank, as DDP's ``broadcast_buffers=True`` keeps them; False leaves
            each rank its own.
        elastic: survive a lost rank (Open MPI with ULFM, launched as
            ``mpiexec --with-ft ulfm --mca pml ob1 --mca btl tcp,self ...``): the survivors shrink
            to the ranks left and go on, and ``step()`` raises ``exdyna_mpi.RanksLost`` once
            they have (docs/faults.md, "Elastic training"). Refused under an MPI without fault
            tolerance (MPICH included), with ``overlap=True`` and with ``deadline_ms``.

    Returns:
        The optimizer, now an instance of a subclass of its class whose ``step()`` exchanges first.

    Construction is collective and agreed before anything else: every rank runs the checks on its
    own arguments, then one agreement compares everything that changes the bits (the sparsifier
    and its options, the recipe, the Adam path, the optimizer's class and hyperparameters, the
    parameters' shapes, dtypes and order, the model's buffers); a problem on any rank, or ranks that
    differ, raise the same ``CollectiveError`` on every rank, naming the ranks and the items, with
    the model and optimizer untouched (``_torch_config.py``). ``state_dict()`` records the
    configuration and ``load_state_dict`` refuses a dict of another one.

    Every step is a transaction: a step refused (``StepError``, on every rank) or skipped
    (``nonfinite="skip"``) leaves the residual, the recipe's velocity, the Adam path's state, the
    parameters and the wrapped optimizer's state as they were. A parameter that no rank's backward
    reached since ``zero_grad()`` is stepped without ``.grad`` (not moved, not decayed), as torch's
    optimizers and DDP with ``find_unused_parameters=True`` treat it.

    Raises:
        CollectiveError: on every rank: a recipe option or ``adam`` out of range or not for this
            optimizer on any rank, or ranks whose configurations differ.

    Example::

        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> opt = DistributedOptimizer(opt, model, sparsifier="exdyna", density=0.01)
        >>> for x, y in batches:
        ...     opt.zero_grad()
        ...     loss_fn(model(x), y).backward()
        ...     opt.step()
        >>> opt.stats.density, opt.stats.bytes_sent
    """
    who = "DistributedOptimizer"
    comm = transport.world() if comm is None else comm

    def plan() -> tuple[tuple[list[Any], AdamPath | None, Any, list[Any]], EntryConfig]:
        """Every check, on this rank only, and the configuration they give; changes nothing."""
        _, params = _wrapped_params(optimizer, model, comm, who)
        params, _ = _flat_layout(params, who)
        if sparsifier not in exdyna_mpi.available():
            raise ValueError(f"{who}: unknown sparsifier {sparsifier!r}; "
                             f"available: {', '.join(exdyna_mpi.available())}")
        check_adam_mode(optimizer, adam, warmup_steps, who)
        for name, flag in (("overlap", overlap), ("broadcast", broadcast), ("broadcast_buffers", broadcast_buffers)):
            if not isinstance(flag, bool):
                raise ValueError(f"{who}: {name} must be True or False, got {flag!r}")
        problem = elastic_problem(elastic, who, overlap=overlap, options=options)
        if problem:
            raise RuntimeError(problem)
        if overlap and not transport.thread_multiple():
            raise RuntimeError(f"{who}: overlap=True needs MPI initialised with MPI_THREAD_MULTIPLE "
                               "(mpi4py's default, see mpi4py.rc.thread_level): its exchanges run on a worker thread")
        adam_path = make_adam_path(optimizer, params, adam, sparsifier=sparsifier)
        opts = adam_path.sparsifier_options(sparsifier, options) if adam_path is not None else options
        recipe = recipe_for(optimizer, sparsifier, density, opts, who=who, clip_norm=clip_norm,
                            warmup_steps=warmup_steps, momentum_correction=momentum_correction,
                            momentum_masking=momentum_masking, density_warmup=density_warmup,
                            density_warmup_steps=density_warmup_steps)
        buffers = list(model.buffers()) if model is not None else []
        items = {"entry": who, **recipe.items(), "adam": "live" if adam_path is None else adam_path.mode,
                 **optimizer_items(optimizer), "layout": layout_text(params), "buffers": layout_text(buffers),
                 "overlap": repr(overlap), "broadcast": repr(broadcast), "broadcast_buffers": repr(broadcast_buffers),
                 "elastic": repr(elastic)}
        config = EntryConfig.of(who, items, unrecorded=("broadcast", "broadcast_buffers", "buffers", "elastic"))
        return (params, adam_path, recipe, buffers), config

    (params, adam_path, recipe, buffers), config = agree_entry(comm, who, plan)
    # agreed on every rank: from here on every collective meets the same sizes
    numel = sum(p.numel() for p in params)
    ov = OverlappedExchange(numel, params[0].dtype, params[0].device) if overlap else None
    # the exchanges' communicator: the worker's private duplicate with overlap, so that the caller's
    # own collectives on comm never meet the worker's
    xcomm = comm if ov is None else ov.open(comm)
    opts = TrainingOptions(recipe, [p.shape for p in params], numel, xcomm)
    try:
        sp = exdyna_mpi.make(sparsifier, numel, density, xcomm, **recipe.options)
    except BaseException:
        opts.close()
        raise
    if broadcast:   # after the sparsifier agreed its options: a refusal leaves every model as it was
        _broadcast_model(model, params, comm)
    grads = FlatGrad(params)   # last: its views and hooks go on the parameters only once nothing can refuse
    return _wrap(optimizer, _DistributedMixin, "Distributed", _exdyna_grads=grads, sparsifier=sp,
                 _exdyna_options=opts, _exdyna_adam=adam_path, _exdyna_overlap=ov, _exdyna_comm=comm,
                 _exdyna_config=config, _exdyna_buffers=buffers if broadcast_buffers else [], _exdyna_unused=[],
                 _exdyna_elastic=Elastic() if elastic else None)
