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

import contextlib
import copy
import functools
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

import numpy as np

import exdyna_mpi
from exdyna_mpi import transport

from ._torch_common import (_broadcast_model, _flat_layout, _from_torch, _OptimizerMixinBase, _to_torch, _torch, _wrap,
                            _wrapped_params, broadcast_parameters)
from ._torch_adam import ADAM_KEY, AdamPath, make_adam_path
from ._torch_adam import check_mode as check_adam_mode
from .torch_hook import ExDynaHookState, exdyna_hook
from ._torch_config import CONFIG_KEY, EntryConfig, agree_entry, layout_text, optimizer_items
from ._torch_options import OPTIONS_KEY, TrainingOptions, momentum_moved, recipe_for
from ._torch_overlap import OVERLAP_KEY, OverlappedExchange
from .torch_diloco import DiLoCo, nesterov_sgd, plain_sgd
from .torch_wagma import FlatParams, GroupAveragingOptimizer
from exdyna_mpi.transport.group import GroupTransport

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
        #: per parameter: whether a gradient reached it since ``zero()`` (a backward through it, or a
        #: ``.grad`` set from outside); a parameter that none reached on any rank, and whose slice of
        #: the buffer is zero, steps without ``.grad``
        self.used = bytearray(len(self.params))
        off = 0
        for i, p in enumerate(self.params):
            n = p.numel()
            self._views.append(self.flat[off:off + n].view_as(p))
            off += n
            p.register_post_accumulate_grad_hook(functools.partial(_mark_used, self.used, i))
        self.attach()

    def attach(self) -> None:
        """Point every ``.grad`` at its view (after someone replaced or dropped it)."""
        for i, (p, v) in enumerate(zip(self.params, self._views)):
            if p.grad is None or p.grad.data_ptr() != v.data_ptr():
                if p.grad is not None:
                    with _torch().no_grad():
                        v.copy_(p.grad)  # keep a gradient computed outside the buffer
                    self.used[i] = 1
                else:
                    v.zero_()
                p.grad = v

    def zero(self) -> None:
        """Zero the flat buffer and point every ``.grad`` back at its view."""
        self.flat.zero_()
        self.attach()
        self.used[:] = bytes(len(self.used))

    @property
    def views(self) -> list[Any]:
        """Each parameter's view of the flat buffer, in order."""
        return self._views

    @contextlib.contextmanager
    def without(self, unused: Sequence[int]) -> Iterator[None]:
        """A context in which the parameters ``unused`` have no ``.grad``.

        Torch's optimizers and the Adam paths then leave them alone (neither stepped nor decayed),
        as after DDP's backward with ``find_unused_parameters=True``. Their views come back on exit.

        Args:
            unused: indices into ``params``.

        Returns:
            A context manager (it yields None).
        """
        for i in unused:
            self.params[i].grad = None
        try:
            yield
        finally:
            for i in unused:
                self.params[i].grad = self._views[i]


