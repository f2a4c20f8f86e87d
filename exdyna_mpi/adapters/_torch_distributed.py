"""The methods ``DistributedOptimizer`` puts in front of the wrapped optimizer's class
(``_DistributedMixin``): the exchange, the step through the recipe and the Adam path, the overlapped
step, and the state dict that holds every part. ``DistributedOptimizer`` itself (the checks, the
agreement and the construction) is in ``torch.py``."""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import numpy as np

import exdyna_mpi
from exdyna_mpi import transport

from ._torch_common import _from_torch, _OptimizerMixinBase, _to_torch, _torch, broadcast_parameters
from ._torch_config import CONFIG_KEY, EntryConfig
from ._torch_elastic import Elastic, guarded_step, recover
from ._torch_flat import FlatGrad
from ._torch_options import OPTIONS_KEY, TrainingOptions, momentum_moved
from ._torch_overlap import OVERLAP_KEY, OverlappedExchange
from ._torch_reshard import reshard_optimizer
from .torch_adam import ADAM_KEY, AdamPath

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI

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

    #: run eagerly where torch.compile traces the caller (``_wrap``)
    _not_compiled = ("step", "synchronize", "flush", "zero_grad")

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
    _exdyna_elastic: Elastic | None   # elastic=True: the steps completed and the losses recovered from

    def synchronize(self) -> exdyna_mpi.Stats:
        """Replace the flat gradient by the averaged sparse gradient, in place. Collective.

        Returns:
            The stats of the exchange that ran (the live warm-up stage's, if any).

        Raises:
            StepError: the exchange refused the step (on every rank; say, NaN in one rank's gradient).
            RuntimeError: ``overlap=True`` (``step()`` runs the exchange, off the caller's thread).
            RanksLost: ``elastic=True`` and a rank was lost; the survivors recovered (as ``step()``).
        """
        if self._exdyna_overlap is not None:
            raise RuntimeError("DistributedOptimizer.synchronize: not available with overlap=True, whose "
                               "exchange runs on a worker thread; step() runs it")
        return guarded_step(self, self._exdyna_elastic, self._synchronize_once, count=False)

    def _synchronize_once(self) -> exdyna_mpi.Stats:
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
        (``_torch_options.py``, ``torch_adam/``). Returns the sparsifier that ran."""
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
            RanksLost: ``elastic=True`` and a rank was lost during the step: the survivors shrank to
                the ranks left, took the most advanced survivor's parameters and state and rebuilt
                the exchange; this step was not applied. Re-shard the data for ``e.nranks`` ranks
                and go on (docs/faults.md, "Elastic training").
        """
        if closure is not None:
            raise ValueError("DistributedOptimizer.step: closures are not supported "
                             "(the gradient exchange must happen once per step)")
        return guarded_step(self, self._exdyna_elastic, self._step_once)

    def _step_once(self) -> Any:
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

    def load_state_dict(self, state_dict: Any, reshard: bool = False) -> None:
        """Restore ``state_dict()`` output; resumes bit-exactly. Collective, all or nothing.

        Every rank checks its own dict (the configuration it records against this optimizer's, each
        part's shape and values, torch's own checks of the optimizer's part), the ranks agree once,
        then each part loads (the sparsifier's and the recipe's loads agree again); a refusal
        anywhere leaves every rank as it was.

        With ``reshard=True`` the run resumes at another number of ranks: ``state_dict`` is every
        old rank's ``state_dict()`` (the same sequence on every rank); what the ranks held alike is
        old rank 0's (checked equal in every dict), what was each rank's own (the residual, the
        momentum-correction velocity, per-rank Adam moments) the mean over the old ranks
        (``_torch_reshard.py``, docs/faults.md).

        Args:
            state_dict: this rank's ``state_dict()`` output (``reshard=True``: every old rank's).
            reshard: load dicts saved at another number of ranks.

        Raises:
            CollectiveError: any rank's dict is refused (on every rank, naming each rank and its
                problem); nothing changes.
        """
        if reshard:
            self._reshard_load(state_dict, complete=True)
            return
        who = "DistributedOptimizer.load_state_dict refused on every rank, state unchanged"
        ov = self._exdyna_overlap
        self._settle_overlap()
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

    # ------------------------------------------------------------------ elastic (_torch_elastic.py)
    @property
    def comm(self) -> MPI.Comm:
        """The communicator the exchanges run over.

        Returns:
            The one given at construction, or the survivors' after a ``RanksLost``.
        """
        return self._exdyna_comm

    def recover(self) -> exdyna_mpi.RanksLost:
        """Recover from a lost rank that the caller's own MPI call reported (``elastic=True``).

        A failure inside ``step()`` recovers by itself. Collective over the survivors: the revoke
        makes every survivor's next call on the old communicator fail, so each of them recovers too.

        Returns:
            The ``RanksLost`` that ``step()`` would have raised (not raised here).

        Raises:
            RuntimeError: the optimizer was built without ``elastic=True``.
        """
        if self._exdyna_elastic is None:
            raise RuntimeError("DistributedOptimizer.recover: built without elastic=True")
        return recover(self, self._exdyna_elastic)

    def _elastic_comm(self) -> MPI.Comm:
        return self._exdyna_comm

    def _elastic_state(self) -> dict[str, Any]:
        return self.state_dict()

    def _elastic_shared(self) -> list[torch.Tensor]:
        return list(self._exdyna_grads.params) + list(self._exdyna_buffers)

    def _elastic_rebuild(self, comm: MPI.Comm, dicts: list[dict[str, Any]]) -> None:
        """The exchange rebuilt over the survivors' ``comm`` (partitions for the ranks left), then
        the gathered dicts (the most advanced survivor's first) loaded through the resharding."""
        old = self.sparsifier
        recipe = self._exdyna_options.recipe
        grads = self._exdyna_grads
        opts = TrainingOptions(recipe, [p.shape for p in grads.params], grads.numel, comm)
        sp = exdyna_mpi.make(old.name, old.numel, old.density, comm, **recipe.options)
        self._exdyna_options, self.sparsifier, self._exdyna_last, self._exdyna_comm = opts, sp, sp, comm
        self._reshard_load(dicts, complete=False)

    def _settle_overlap(self) -> None:
        """With ``overlap=True``, wait for the exchange in flight before a load replaces the state
        (collective); a refused exchange changed nothing, and the loaded dicts replace what it
        would have."""
        ov = self._exdyna_overlap
        if ov is not None:
            try:
                ov.wait(self._exdyna_comm)
            except exdyna_mpi.CollectiveError:
                pass

    def _reshard_load(self, dicts: Any, complete: bool) -> None:
        """``load_state_dict(dicts, reshard=True)``; ``complete=False``: the survivors' dicts only
        (the elastic shrink, ``_torch_reshard.py``). Collective, all or nothing."""
        reshard_optimizer(self, dicts, complete, lambda: super(_DistributedMixin, self).state_dict(),
                          lambda d: super(_DistributedMixin, self).load_state_dict(d))

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
