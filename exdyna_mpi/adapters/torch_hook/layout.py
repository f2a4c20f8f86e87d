"""The canonical parameter layout: where each of the model's parameters sits in the model-wide vector.

DDP hands the hook its gradients one bucket at a time, and which parameters share a bucket changes:
DDP's first iteration after construction uses its initial bucket assignment (the same for the same
model and ``bucket_cap_mb``) and rebuilds the buckets after it, in another order. The hook's state is
therefore keyed by parameter, never by bucket index. The *canonical order* is the order in which
the parameters appear across the buckets of the first iteration a model is seen (or, with
``optimizer=``, the optimizer's parameter order, fixed from the start); later iterations find each
parameter's place by identity.

``ParamLayout`` is plain Python over the parameters' identities, element counts and shapes (no MPI,
no process group, no torch import). The backward thread owns it: it locates each bucket's
parameters as the bucket arrives.

Example::

    >>> layout = ParamLayout()
    >>> w, b, v = torch.zeros(2, 4), torch.zeros(4), torch.zeros(4)
    >>> layout.begin([w, b])                 # the iteration's first bucket: a new model
    True
    >>> layout.locate([w, b], 12).key        # canonical indices of the bucket's parameters
    (0, 1)
    >>> layout.locate([v], 4).runs           # (offset in the bucket, in the model, length)
    [(0, 12, 4)]
    >>> layout.end()                         # the last bucket: the derived layout is installed
    >>> layout.entries, layout.total
    ([(8, (2, 4)), (4, (4,)), (4, (4,))], 16)
"""
from __future__ import annotations

import weakref
from typing import Any, NamedTuple, Sequence

import numpy as np

__all__ = ["Entry", "Key", "LayoutError", "ParamLayout", "Place", "Run", "required"]

#: canonical indices of a bucket's parameters, in bucket order
Key = tuple[int, ...]
#: (element count, shape) of one parameter
Entry = tuple[int, tuple[int, ...]]
#: (offset in the bucket, offset in the model-wide vector, length)
Run = tuple[int, int, int]


class LayoutError(ValueError):
    """The model's parameters do not match the state's layout. The layout comes from the model,
    which DDP checks to be the same on every rank, so every rank raises it together."""


class Place(NamedTuple):
    """Where one bucket's parameters sit."""

    key: Key            # canonical indices of its parameters, in bucket order
    runs: list[Run]     # its copy runs, contiguous ones merged
    new_model: bool     # this iteration derives the canonical order afresh (a model not seen before)


def required(entries: list[Entry] | None) -> list[Entry]:
    """``entries``, where a layout must be known: a sparsifier state or a recipe exists only with a
    layout (a state dict holding sparsifiers without one is refused; ``optimizer=`` sets it at
    construction).

    Raises:
        RuntimeError: ``entries`` is None.
    """
    if entries is None:
        raise RuntimeError("ExDynaHookState: no parameter layout where one must be known")
    return entries


