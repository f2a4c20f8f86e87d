"""The hook state's state dict: its format, this rank's checks, and the agreed all-or-nothing load.

Every rank saves and loads its own dict (the residuals differ). A dict holds ``version``, ``scope``,
``sparsifier``, ``density``, ``layout`` (``[numel, shape]`` per canonical index, or None),
``step``, ``state`` (``scope="model"``: the sparsifier's state dict or None; ``scope="bucket"``:
``[key, state dict]`` per bucket key, in sorted key order), with ``optimizer=`` the recipe's state
under ``recipe`` and with an Adam path its state under ``adam``, and the agreed configuration under
``config`` (added by ``ExDynaHookState.state_dict``).

A load checks the dict on this rank (``Checkpoint.check``: changes nothing), then agrees once over
the ranks and rebuilds everything new before anything is replaced (``Checkpoint.load``), so a dict
refused on any rank leaves every rank's state as it was.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

import exdyna_mpi
from exdyna_mpi import transport

from .._torch_common import _from_torch, _torch
from .._torch_options import check_state
from .iteration import IterationMachine
from .layout import Entry, ParamLayout
from .scopes import BucketScope, ModelScope, close_sparsifier
from .worker import HookWorker

if TYPE_CHECKING:
    from ..torch_adam import AdamPath
    from .._torch_config import EntryConfig
    from .._torch_options import Recipe

__all__ = ["VERSION", "Checked", "Checkpoint"]

VERSION = 1


class Checked(NamedTuple):
    """A dict as this rank's checks left it."""

    problem: str | None               # this rank's problem, or None
    got: dict[str, Any] | None        # the fields as they load (None with a problem)
    entries: list[Entry] | None       # the dict's layout (None with a problem, or a dict without one)


def _refused(problem: str) -> Checked:
    return Checked(problem, None, None)


