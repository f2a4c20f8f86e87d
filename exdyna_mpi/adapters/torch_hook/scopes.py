"""The two scopes of the DDP hook, one object each, chosen once when the state is made.

- ``ModelScope`` (``scope="model"``, the default): one sparsifier over the whole model's gradient,
  so density and threshold hold for the model as a whole. The buckets of an iteration are copied
  into one model-wide vector laid out in the canonical order (``layout.py``); the exchange runs when
  the iteration's last bucket arrives: it does not overlap with backward, it only keeps the
  backward thread free. With ``optimizer=`` it runs inside the training recipe.
- ``BucketScope`` (``scope="bucket"``): one sparsifier per bucket, keyed by the tuple of its
  parameters' canonical indices (not by bucket index, which DDP gives to other parameters after a
  rebuild). Each exchange starts as soon as its bucket arrives, overlapping backward. A key seen for
  the first time (DDP's rebuild after the first iteration) gets a fresh sparsifier whose
  error-feedback residual is carried over, parameter by parameter, from the sparsifiers that held
  those parameters; its threshold controller starts afresh. The first iteration of a model not seen
  before (a resumed run: new model, new DDP, initial buckets) while the scope holds sparsifiers,
  after a load or unpickle, is exchanged with the held grouping instead (all buckets gathered
  first), so that a resumed run reproduces the uninterrupted one bit for bit once DDP rebuilds to
  that grouping.

Both hold their sparsifiers, their ``stats`` and their part of the state dict. The worker thread
calls them (the backward thread only ``begin_buckets`` and ``check_bucket``); their sparsifiers are
made on the worker's private communicator.
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

import exdyna_mpi

from .._torch_common import _torch
from .._torch_reshard import load_sparsifier
from .layout import Entry, Key, LayoutError, ParamLayout, required
from .worker import HookWorker

if TYPE_CHECKING:
    import torch

    from .._torch_options import TrainingOptions

__all__ = ["SCOPES", "BucketScope", "Built", "ModelScope", "Scope", "SparsifierFactory", "close_sparsifier"]

#: sparsifiers built from a state dict, before they are installed: (bucket key, sparsifier);
#: the model scope's one sparsifier has the key ()
Built = list[tuple[Key, Any]]
#: the Adam path's step before the exchange, ``(gradient, dense) -> None``, or None
Prepare = Callable[[Any, bool], None] | None


def close_sparsifier(sp: Any) -> None:
    """Close a sparsifier before it is dropped, so no request outlives its buffers (a no-op but in
    deadline mode, where it is collective: called in the same order on every rank)."""
    if sp is not None:
        sp.close()


class SparsifierFactory:
    """Makes the hook's sparsifiers, on the worker's private communicator.

    Args:
        name: the sparsifier's name (``exdyna_mpi.available()``).
        density: its density.
        options: its options.
        worker: the worker whose private communicator the sparsifiers use.
    """

    __slots__ = ("name", "density", "options", "worker")

    def __init__(self, name: str, density: float, options: dict[str, Any], worker: HookWorker) -> None:
        self.name, self.density, self.options, self.worker = name, density, options, worker

    def __call__(self, numel: int) -> Any:
        """A sparsifier over ``numel`` elements (collective over the private communicator)."""
        return exdyna_mpi.make(self.name, numel, self.density, self.worker.private, **self.options)

    def loaded(self, numel: int, sd: Any) -> Any:
        """A sparsifier of ``numel`` elements loaded with ``sd`` (collective; closed if the load refuses).

        Raises:
            CollectiveError: the load refused, on every rank.
        """
        sp = self(numel)
        try:
            load_sparsifier(sp, sd)   # a Resharded sd: the old ranks' dicts (load_state_dict(reshard=True))
        except exdyna_mpi.CollectiveError as e:
            close_sparsifier(sp)
            raise exdyna_mpi.CollectiveError(f"ExDynaHookState.load_state_dict refused on all ranks, state "
                                             f"unchanged: {e}") from e
        return sp


class Scope(abc.ABC):
    """What the two scopes share: the sparsifier factory, the layout and the last ``stats``."""

    __slots__ = ("make", "layout", "stats")
    name: str

    def __init__(self, make: SparsifierFactory, layout: ParamLayout) -> None:
        self.make, self.layout = make, layout
        self.stats: Any = None

    # ------------------------------------------------------------------ backward thread
    def begin_buckets(self, dtype: Any) -> None:
        """The first bucket of an iteration arrived, its gradient of ``dtype``."""

    def check_bucket(self, dtype: Any) -> None:
        """Refuse a bucket this scope cannot exchange (its gradient of ``dtype``)."""

    # ------------------------------------------------------------------ worker: iterations
    @property
    @abc.abstractmethod
    def gathers(self) -> bool:
        """Whether this iteration's buckets are gathered into the model-wide vector and exchanged
        together once the last is in (else each is exchanged as it arrives)."""

    def begin_iteration(self, new_model: bool, key: Key) -> None:
        """The worker starts an iteration (``new_model``, ``key``: its first bucket's)."""

    @abc.abstractmethod
    def exchange_bucket(self, key: Key, buf: torch.Tensor) -> bool:
        """Exchange one bucket in place as it arrives, where this iteration does; returns False
        where it is to be gathered instead."""

    @abc.abstractmethod
    def exchange_gathered(self, flat: torch.Tensor, recipe: TrainingOptions | None, prepare: Prepare) -> Any:
        """Exchange the gathered model-wide vector in place; returns the sparsifier that ran where
        one sparsifier ran over all of it."""

    @property
    def skipped(self) -> bool:
        """Whether the last exchange skipped the step on every rank (``nonfinite="skip"``)."""
        return False

    def end_iteration(self) -> None:
        """The iteration's last bucket was exchanged (or the iteration failed)."""

    def loaded(self) -> None:
        """A state dict was loaded (or unpickled): its sparsifiers are held."""

    # ------------------------------------------------------------------ the sparsifiers held
    @abc.abstractmethod
    def sparsifiers(self) -> list[Any]:
        """The sparsifiers held, in the order they were made."""

    def holds(self) -> bool:
        """Whether any sparsifier is held."""
        return bool(self.sparsifiers())

    @abc.abstractmethod
    def close(self) -> None:
        """Close the sparsifiers held (collective, in the same order on every rank) and drop them."""

    @abc.abstractmethod
    def install(self, built: Built) -> None:
        """Hold ``built`` in place of the sparsifiers held so far (the caller closes those)."""

    # ------------------------------------------------------------------ checkpoints
    @abc.abstractmethod
    def state(self) -> Any:
        """The sparsifiers' states, as the state dict holds them under ``"state"``."""

    def checked_state(self, state: Any, entries: list[Entry] | None) -> tuple[str | None, Any]:
        """This rank's checks of a dict's ``"state"`` against its layout ``entries``: (the problem
        or None, the state as it loads)."""
        return None, state

    def state_shape(self, state: Any) -> Any:
        """What of a checked ``state`` every rank must agree on before a load."""
        return bool(state)

    @abc.abstractmethod
    def parts(self, state: Any, entries: list[Entry]) -> list[tuple[Key, int, Any]]:
        """(key, element count, sparsifier state) of each sparsifier a checked ``state`` holds."""

    def build(self, state: Any, entries: list[Entry]) -> Built:
        """The sparsifiers of a checked ``state``, each loaded with its entry (collective). On any
        failure the ones already built are closed, and nothing is kept."""
        built: Built = []
        try:
            for key, numel, sd in self.parts(state, entries):
                built.append((key, self.make.loaded(numel, sd)))
        except BaseException:
            for _, sp in built:
                close_sparsifier(sp)
            raise
        return built


class ModelScope(Scope):
    """``scope="model"``: one sparsifier over the model-wide vector, exchanged at the last bucket.

    Args:
        make: the sparsifier factory.
        layout: the canonical layout.

    Raises:
        LayoutError: from ``check_bucket``: buckets of two gradient dtypes in one iteration.
    """

    __slots__ = ("sp", "_dtype")
    name = "model"

    def __init__(self, make: SparsifierFactory, layout: ParamLayout) -> None:
        super().__init__(make, layout)
        self.sp: Any = None
        self._dtype: Any = None   # the gradient dtype of the iteration's first bucket

    @property
    def sps(self) -> dict[Key, Any]:
        """No sparsifier per bucket in this scope."""
        return {}

    def begin_buckets(self, dtype: Any) -> None:
        self._dtype = dtype

    def check_bucket(self, dtype: Any) -> None:
        if dtype != self._dtype:
            raise LayoutError(f"ExDynaHookState: scope='model' needs one gradient dtype, got {self._dtype} "
                              f"and {dtype} (use scope='bucket')")

    @property
    def gathers(self) -> bool:
        return True

    def exchange_bucket(self, key: Key, buf: torch.Tensor) -> bool:
        return False   # every bucket waits for the model-wide exchange

    def exchange_gathered(self, flat: torch.Tensor, recipe: TrainingOptions | None, prepare: Prepare) -> Any:
        """The model-wide exchange, in place; with ``optimizer=``, inside the training recipe (and
        the Adam path) exactly as ``DistributedOptimizer.synchronize`` runs it. Returns the
        sparsifier that ran (a warm-up's or the main one)."""
        if self.sp is None:
            self.sp = self.make(flat.numel())
        if recipe is None:
            self.sp.step(flat, out=flat)
            self.stats = self.sp.stats
            return self.sp
        with _torch().no_grad():
            sp = recipe.exchange(self.sp, flat, prepare)   # _torch_options.py
        self.stats = sp.stats
        return sp

    @property
    def skipped(self) -> bool:
        return bool(getattr(self.stats, "skipped", False))

    def sparsifiers(self) -> list[Any]:
        return [] if self.sp is None else [self.sp]

    def close(self) -> None:
        close_sparsifier(self.sp)
        self.sp = None

    def install(self, built: Built) -> None:
        self.sp = None
        for _, sp in built:
            self.sp = sp

    def state(self) -> Any:
        return None if self.sp is None else self.sp.state_dict()

    def parts(self, state: Any, entries: list[Entry]) -> list[tuple[Key, int, Any]]:
        return [((), sum(n for n, _ in entries), state)]


class BucketScope(Scope):
    """``scope="bucket"``: a sparsifier per bucket key, exchanged as each bucket arrives; residual
    adoption when DDP regroups the parameters.

    Args:
        make: the sparsifier factory.
        layout: the canonical layout.
    """

    __slots__ = ("sps", "owner", "regroup", "after_load")
    name = "bucket"

    def __init__(self, make: SparsifierFactory, layout: ParamLayout) -> None:
        super().__init__(make, layout)
        self.sps: dict[Key, Any] = {}     # key -> sparsifier
        self.owner: dict[int, Key] = {}   # canonical index -> the key holding its residual
        self.regroup = False              # this iteration is exchanged with the held grouping
        self.after_load = False           # a state was loaded and no iteration has run since

    @property
    def sp(self) -> Any:
        """No model-wide sparsifier in this scope."""
        return None

    @property
    def gathers(self) -> bool:
        return self.regroup

    def begin_iteration(self, new_model: bool, key: Key) -> None:
        self.regroup = bool(self.sps) and new_model and self.after_load and key not in self.sps
        self.after_load = False
        self.stats = {}

    def exchange_bucket(self, key: Key, buf: torch.Tensor) -> bool:
        if self.regroup:
            return False
        sp = self.sps.get(key)
        if sp is None:
            sp = self._adopt(key)
        sp.step(buf, out=buf)
        self.stats[key] = sp.stats
        return True

    def exchange_gathered(self, flat: torch.Tensor, recipe: TrainingOptions | None, prepare: Prepare) -> Any:
        """Exchange the model-wide vector with the held grouping, key by key in sorted order (the
        same order on every rank). No recipe runs in this scope (``optimizer=`` needs the model scope)."""
        torch = _torch()
        with torch.no_grad():
            for key in sorted(self.sps):
                sp = self.sps[key]
                runs = self.layout.key_runs(key)
                v = torch.cat([flat[o:o + n] for o, n in runs])
                sp.step(v, out=v)
                pos = 0
                for o, n in runs:
                    flat[o:o + n].copy_(v[pos:pos + n])
                    pos += n
                self.stats[key] = sp.stats
        return None

    def end_iteration(self) -> None:
        self.regroup = False

    def loaded(self) -> None:
        self.after_load = True

    def _adopt(self, key: Key) -> Any:
        """A sparsifier for a key seen for the first time, its residual carried over from the
        sparsifiers that held those parameters. Collective: the same keys come in the same order on
        every rank, so every rank loads (or not) together."""
        sp = self.make(self.layout.key_numel(key))
        owners = sorted({self.owner[i] for i in key if i in self.owner})
        entries = self.layout.held()
        if owners:
            held = {k: (self.sps[k].residual, self.layout.key_offsets(k)) for k in owners}
            res = np.zeros(sp.numel, dtype=np.result_type(*[r.dtype for r, _ in held.values()]))
            pos = 0
            for i in key:
                n = entries[i][0]
                if i in self.owner:
                    r, offs = held[self.owner[i]]
                    res[pos:pos + n] = r[offs[i]:offs[i] + n]
                pos += n
            d = sp.state_dict()
            d["residual"], d["dtype"] = res, res.dtype.str
            sp.load_state_dict(d)
        for i in key:
            self.owner[i] = key
        self.sps[key] = sp
        live = set(self.owner.values())
        for k in sorted(k for k in self.sps if k not in live):
            close_sparsifier(self.sps.pop(k))   # holds no parameter any more (same order on every rank: collective)
        return sp

    def sparsifiers(self) -> list[Any]:
        return list(self.sps.values())

    def close(self) -> None:
        for k in sorted(self.sps):
            close_sparsifier(self.sps[k])
        self.sps, self.owner = {}, {}

    def install(self, built: Built) -> None:
        self.sps, self.owner = {}, {}
        for key, sp in built:
            self.sps[key] = sp
            self.owner.update((i, key) for i in key)

    def state(self) -> Any:
        return [[list(k), self.sps[k].state_dict()] for k in sorted(self.sps)]

    def checked_state(self, state: Any, entries: list[Entry] | None) -> tuple[str | None, Any]:
        if not state:
            return None, state
        try:
            keys = [tuple(int(i) for i in key) for key, _ in state]
        except (TypeError, ValueError) as e:
            return f"malformed bucket state ({e})", state
        if sorted(i for key in keys for i in key) != list(range(len(required(entries)))):
            return "the bucket keys do not partition the layout", state
        return None, [[key, sd] for key, (_, sd) in zip(keys, state)]

    def state_shape(self, state: Any) -> Any:
        return [key for key, _ in state] if state else False

    def parts(self, state: Any, entries: list[Entry]) -> list[tuple[Key, int, Any]]:
        # keys come back as lists from a saved state (close() keeps one too): dict keys need tuples
        return [(tuple(key), sum(entries[i][0] for i in key), sd) for key, sd in state]


#: the scope objects by the name ``scope=`` gives
SCOPES: dict[str, type[ModelScope] | type[BucketScope]] = {"model": ModelScope, "bucket": BucketScope}
