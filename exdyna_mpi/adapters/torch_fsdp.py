"""FSDP2 with ExDyna's sparse reduce-scatter: ``ShardedExchange``.

torch's ``fully_shard`` reduce-scatters each unit's gradient after its backward: rank r keeps the
average of shard r only. ``ShardedExchange(model, density)`` replaces that reduce-scatter, in every
``FSDPModule`` of ``model`` that owns parameters, with an ``ExDynaReduceScatter``: the unit's
padded gradient (P shards of S elements end to end, as FSDP lays it out) goes through a sharded
ExDyna step (``sparsifiers.sharded``: ExDyna's selection, threshold and error feedback, the
union's values sent to each shard's owner in one ``Alltoallv``) and rank r's shard of the averaged
sparse gradient is written where FSDP expects it. FSDP keeps its own process group for the
parameters' all-gather; the reduce-scatter runs over MPI. One sparsifier (and residual) per unit,
keyed by the unit's module name.

Plugs into torch 2.13's ``FSDPModule.set_custom_reduce_scatter`` (``ReduceScatter`` and its
allocation mixin come from torch's private ``_fully_shard`` modules: the plug-in point has no public
import path). FSDP must average (its default ``ReduceOp.AVG``); a divide factor or forced sums are
refused. The residual is the size of the unit on every rank: what that costs against FSDP's own
memory, and the options that bound it, are in docs/sharded.md.

Example::

    >>> from torch.distributed.fsdp import fully_shard
    >>> for layer in model.layers: fully_shard(layer)
    >>> fully_shard(model)
    >>> sharded = ShardedExchange(model, density=0.01)    # collective over MPI.COMM_WORLD
    >>> loss.backward(); opt.step()                        # FSDP calls the sparse reduce-scatter
    >>> state = sharded.state_dict()                       # per rank: the residuals and controllers
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..sparsifiers import REGISTRY
from ..sparsifiers.sharded import sharded
from ..transport import Exchange, agree_problems, world

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin


def unit_shard_numel(param_group: Any, p: int) -> int:
    """S, the elements of one rank's shard of an FSDP param group's reduce-scatter: per parameter
    that takes a gradient, its chunk (``ceil(d0 / P)`` rows along dim 0, or the even split along
    its shard dim), in the group's order."""
    total = 0
    for fp in param_group.fsdp_params:
        if not fp.sharded_param.requires_grad:
            continue
        size, d = tuple(fp._orig_size), fp.fsdp_placement.dim
        if not size:
            total += 1
            continue
        chunk = [math.ceil(s / p) if i == d else s for i, s in enumerate(size)]
        total += math.prod(chunk)
    return total


class ExDynaReduceScatter(DefaultAllocMixin, ReduceScatter):
    """One FSDP unit's reduce-scatter as a sharded sparsifier step (see the module).

    Args:
        sparsifier: the unit's sharded sparsifier (``sparsifiers.sharded``), of P x S elements with
            ``bounds`` ``r * S``.
        key: the unit's module name, for messages and the state dict.
    """

    def __init__(self, sparsifier: Any, key: str) -> None:
        self.sparsifier, self.key = sparsifier, key

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        sp = self.sparsifier
        kind = op.op if hasattr(op, "op") else op    # AVG and SUM arrive as RedOpType, not ReduceOp
        if kind != dist.ReduceOp.AVG:
            raise ValueError(f"ShardedExchange ({self.key!r}): FSDP must average gradients (ReduceOp.AVG); "
                             f"got {op} (a gradient divide factor or forced sums)")
        s = output_tensor.numel()
        if input_tensor.numel() != sp.numel or s * sp.nranks != sp.numel:
            raise ValueError(f"ShardedExchange ({self.key!r}): the unit's reduce-scatter has {input_tensor.numel()} "
                             f"elements, {s} a shard; its sparsifier was built for {sp.numel} (a parameter "
                             f"that got no gradient, or one frozen after construction?)")
        sp.step(input_tensor, out=input_tensor)       # in place: rank r's shard, zeros elsewhere
        r = sp.rank
        output_tensor.copy_(input_tensor[r * s: (r + 1) * s])
        return None


class ShardedExchange:
    """ExDyna's sparse reduce-scatter in every parameter-owning ``FSDPModule`` of ``model``.

    Args:
        model: a model ``fully_shard`` has been applied to (its units and the root).
        density: the fraction of each unit's elements exchanged per step.
        comm: the MPI communicator, the same ranks in the same order as FSDP's process group
            (``MPI.COMM_WORLD`` when None).
        sparsifier: a union-average sparsifier's name (``"exdyna"``, ``"micro"``, ``"topk"``, ...).
        **options: the sparsifier's options (``wire_dtype`` None, ``"bfloat16"`` or ``"float16"``).

    Raises:
        ValueError: on every rank, for a bad density or option, or units that differ between ranks
            (each sparsifier's construction agrees its configuration); FSDP process groups of
            another size than ``comm``.
        TypeError: a sparsifier that does not end in a union average.
    """

    def __init__(self, model: Any, density: float, comm: Any = None, sparsifier: str = "exdyna",
                 **options: Any) -> None:
        comm = world() if comm is None else comm
        p = Exchange(comm).size
        if dist.is_initialized() and dist.get_world_size() != p:
            raise ValueError(f"ShardedExchange: FSDP's process group has {dist.get_world_size()} ranks, the "
                             f"MPI communicator {p}")
        cls = sharded(REGISTRY[sparsifier])
        self.units: dict[str, ExDynaReduceScatter] = {}
        for name, module in model.named_modules():
            if not isinstance(module, FSDPModule):
                continue
            groups = module._get_fsdp_state()._fsdp_param_groups
            if not groups:
                continue
            s = unit_shard_numel(groups[0], p)
            bounds = np.arange(p + 1, dtype=np.int64) * s
            sp = cls(p * s, density, comm, bounds=bounds, **options)
            rs = ExDynaReduceScatter(sp, name or ".")
            module.set_custom_reduce_scatter(rs)
            self.units[name or "."] = rs

    def state_dict(self) -> dict[str, Any]:
        """Each unit's sparsifier state (residual, controller, iteration), keyed by module name: per
        rank, as the residuals are."""
        return {k: rs.sparsifier.state_dict() for k, rs in self.units.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the same units, each sparsifier's own checks. Collective and a
        transaction: a checkpoint refused on any rank raises the same error on every rank and leaves
        every unit as it was."""
        if not self.units:
            return
        first = next(iter(self.units.values())).sparsifier
        keys = set(state) if isinstance(state, dict) else set()
        problem = None if keys == set(self.units) else (
            f"the checkpoint has units {sorted(keys)}, the model {sorted(self.units)}")
        agree_problems(first.exchange, problem, "ShardedExchange: load_state_dict refused")
        before = self.state_dict()
        done: list[str] = []
        try:
            for k, rs in self.units.items():
                rs.sparsifier.load_state_dict(state[k])
                done.append(k)
        except Exception:
            for k in done:   # the refusal came on every rank at the same unit: undo the ones loaded
                self.units[k].sparsifier.load_state_dict(before[k])
            raise