class Checkpoint:
    """``state_dict()`` and ``load_state_dict()`` of one ``ExDynaHookState``.

    Args:
        config: the configuration the ranks agreed at construction.
        sparsifier: the sparsifier's name.
        density: its density.
        scope: the scope object.
        layout: the canonical layout.
        machine: the worker's iterations (step, recipe, a pending load).
        recipe_config: the training recipe, or None.
        adam: the Adam path, or None.
        worker: the worker thread and communicators.

    Raises:
        CollectiveError: from ``load``: any rank's problem, on every rank.
    """

    __slots__ = ("config", "sparsifier", "density", "scope", "layout", "machine", "recipe_config", "adam", "worker")

    def __init__(self, config: EntryConfig, sparsifier: str, density: float, scope: ModelScope | BucketScope,
                 layout: ParamLayout, machine: IterationMachine, recipe_config: Recipe | None, adam: AdamPath | None,
                 worker: HookWorker) -> None:
        self.config, self.sparsifier, self.density = config, sparsifier, density
        self.scope, self.layout, self.machine = scope, layout, machine
        self.recipe_config, self.adam, self.worker = recipe_config, adam, worker

    def save(self) -> dict[str, Any]:
        """This rank's dict (host values; the caller adds ``config``). On the worker, between iterations.

        Returns:
            The dict.
        """
        machine, pending, entries = self.machine, self.machine.to_load, self.layout.entries
        d = {"version": VERSION, "scope": self.scope.name, "sparsifier": self.sparsifier, "density": self.density,
             "layout": None if entries is None else [[n, list(s)] for n, s in entries], "step": machine.step}
        d["state"] = self.scope.state() if pending is None else pending["state"]   # loaded, not built yet
        if self.recipe_config is not None:
            if pending is not None:
                d["recipe"] = pending.get("recipe")
            else:   # None: no iteration yet
                d["recipe"] = None if machine.recipe is None else _to_host(machine.recipe.state_dict())
        if self.adam is not None:
            d["adam"] = _to_host(self.adam.state_dict())
        return d

    def check(self, d: Any) -> Checked:
        """This rank's checks of a ``state_dict()`` output; changes nothing.

        Returns:
            Its problem or None, the fields, the layout.
        """
        try:
            got = {k: d[k] for k in ("version", "scope", "sparsifier", "density", "layout", "step", "state")}
            got["state"] = _from_torch(got["state"])   # the sparsifiers' states as they load: NumPy
            mismatch = self.config.mismatch(d.get("config"))
            recipe_state = d.get("recipe")
            if isinstance(recipe_state, dict):
                d = dict(d, recipe={k: _from_torch(v) if k in ("dense", "stage_state") else v
                                    for k, v in recipe_state.items()})
        except (KeyError, TypeError, AttributeError) as e:
            return _refused(f"not a state_dict() output ({e!r})")
        for key, mine in (("version", VERSION), ("scope", self.scope.name), ("sparsifier", self.sparsifier),
                          ("density", self.density)):
            if got[key] != mine:
                return _refused(f"the dict has {key}={got[key]!r}, this state has {mine!r}")
        try:
            entries = None if got["layout"] is None else _as_entries(got["layout"])
            got["step"] = int(got["step"])
        except (TypeError, ValueError) as e:
            return _refused(f"malformed layout or step ({e})")
        if entries is not None and any(n < 0 or n != int(np.prod(shape)) for n, shape in entries):
            return _refused("malformed layout (an element count that does not match its shape)")
        mine_entries = self.layout.entries
        if mine_entries is not None and entries is not None and entries != mine_entries:
            return _refused(f"the dict's parameter layout ({len(entries)} parameters, {sum(n for n, _ in entries)} "
                            f"elements) differs from this state's ({len(mine_entries)} parameters, "
                            f"{self.layout.total} elements)")
        if entries is None and got["state"]:
            return _refused("sparsifier state without a layout")
        problem = self._check_recipe_and_adam(d, got)
        if problem is not None:
            return _refused(problem)
        problem, got["state"] = self.scope.checked_state(got["state"], entries)
        if problem is not None:
            return _refused(problem)
        if mismatch:   # after the checks that name a missing or malformed part
            return _refused(mismatch)
        return Checked(None, got, entries)

    def _check_recipe_and_adam(self, d: Any, got: dict[str, Any]) -> str | None:
        """The checks of the recipe's and the Adam path's parts (filling ``got``): the problem or None."""
        got["recipe"] = d.get("recipe") if isinstance(d, dict) else None
        if self.recipe_config is None and got["recipe"] is not None:
            return "the dict holds training-recipe state (saved with optimizer=), this state runs no recipe"
        if self.recipe_config is not None:
            if "recipe" not in d:
                return "the dict has no training-recipe state (saved without optimizer=)"
            if got["recipe"] is not None:
                try:
                    got["recipe_at"] = check_state(got["recipe"], self.recipe_config, self.layout.total)
                except (KeyError, TypeError, ValueError, AttributeError) as e:
                    return f"malformed training-recipe state ({e})"
        got["adam"] = d.get("adam") if isinstance(d, dict) else None
        if self.adam is None and got["adam"] is not None:
            return "the dict holds Adam-path state (saved with adam=), this state runs none"
        if self.adam is not None:
            if got["adam"] is None:
                return f"the dict has no Adam-path state, this state runs adam={self.adam.mode!r}"
            try:
                self.adam.check(got["adam"])
                got["adam_step"] = int(got["adam"]["step"])
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                return f"malformed Adam-path state ({e})"
        return None

    def load(self, checked: Checked) -> None:
        """Agree over the ranks, rebuild, then install (on the worker, or the caller before the
        first iteration). Collective.

        Raises:
            CollectiveError: any rank's problem (naming the ranks and causes), or the ranks' dicts
                differ; every rank's state stays as it was.
        """
        problem, got, entries = checked
        machine = self.machine
        shape = None if got is None else (got["step"], entries, self.scope.state_shape(got["state"]),
                                          got.get("recipe_at"), got.get("adam_step"), got.get("crc"))
        every = transport.Exchange(self.worker.working).gather_objects((problem, shape))
        parts = [f"rank {r}: {p}" for r, (p, _) in enumerate(every) if p]
        if not parts and any(sh != every[0][1] for _, sh in every):
            parts = ["the ranks' dicts differ in step, layout or sparsifiers (reshard=True: or the ranks were given "
                     "different sequences): "
                     + ", ".join(f"rank {r}: step {sh[0]}" for r, (_, sh) in enumerate(every))]
        if parts:
            raise exdyna_mpi.CollectiveError("ExDynaHookState.load_state_dict refused on all ranks, state "
                                             "unchanged: " + "; ".join(parts))
        assert got is not None   # check() gives no fields only with a problem, refused above
        if got["state"] or self.recipe_config is not None:
            self.worker.open()
        try:
            built, recipe = machine.rebuilt(got, entries)
        except exdyna_mpi.CollectiveError:
            raise
        except BaseException as e:   # noqa: BLE001 - one rank's failure: the others may wait in a collective
            self.worker.abort(e, "loading a state dict")
        old = self.scope.sparsifiers()
        machine.install(built, recipe)
        if self.adam is not None:   # checked by check() on every rank, agreed above
            self.adam.load_state_dict(got["adam"])
            machine.adam_due = False
        if entries is not None and self.layout.entries is None:
            self.layout.set(entries)
        self._took(got)
        for sp in old:
            close_sparsifier(sp)

    def take_unpickled(self, d: Any) -> None:
        """Take in a dict without any collective (unpickling is one rank's business): the worker
        builds its sparsifiers, and their states are checked collectively, at the first iteration.

        Raises:
            ValueError: this rank's checks refuse the dict.
        """
        problem, got, entries = self.check(d)
        if problem or got is None:
            raise ValueError(f"ExDynaHookState: cannot unpickle: {problem}")
        if entries is not None:
            self.layout.set(entries)
        self._took(got)
        self.machine.to_load = got if got["state"] else None

    def _took(self, got: dict[str, Any]) -> None:
        """What a load and an unpickling both set: the step, nothing pending, the scope told."""
        self.machine.step = got["step"]
        self.machine.to_load = None
        self.scope.loaded()


def _to_host(d: dict[str, Any]) -> dict[str, Any]:
    """A ``TrainingOptions`` or Adam-path state dict as host values: tensors as CPU copies (bfloat16
    has no NumPy dtype), the sparsifiers' states as they are (NumPy)."""
    return {k: v.detach().cpu().clone() if isinstance(v, _torch().Tensor) else v for k, v in d.items()}


def _as_entries(raw: Any) -> list[Entry]:
    return [(int(n), tuple(int(s) for s in shape)) for n, shape in raw]