def _mark_used(used: bytearray, i: int, p: Any) -> None:
    used[i] = 1


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
    _exdyna_adam: AdamPath | None
    _exdyna_last: exdyna_mpi.Sparsifier
    _exdyna_overlap: OverlappedExchange | None
    _exdyna_comm: MPI.Comm
    _exdyna_config: EntryConfig
    _exdyna_buffers: list[torch.Tensor]
    _exdyna_unused: list[int]   # the parameters no rank's backward reached (with overlap: of the pending update)

    def synchronize(self) -> exdyna_mpi.Stats:
        """Replace the flat gradient by the averaged sparse gradient, in place. Collective.

        Returns:
            The stats of the exchange that ran (the live warm-up stage's, if any).

        Raises:
            StepError: the exchange refused the step (on every rank; say, NaN in one rank's gradient).
            RuntimeError: ``overlap=True`` (``step()`` runs the exchange, off the caller's thread).
        """
        if self._exdyna_overlap is not None:
            raise RuntimeError("DistributedOptimizer.synchronize: not available with overlap=True, whose "
                               "exchange runs on a worker thread; step() runs it")
        self._exdyna_grads.attach()
        self._exdyna_unused = self._agree_unused()
        sp = self._exdyna_last = self._exchange(self._exdyna_grads.flat)
        return _stats_of(sp)

    def _agree_unused(self) -> list[int]:
        """The parameters no rank's backward reached since ``zero_grad()`` (one small sum over the
        ranks): they step without ``.grad``, as DDP leaves them. Collective."""
        grads = self._exdyna_grads
        mine = np.frombuffer(bytes(grads.used), np.uint8).astype(np.int32)
        for i in np.flatnonzero(mine == 0):   # no backward reached it: a gradient written into flat_grad counts
            mine[i] = int(bool(grads.views[i].any()))
        used = transport.Exchange(self._exdyna_comm).sum_words(mine, np.int32)
        grads.used[:] = bytes(len(grads.used))
        return np.flatnonzero(used == 0).tolist()

    def _exchange(self, flat: torch.Tensor) -> exdyna_mpi.Sparsifier:
        """This step's exchange of ``flat`` in place, inside the recipe and the Adam path's ``prepare``
        (``_torch_options.py``, ``_torch_adam.py``). Returns the sparsifier that ran."""
        adam = self._exdyna_adam
        prepare = None if adam is None else (lambda g, dense: adam.prepare(self, g, dense))
        with _torch().no_grad():
            return self._exdyna_options.exchange(self.sparsifier, flat, prepare)

    def _apply(self, flat: torch.Tensor, sp: exdyna_mpi.Sparsifier, skipped: bool, unused: list[int]) -> Any:
        """Step the parameters with the exchanged average ``flat`` (in the flat gradient unless the Adam
        path owns the step): the Adam path's update, or the wrapped optimizer's step without its
        moved momentum; parameters no rank's backward reached have no ``.grad`` meanwhile. A skipped
        exchange steps nothing: parameters, weight decay and every optimizer state stay as they were."""
        if skipped:
            return None
        adam = self._exdyna_adam
        with self._exdyna_grads.without(unused):
            if adam is not None and adam.owns_step:
                adam.apply(flat, skipped, sp)
                return None
            with momentum_moved(self, self._exdyna_options.recipe):
                return super().step()

    def _sync_buffers(self) -> None:
        """Rank 0's buffers on every rank (``broadcast_buffers``, as DDP's default)."""
        if self._exdyna_buffers:
            broadcast_parameters(self._exdyna_buffers, self._exdyna_comm)

    def step(self, closure: None = None) -> Any:   # type: ignore[override]  # no closures
        """``synchronize()``, then the wrapped optimizer's step (momentum, weight decay, ...). Collective.

        A step the exchange skipped (``nonfinite="skip"``) moves nothing: neither the parameters nor
        any optimizer state. Parameters that no rank's backward reached are not stepped (as torch's
        optimizers treat a parameter without ``.grad``).

        Args:
            closure: must be None (a closure would re-evaluate the loss between exchanges).

        Returns:
            The wrapped optimizer's ``step()`` result (None when ``adam=`` steps the parameters itself).

        Raises:
            ValueError: a closure was given.
            StepError: the exchange refused the step (on every rank); nothing changed.
        """
        if closure is not None:
            raise ValueError("DistributedOptimizer.step: closures are not supported "
                             "(the gradient exchange must happen once per step)")
        ov = self._exdyna_overlap
        if ov is not None:
            self._exdyna_grads.attach()
            flat = self._exdyna_grads.flat
            ov.wait(self._exdyna_comm)   # a refused exchange raises here, on every rank: nothing applied
            unused = self._agree_unused()   # of the gradient handed over now
            if ov.has_pending:
                result = self._apply_pending(ov, keep=flat)   # leaves this step's gradient in ov.buf
            else:
                result = None
                with _torch().no_grad():
                    ov.buf.copy_(flat)
            self._exdyna_unused = unused
            ov.submit(self._overlapped_exchange)
            self._sync_buffers()
            return result
        stats = self.synchronize()
        result = self._apply(self._exdyna_grads.flat, self._exdyna_last, bool(stats.skipped), self._exdyna_unused)
        self._sync_buffers()
        return result

    def _overlapped_exchange(self, buf: torch.Tensor) -> exdyna_mpi.Sparsifier:
        """The worker's job (``overlap=True``): the synchronous step's exchange of ``buf`` in place,
        then the Adam path's residual decay, which ``adam.apply`` runs after it in a synchronous step."""
        sp = self._exchange(buf)
        adam = self._exdyna_adam
        if adam is not None and adam.owns_step:
            adam.decay_residual(sp, _stats_of(sp).skipped)
        return sp

    def _apply_pending(self, ov: OverlappedExchange, keep: torch.Tensor | None) -> Any:
        """Apply the pending exchanged average: the Adam path's update, or the wrapped optimizer's
        step with the average in the flat gradient. ``keep``: this step's gradient (the flat buffer),
        left in ``ov.buf`` for the next exchange; None: nothing to keep (``flush``).

        Returns:
            The wrapped optimizer's ``step()`` result (None when the Adam path steps)."""
        torch = _torch()
        buf, sp, skipped = ov.take()
        self._exdyna_last, self._exdyna_stats = sp, sp.stats   # None for a pending update loaded from a dict
        adam, flat = self._exdyna_adam, self._exdyna_grads.flat
        unused = self._exdyna_unused
        if adam is not None and adam.owns_step:
            with torch.no_grad():
                if not skipped:
                    with self._exdyna_grads.without(unused):
                        adam.update(buf, skipped)
                if keep is not None:
                    buf.copy_(keep)
            return None
        with torch.no_grad():
            if keep is not None:
                if ov.spare is None:
                    ov.spare = torch.empty_like(buf)
                ov.spare.copy_(keep)
                ov.buf, ov.spare = ov.spare, buf   # the gradient goes to the worker; the average to the step
            flat.copy_(buf)
        return self._apply(flat, sp, skipped, unused)

    def flush(self) -> exdyna_mpi.Stats | None:
        """Wait for the exchange in flight and apply it (``overlap=True``; a no-op otherwise).

        Call it before evaluating or saving the final model: until then the parameters lack the
        last step's update.

        Returns:
            The stats of the exchange applied; None when none was in flight (or it was loaded from a
            state dict).

        Raises:
            CollectiveError: the exchange in flight refused its step (on every rank); nothing applied.
        """
        ov = self._exdyna_overlap
        if ov is None:
            return None
        ov.wait(self._exdyna_comm)
        if not ov.has_pending:
            return None
        self._apply_pending(ov, keep=None)
        return self._exdyna_stats

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the flat gradient buffer; ``.grad`` stays a view into it.

        Args:
            set_to_none: ignored: ``.grad`` must stay a view into the buffer (a parameter that no
                backward reaches is still stepped without ``.grad``, as torch does with None).
        """
        self._exdyna_grads.zero()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state plus this rank's sparsifier state.

        The sparsifier's state (residual, controller, layout, iteration) is under
        ``"exdyna_sparsifier"``, as tensors and plain Python values, so
        ``torch.save(opt.state_dict(), f"ckpt.{rank}")`` and ``torch.load`` (``weights_only=True``
        included) round-trip it. Every rank saves its own: the residuals differ between ranks. The
        param groups hold the user's own settings (the momentum that the recipe moves included).

        Returns:
            The state dict (the configuration under ``"exdyna_config"``, the recipe's state under
            ``"exdyna_options"``, the Adam path's under ``"exdyna_adam"`` and, with ``overlap=True``,
            the exchanged average not yet applied under ``"exdyna_overlap"``).

        Raises:
            CollectiveError: ``overlap=True`` and the exchange in flight refused its step (every rank).
        """
        ov = self._exdyna_overlap
        if ov is not None:
            ov.wait(self._exdyna_comm)   # the state is read with nothing in flight
        d = super().state_dict()
        d[CONFIG_KEY] = self._exdyna_config.record()
        d[_SPARSIFIER_KEY] = _to_torch(self.sparsifier.state_dict())
        if self._exdyna_options.active:
            d[OPTIONS_KEY] = _to_torch(self._exdyna_options.state_dict())
        if self._exdyna_adam is not None:
            d[ADAM_KEY] = self._exdyna_adam.state_dict()
        if ov is not None:
            d[OVERLAP_KEY] = dict(ov.state_dict(), unused=list(self._exdyna_unused))
        return d

    def _check_dict(self, state_dict: Any) -> str | None:
        """This rank's problem with a ``state_dict()`` output (None: none); changes nothing."""
        if not isinstance(state_dict, dict):
            return f"not a state dict ({type(state_dict).__name__})"
        if _SPARSIFIER_KEY not in state_dict:
            return (f"no sparsifier state (key {_SPARSIFIER_KEY!r}): it was not saved by "
                    "DistributedOptimizer.state_dict()")
        adam, ov = self._exdyna_adam, self._exdyna_overlap
        try:
            if adam is not None:
                if ADAM_KEY not in state_dict:
                    return f"this optimizer runs adam={adam.mode!r} but the dict has no {ADAM_KEY!r}"
                adam.check(state_dict[ADAM_KEY])
            if self._exdyna_options.active and OPTIONS_KEY not in state_dict:
                return ("this optimizer uses recipe options (clip_norm/warmup_steps/momentum_correction/"
                        f"density_warmup) but the dict has no {OPTIONS_KEY!r}")
            problem = self._exdyna_config.mismatch(state_dict.get(CONFIG_KEY))
            if problem:
                return problem
            if ov is not None:
                ov.check(state_dict.get(OVERLAP_KEY), self._exdyna_grads.numel)
                unused = state_dict[OVERLAP_KEY].get("unused", [])
                if not all(isinstance(i, int) and 0 <= i < len(self._exdyna_grads.params) for i in unused):
                    return f"{OVERLAP_KEY}.unused is not a list of parameter indices"
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            return str(e)
        return None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output; resumes bit-exactly. Collective, all or nothing.

        Every rank checks its own dict (the configuration it records against this optimizer's, each
        part's shape and values, torch's own checks of the optimizer's part), the ranks agree once,
        then each part loads (the sparsifier's and the recipe's loads agree again); a refusal
        anywhere leaves every rank as it was.

        Args:
            state_dict: this rank's ``state_dict()`` output.

        Raises:
            CollectiveError: any rank's dict is refused (on every rank, naming each rank and its
                problem); nothing changes.
        """
        who = "DistributedOptimizer.load_state_dict refused on every rank, state unchanged"
        ov = self._exdyna_overlap
        if ov is not None:
            try:
                ov.wait(self._exdyna_comm)   # nothing in flight while the state changes
            except exdyna_mpi.CollectiveError:
                pass   # that exchange changed nothing, and the dict replaces what it would have
        problem = self._check_dict(state_dict)
        before = copy.deepcopy(super().state_dict())
        if problem is None:
            rest = {k: v for k, v in state_dict.items() if k not in _OWN_KEYS}
            try:   # torch's own checks, on this rank; undone below unless every rank's dict passes
                super().load_state_dict(rest)
            except (KeyError, ValueError, TypeError, RuntimeError) as e:
                problem = f"the wrapped optimizer refused its state ({e})"
                super().load_state_dict(before)
        try:
            transport.agree_problems(transport.Exchange(self._exdyna_comm), problem, who)
        except exdyna_mpi.CollectiveError:
            super().load_state_dict(before)
            raise
        # the sparsifier's load is all or nothing; its old state is needed only should the recipe's refuse after it
        opts_before = self._exdyna_options.state_dict() if self._exdyna_options.active else None
        sp_before = self.sparsifier.state_dict() if opts_before is not None else None
        try:
            self.sparsifier.load_state_dict(_from_torch(state_dict[_SPARSIFIER_KEY]))
            if opts_before is not None:   # its refusals are agreed: every rank rolls back together
                self._exdyna_options.load_state_dict(_from_torch_keep_tensors(state_dict[OPTIONS_KEY]))
        except exdyna_mpi.CollectiveError:
            if opts_before is not None and sp_before is not None:
                self._exdyna_options.load_state_dict(opts_before)
                self.sparsifier.load_state_dict(sp_before)
            super().load_state_dict(before)
            raise
        adam = self._exdyna_adam
        if adam is not None:
            flat = self._exdyna_grads.flat
            adam.load_state_dict({k: v.to(flat.device) if hasattr(v, "to") else v
                                  for k, v in state_dict[ADAM_KEY].items()})
        if ov is not None:
            ov.load_state_dict(state_dict[OVERLAP_KEY], self.sparsifier)
            self._exdyna_unused = list(state_dict[OVERLAP_KEY].get("unused", []))

    @property
    def stats(self) -> exdyna_mpi.Stats | None:
        """The last step's sparsifier stats (``counts``, ``density``, ``bytes_sent``, ...); None before it.

        With ``overlap=True``: those of the last exchange applied."""
        if self._exdyna_overlap is not None:
            return getattr(self, "_exdyna_stats", None)
        return getattr(self, "_exdyna_last", self.sparsifier).stats

    @property
    def flat_grad(self) -> torch.Tensor:
        """The flat gradient buffer that every ``.grad`` is a view into."""
        return self._exdyna_grads.flat


_OWN_KEYS = (CONFIG_KEY, _SPARSIFIER_KEY, OPTIONS_KEY, ADAM_KEY, OVERLAP_KEY)


def DistributedOptimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None, *,
                         sparsifier: str = "exdyna", density: float = 0.01, comm: MPI.Comm | None = None,
                         broadcast: bool = True, clip_norm: float | None = None, warmup_steps: int = 0,
                         momentum_correction: float | str = "auto", momentum_masking: bool = True,
                         density_warmup: Sequence[float] | None = None, density_warmup_steps: int | None = None,
                         adam: str = "auto", overlap: bool = False, broadcast_buffers: bool = True,
                         **options: Any) -> torch.optim.Optimizer:
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

    ``adam`` (for ``torch.optim.Adam``/``AdamW``; see ``_torch_adam.py``): ``"auto"`` (the default)
    is ``"demo-age"`` for an Adam/AdamW with ``sparsifier="exdyna"`` (one ``betas[0]`` over the groups,
    no ``amsgrad``/``maximize``) and ``"live"`` otherwise; ``"live"`` exchanges the raw gradient and
    lets the wrapped optimizer update its moments from the sparse average; ``"update"`` runs Adam's
    moments on each rank's own gradient and exchanges the update they give, with error feedback,
    then applies the average on every rank (the wrapped optimizer's ``lr``, betas, eps and weight
    decay; its own ``state`` is not used); ``"frozen"`` runs ``warmup_steps`` (required, >= 1)
    dense steps of exact Adam, then freezes the second moment,
    exchanges the gradient divided by it (selection by update size) with error feedback and applies
    Adam with the frozen variance; ``"frozen-gradient"`` the same with the division after the
    exchange; ``"demo"`` is DeMo's decoupled momentum: the sparsifier's residual is the momentum
    (decayed by ``betas[0]`` after each exchange), and every rank applies ``lr * sign`` of the
    exchanged average after AdamW's decay (no second moment). ``"demo"`` moves a sent coordinate by
    ``lr``, about what Adam's normalised step moves it: on the LM its best rate was 2x (d = 0.05) to
    4x (d = 0.01) DDP-AdamW's, and ``betas[0]`` of 0.99 or 0.999 suited it better than AdamW's 0.9.
    ``"demo-age"`` is ``"demo"`` with each sign scaled by ``sqrt(a)``, ``a`` the steps since the
    coordinate last moved: a coordinate sent once in ``a`` steps moves about as far as a random walk
    of ``a`` of Adam's steps, not ``a`` times less than one sent every step. On the LM its best rate
    was DDP-AdamW's own, and at DDP's budget it reached DDP's loss (docs/training.md).

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
        if overlap and not GroupTransport.thread_multiple():
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
                 "overlap": repr(overlap), "broadcast": repr(broadcast), "broadcast_buffers": repr(broadcast_buffers)}
        config = EntryConfig.of(who, items, unrecorded=("broadcast", "broadcast_buffers", "buffers"))
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
                 _exdyna_config=config, _exdyna_buffers=buffers if broadcast_buffers else [], _exdyna_unused=[])
