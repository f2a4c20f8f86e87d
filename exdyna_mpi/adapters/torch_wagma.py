"""PyTorch adapter for WAGMA-SGD group model averaging: local step, then average the model.

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = GroupAveragingOptimizer(opt, model, group_size=2, sync_every=10, mode="wait_avoiding")
    for x, y in batches:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    opt.synchronize_model()   # a global average, e.g. before evaluating
    opt.close()               # collective: ends the progress thread

Every parameter's ``.data`` becomes a view into one flat buffer (``FlatParams``), so
``GroupAverager.step(flat, out=flat)`` averages the model in place with no copies. ``step()`` runs
the wrapped optimizer (momentum, weight decay act on the local gradient), then averages. Group size
1 is local SGD with period ``sync_every``. Construction broadcasts rank 0's parameters and buffers.
``state_dict()`` holds the wrapped optimizer's state plus the averager's (``"group_averager"``).
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Iterable, Literal

import exdyna_mpi
from exdyna_mpi import transport

from ._torch_common import _broadcast_model, _flat_layout, _OptimizerMixinBase, _torch, _wrap, _wrapped_params
from ._torch_config import CONFIG_KEY, EntryConfig, agree_entry, layout_text, optimizer_items

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI

__all__ = ["GroupAveragingOptimizer", "FlatParams"]


class FlatParams:
    """One contiguous parameter buffer; each parameter's ``.data`` is a view into it.

    Args:
        params: the parameters (those that require grad), of one dtype and device.

    Raises:
        ValueError: no parameter requires grad, or they differ in dtype or device.
    """

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        torch = _torch()
        self.params, self.numel = _flat_layout(params, "FlatParams")
        with torch.no_grad():
            self.flat = torch.cat([p.detach().reshape(-1) for p in self.params]).contiguous()
            off = 0
            for p in self.params:
                n = p.numel()
                p.data = self.flat[off:off + n].view_as(p)
                off += n


class _GroupAveragingMixin(_OptimizerMixinBase):
    averager: exdyna_mpi.GroupAverager   # set by ``_wrap``
    _wagma_params: FlatParams
    _wagma_config: EntryConfig

    def average(self) -> exdyna_mpi.Stats:
        """Average the model as the schedule says for this call (in place). Collective.

        Returns:
            The averager's stats of this call.

        Raises:
            StepError: the average refused the step (non-finite parameters on some rank).
        """
        with _torch().no_grad():
            self.averager.step(self._wagma_params.flat, out=self._wagma_params.flat)
        assert self.averager.stats is not None   # set by the step
        return self.averager.stats

    def step(self, closure: None = None) -> Any:   # type: ignore[override]  # no closures
        """The wrapped optimizer's local step, then the model average. Collective.

        Args:
            closure: must be None.

        Returns:
            The wrapped optimizer's ``step()`` result.

        Raises:
            ValueError: a closure was given.
            StepError: the average refused the step.
        """
        if closure is not None:
            raise ValueError("GroupAveragingOptimizer.step: closures are not supported")
        out = super().step()
        self.average()
        return out

    def synchronize_model(self) -> None:
        """A global average of the model outside the schedule (e.g. before evaluating). Collective."""
        with _torch().no_grad():
            self.averager.average_all(self._wagma_params.flat, out=self._wagma_params.flat)

    @property
    def stats(self) -> exdyna_mpi.Stats | None:
        """The averager's stats of the last step; None before the first."""
        return self.averager.stats

    @property
    def flat_params(self) -> torch.Tensor:
        """The flat parameter buffer that every parameter's ``.data`` is a view into."""
        return self._wagma_params.flat

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state plus the averager's, under ``"group_averager"``.

        Returns:
            The state dict of this rank.
        """
        d = super().state_dict()
        d["group_averager"] = self.averager.state_dict()
        d[CONFIG_KEY] = self._wagma_config.record()
        return d

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output. Collective, all or nothing.

        Args:
            state_dict: this rank's ``state_dict()`` output.

        Raises:
            CollectiveError: the wrapped optimizer's state or the averager's was refused on some rank
                (a ``ValueError``, raised on every rank); every rank's optimizer and averager stay as
                they were.
        """
        d = dict(state_dict)
        ga = d.pop("group_averager", None)
        saved = d.pop(CONFIG_KEY, None)
        before = copy.deepcopy(super().state_dict())
        problem = None if ga is not None else "the dict has no 'group_averager' state"
        problem = problem or self._wagma_config.mismatch(saved)
        if problem is None:
            try:
                super().load_state_dict(d)
            except (KeyError, ValueError, TypeError, RuntimeError) as e:
                problem = f"optimizer state refused on this rank: {e}"
        try:
            self.averager._load(ga, problem)
        except Exception:
            super().load_state_dict(before)   # leave this rank exactly as it was
            raise

    def close(self) -> None:
        """Close the averager (collective: it ends the progress thread)."""
        self.averager.close()


def GroupAveragingOptimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None, *,
                            group_size: int = 2, sync_every: int = 10,
                            mode: Literal["sync", "wait_avoiding"] = "sync",
                            comm: MPI.Comm | None = None, broadcast: bool = True) -> torch.optim.Optimizer:
    """Wrap a torch optimizer so ``step()`` is a local step followed by WAGMA model averaging.

    The result is an instance of a subclass of the optimizer's class sharing its state; use it in
    place of the original. ``opt.averager`` is the ``exdyna_mpi.GroupAverager``; ``opt.stats`` its
    last stats. Collective over ``comm``.

    Args:
        optimizer: the local ``torch.optim`` optimizer to wrap.
        model: a module whose parameters and buffers rank 0 broadcasts (optional).
        group_size: ranks per averaging group.
        sync_every: steps between global averages.
        mode: ``"sync"`` or ``"wait_avoiding"`` (docs/wagma.md).
        comm: the communicator (``MPI.COMM_WORLD`` when None).
        broadcast: broadcast rank 0's parameters at construction.

    Returns:
        The optimizer, now an instance of a subclass of its class whose ``step()`` averages after.

    Construction is collective and agreed before the broadcast (``_torch_config.py``): the
    averaging options, the optimizer's class and settings, the parameters' layout and the model's
    buffers must be the same on every rank; ``state_dict()`` records them and a load into another
    configuration is refused on every rank.

    Raises:
        CollectiveError: bad arguments on any rank, or ranks whose configurations differ (on every rank).
    """
    who = "GroupAveragingOptimizer"
    comm = transport.world() if comm is None else comm

    def plan() -> tuple[tuple[list[Any], int], EntryConfig]:
        """Every check, on this rank only, and the configuration they give; changes nothing."""
        _, params = _wrapped_params(optimizer, model, comm, who)
        params, numel = _flat_layout(params, who)
        if not isinstance(broadcast, bool):
            raise ValueError(f"{who}: broadcast must be True or False, got {broadcast!r}")
        items = {"entry": who, "group_size": repr(group_size), "sync_every": repr(sync_every), "mode": repr(mode),
                 **optimizer_items(optimizer), "layout": layout_text(params),
                 "buffers": layout_text(list(model.buffers()) if model is not None else []),
                 "broadcast": repr(broadcast)}
        return (params, numel), EntryConfig.of(who, items, unrecorded=("broadcast", "buffers"))

    (params, numel), config = agree_entry(comm, who, plan)
    # agreed: the averager's own checks, then the broadcast, which meets the same sizes on every rank
    ga = exdyna_mpi.GroupAverager(numel, comm, group_size=group_size, sync_every=sync_every, mode=mode)
    if broadcast:
        _broadcast_model(model, params, comm)
    flat = FlatParams(params)
    return _wrap(optimizer, _GroupAveragingMixin, "GroupAveraging", _wagma_params=flat, averager=ga,
                 _wagma_config=config)