class ParamLayout:
    """The canonical layout of one model's parameters, and the bucket-by-bucket derivation of it.

    Args:
        params: the parameters in their fixed canonical order (``optimizer=``: the optimizer's),
            or None to derive the order from the buckets of the first iteration of each model.

    Raises:
        LayoutError: from ``locate`` and ``end`` (see there).
    """

    __slots__ = (
        # The fields below are the layout: (numel, shape) per canonical index, and the offsets.
        "entries",      # list[Entry] | None: None until the first iteration (or a load) sets it
        "offsets",      # canonical index -> offset in the model-wide vector; offsets[-1]: the total
        "fixed",        # the order is given (the optimizer's), never derived from buckets
        # The fields below find parameters: id(param) -> (weak reference, canonical index).
        "_index",       # the model seen last (None: no model yet)
        # The fields below are this iteration's, from its first bucket to its last.
        "_in_iter",
        "_deriving",    # this iteration derives the order afresh
        "_new_index",
        "_new_entries",
        "_new_total",
        "_covered",     # parameters seen in this iteration's buckets
    )

    def __init__(self, params: Sequence[Any] | None = None) -> None:
        self.entries: list[Entry] | None = None
        self.offsets: list[int] = [0]
        self.fixed = params is not None
        self._index: dict[int, tuple[weakref.ref, int]] | None = None
        self._in_iter = False
        self._deriving = False
        self._new_index: dict[int, tuple[weakref.ref, int]] = {}
        self._new_entries: list[Entry] = []
        self._new_total = 0
        self._covered = 0
        if params is not None:
            self.set([(p.numel(), tuple(p.shape)) for p in params])
            self._index = {id(p): (weakref.ref(p), i) for i, p in enumerate(params)}

    @property
    def total(self) -> int:
        """The model's element count (0 while no layout is known)."""
        return self.offsets[-1]

    @property
    def in_iteration(self) -> bool:
        """Whether an iteration's first bucket was located and its last one not yet."""
        return self._in_iter

    def set(self, entries: Sequence[Entry]) -> None:
        """Install ``entries`` as the layout (the parameters' index is left as it is)."""
        self.entries = list(entries)
        self.offsets = [0] + np.cumsum([n for n, _ in entries], dtype=np.int64).tolist()

    def held(self) -> list[Entry]:
        """The layout, where the caller runs only once it is known.

        Raises:
            RuntimeError: no layout is known.
        """
        return required(self.entries)

    def index_of(self, p: Any) -> int | None:
        """``p``'s canonical index in the model seen last; None if it was not in that model."""
        got = None if self._index is None else self._index.get(id(p))
        return got[1] if got is not None and got[0]() is p else None

    # ------------------------------------------------------------------ one iteration's buckets
    def begin(self, params: Sequence[Any]) -> bool:
        """Start an iteration at its first bucket (``params``: that bucket's parameters), which
        decides whether the iteration derives the order afresh: a parameter not in the model seen
        last means a new model. A no-op inside an iteration.

        Returns:
            Whether this call started an iteration.
        """
        if self._in_iter:
            return False
        self._in_iter = True
        self._deriving = not self.fixed and (self._index is None
                                             or not all(self.index_of(p) is not None for p in params))
        self._new_index, self._new_entries, self._new_total = {}, [], 0
        self._covered = 0
        return True

    def locate(self, params: Sequence[Any], numel: int) -> Place:
        """Where a bucket of ``numel`` elements holding ``params`` (in bucket order) sits.

        Returns:
            Its key, its copy runs and whether this iteration derives the order afresh.

        Raises:
            LayoutError: the parameters do not fill the bucket; deriving: a parameter seen twice
                this iteration, or one that differs from the layout already held; else a
                parameter not in the model seen last (not among the fixed order's).
        """
        held = sum(p.numel() for p in params)
        if held != numel:
            raise LayoutError(f"ExDynaHookState: a bucket of {numel} elements holds parameters of "
                              f"{held} (sparse gradients are not supported)")
        key: list[int] = []
        runs: list[Run] = []
        src = 0
        for p in params:
            n = p.numel()
            if self._deriving:
                i = len(self._new_entries)
                entry = (n, tuple(p.shape))
                if id(p) in self._new_index:
                    raise LayoutError("ExDynaHookState: a parameter appears in two buckets of one iteration")
                if self.entries is not None and (i >= len(self.entries) or self.entries[i] != entry):
                    have = self.entries[i] if i < len(self.entries) else "nothing"
                    raise LayoutError(f"ExDynaHookState: the model's parameter {i} (in bucket order) is {entry} "
                                      f"(numel, shape), the state's layout has {have}: a state belongs to one "
                                      "architecture and bucket_cap_mb")
                self._new_index[id(p)] = (weakref.ref(p), i)
                self._new_entries.append(entry)
                dst = self._new_total
                self._new_total += n
            else:
                known = self.index_of(p)
                if known is None:
                    raise LayoutError("ExDynaHookState: a bucket holds a parameter that is not among the "
                                      "optimizer's parameters" if self.fixed else
                                      "ExDynaHookState: a bucket holds a parameter that was not in this model's "
                                      "first iteration")
                i = known
                dst = self.offsets[i]
            key.append(i)
            if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)   # contiguous: one copy
            else:
                runs.append((src, dst, n))
            src += n
        self._covered += len(params)
        return Place(tuple(key), runs, self._deriving)

    def end(self) -> None:
        """At the iteration's last bucket: install the derived index (and the layout, the first time).

        Raises:
            LayoutError: a fixed order whose parameters the buckets did not all hold; deriving: a
                model with another parameter count than the layout held.
        """
        self._in_iter = False
        if self.fixed and self._covered != len(self.held()):
            raise LayoutError(f"ExDynaHookState: DDP's buckets hold {self._covered} parameters, the optimizer "
                              f"{len(self.held())} that require grad: optimizer= needs the same parameters")
        if not self._deriving:
            return
        if self.entries is not None and len(self._new_entries) != len(self.entries):
            raise LayoutError(f"ExDynaHookState: the model has {len(self._new_entries)} parameters, the state's "
                              f"layout {len(self.entries)}")
        if self.entries is None:
            self.set(self._new_entries)
        self._index = self._new_index

    def abandon(self) -> None:
        """End the iteration without installing anything (its last bucket could not be located)."""
        self._in_iter = False

    # ------------------------------------------------------------------ keys (scope="bucket")
    def key_numel(self, key: Key) -> int:
        """The element count of the parameters of ``key``."""
        entries = self.held()
        return sum(entries[i][0] for i in key)

    def key_offsets(self, key: Key) -> dict[int, int]:
        """Canonical index -> offset in ``key``'s vector (its parameters in key order)."""
        offs: dict[int, int] = {}
        pos = 0
        entries = self.held()
        for i in key:
            offs[i] = pos
            pos += entries[i][0]
        return offs

    def key_runs(self, key: Key) -> list[tuple[int, int]]:
        """(offset in the model-wide vector, length) of each parameter of ``key``, in key order."""
        entries = self.held()
        return [(self.offsets[i], entries[i][0]) for i in key]
