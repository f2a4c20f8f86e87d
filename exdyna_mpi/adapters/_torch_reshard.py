"""The torch entry points at another number of ranks: ``load_state_dict(dicts, reshard=True)``.

``dicts`` is every old rank's ``state_dict()`` (the same sequence on every new rank). What the old
ranks hold alike is taken from old rank 0's dict after checking that every old dict agrees (a
difference is refused, naming the first); what is rank-local becomes the mean over the old ranks:

- the sparsifier's residual: ``sparsifiers/reshard.py`` (the mean, in old-rank order);
- the recipe's (``_torch_options.py``): the step and the live density stage are shared; the
  momentum-correction velocity ``u`` and a stage's pending carry are each rank's own mass not yet
  sent: their mean (``sum / P_old``), as the residual's, keeps their average; the dense warm-up's
  and the live stage's sparsifiers are resharded as the main one (a class that cannot is refused);
- the Adam path's (``torch_adam/``): the entries its class declares ``rank_local`` (``"update"``'s
  per-rank moments ``m``, ``v``) become their mean over the dicts given; the rest is shared;
- the wrapped optimizer's state (SGD's momentum, a live AdamW's moments: computed from the
  exchanged average, identical on every rank), its param groups, the overlapped exchange's pending
  average and the configuration record (which holds no rank count) are shared.

The elastic shrink (``complete=False``) takes the survivors' dicts only: the shared parts come from
the dict of the largest sparsifier iteration (the first such) unchecked, the masses are
``sum(known) / P_old`` (the dead ranks' share is lost) and the per-rank statistics (Adam's
moments) the mean over the survivors.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

import exdyna_mpi
from exdyna_mpi import transport
from exdyna_mpi.sparsifiers.reshard import digest, mass_mean, old_ranks, reshard

from ._torch_common import _from_torch, _torch
from ._torch_config import CONFIG_KEY
from ._torch_options import OPTIONS_KEY, Recipe, TrainingOptions, check_state
from ._torch_overlap import OVERLAP_KEY
from .torch_adam import ADAM_KEY

SPARSIFIER_KEY = "exdyna_sparsifier"
OWN_KEYS = (CONFIG_KEY, SPARSIFIER_KEY, OPTIONS_KEY, ADAM_KEY, OVERLAP_KEY)
WHO = "DistributedOptimizer.load_state_dict(reshard=True) refused on every rank, state unchanged"


def content(obj: Any) -> Any:
    """``obj`` with its tensors and arrays as ``(kind, dtype, shape, bytes)``: equal contents, equal
    values bit for bit (whatever device or storage they came from)."""
    if isinstance(obj, Mapping):
        return {k: content(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [content(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return ("ndarray", obj.dtype.str, obj.shape, np.ascontiguousarray(obj).tobytes())
    torch = _torch()
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        return ("tensor", str(obj.dtype), tuple(obj.shape), t.view(torch.uint8).numpy().tobytes())
    return obj


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where the contents ``a`` and ``b`` first differ (a dotted path; ``"<top>"`` at the top), or None."""
    here = path or "<top>"
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                return f"{path}.{k}".lstrip(".")
            d = first_difference(a[k], b[k], f"{path}.{k}")
            if d is not None:
                return d.lstrip(".")
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return here
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{path}.{i}")
            if d is not None:
                return d.lstrip(".")
        return None
    return None if a == b else here


def check_shared(parts: Sequence[Any], ranks: Sequence[int], what: str) -> None:
    """Raise ``ValueError`` unless every old rank's ``parts`` entry equals old rank ``ranks[0]``'s.

    Args:
        parts: one value per old rank, in old-rank order.
        ranks: the old ranks.
        what: what the values are, for the message.
    """
    ref = content(parts[0])
    for part, r in zip(parts[1:], ranks[1:]):
        where = first_difference(ref, content(part))
        if where is not None:
            raise ValueError(f"{what} differs between old rank {ranks[0]} and old rank {r} (at {where}): "
                             "the state the ranks hold alike must be equal in every old dict")


def tensor_mean(tensors: Sequence[Any], divisor: int, what: str) -> Any:
    """``sum(tensors) / divisor`` (summed in the order given, in the tensors' dtype, on the host), or
    None when every entry is None.

    Raises:
        ValueError: some entries None and others not, or shapes or dtypes that differ.
    """
    torch = _torch()
    if all(t is None for t in tensors):
        return None
    if any(t is None for t in tensors):
        raise ValueError(f"{what}: some old ranks hold it and others none")
    host = [t.detach().cpu() for t in tensors]
    if len({(tuple(t.shape), t.dtype) for t in host}) != 1:
        raise ValueError(f"{what}: the old ranks' tensors differ in shape or dtype")
    if host[0].dtype in (torch.float32, torch.float64):   # the sparsifier layer's rule, to the bit
        out = mass_mean([t.numpy() for t in host], divisor, host[0].numpy().dtype)
        return torch.from_numpy(out).reshape(host[0].shape)
    acc = torch.zeros_like(host[0])
    for t in host:
        acc.add_(t)
    return acc.div_(divisor)


class Resharded(NamedTuple):
    """A sparsifier's state to load at the new rank count: the old ranks' dicts (``reshard``)."""

    dicts: list[dict[str, Any]]
    complete: bool


class ReshardedRecipe(NamedTuple):
    """A recipe's state to load at the new rank count (``merge_recipe`` output, ``load_recipe``)."""

    plan: tuple[dict[str, Any], list | None, list | None]
    complete: bool


def load_sparsifier(sp: Any, sd: Any) -> None:
    """``sp.load_state_dict(sd)``, or for a ``Resharded`` ``sd`` its reshard (collective)."""
    if isinstance(sd, Resharded):
        reshard(sp, sd.dicts, complete=sd.complete)
    else:
        sp.load_state_dict(sd)


def load_recipe_state(opts: TrainingOptions, d: Any) -> None:
    """``opts.load_state_dict(d)``, or for a ``ReshardedRecipe`` ``d`` its ``load_recipe`` (collective)."""
    if isinstance(d, ReshardedRecipe):
        load_recipe(opts, d.plan, d.complete)
    else:
        opts.load_state_dict(d)


class Plan(NamedTuple):
    """What this rank loads, after its checks (no communication yet)."""

    merged: dict[str, Any]          # the dict in this rank's terms: shared parts, means
    sparsifier: list[dict[str, Any]]   # the old sparsifier dicts (NumPy), old-rank order
    recipe: tuple[dict[str, Any], list | None, list | None] | None   # ``merge_recipe`` output
    crc: int                        # the digest of the sequence given


def ordered(sparsifier_dicts: Sequence[Mapping[str, Any]], complete: bool) -> tuple[list[int], list[int], int, int]:
    """``(order, old ranks in that order, P_old, source)`` of the old dicts: ``source`` indexes the
    dict the shared parts come from (old rank 0's; the shrink: the first dict given, the most
    advanced survivor's, whose parameters every survivor now holds)."""
    order, n_old = old_ranks([d["rank"] for d in sparsifier_dicts], [d["nranks"] for d in sparsifier_dicts], complete)
    return order, [int(sparsifier_dicts[i]["rank"]) for i in order], n_old, 0 if complete else order.index(0)


def sequence_of(dicts: Any, what: str) -> list[Any]:
    """``dicts`` as a list, or ``ValueError`` when it is not a sequence of dicts."""
    if isinstance(dicts, Mapping) or not isinstance(dicts, Sequence) or not dicts:
        raise ValueError(f"reshard=True takes a non-empty sequence of {what} outputs, one per old rank")
    if not all(isinstance(d, dict) for d in dicts):
        raise ValueError(f"reshard=True takes a sequence of {what} outputs: an entry is not a dict")
    return list(dicts)


def merge_recipe(states: Sequence[Mapping[str, Any]], ranks: Sequence[int], n_old: int, source: int,
                 complete: bool, recipe: Recipe, numel: int) -> tuple[dict[str, Any], list | None, list | None]:
    """The recipe's part (``"exdyna_options"``) at the new rank count: ``(the dict of this rank,
    the old dense warm-up sparsifier dicts or None, the old live stage's or None)``; raises
    ``ValueError`` for dicts that cannot (no communication)."""
    if complete:
        check_shared([(int(d["step"]), d.get("stage")) for d in states], ranks, "exdyna_options.step/stage")
    src = states[source]
    velocity = tensor_mean([d["velocity"] for d in states], n_old, "exdyna_options.velocity")
    merged: dict[str, Any] = {"step": int(src["step"]), "velocity": velocity}
    if recipe.stages:
        merged["stage"] = src.get("stage")
        merged["carry"] = tensor_mean([d.get("carry") for d in states], n_old, "exdyna_options.carry")
    check_state(merged, recipe, numel)
    dense = [_from_torch(d["dense"]) for d in states] if recipe.warmup_steps and "dense" in src else None
    stage = [_from_torch(d["stage_state"]) for d in states] if merged.get("stage") is not None else None
    return merged, dense, stage


def load_recipe(opts: TrainingOptions, plan: tuple[dict[str, Any], list | None, list | None], complete: bool) -> None:
    """Load a ``merge_recipe`` output into a fresh ``opts`` (collective: its sparsifiers reshard;
    the caller closes ``opts`` if this raises)."""
    merged, dense, stage = plan
    if opts.dense is not None and dense is not None:
        reshard(opts.dense, dense, complete=complete)
    if stage is not None:
        i = int(merged["stage"])
        opts.stage, opts.stage_index = opts._make_stage(opts.stages[i]), i   # collective
        reshard(opts.stage, stage, complete=complete)
    opts.step = merged["step"]
    opts.velocity = merged["velocity"]
    if opts.stages:
        opts.carry = merged.get("carry")


def merge_adam(adam: Any, states: Sequence[Mapping[str, Any]], ranks: Sequence[int], source: int,
               complete: bool) -> dict[str, Any]:
    """The Adam path's part: its ``rank_local`` tensors the mean over the dicts given, the rest
    shared (checked equal when ``complete``)."""
    local = tuple(getattr(adam, "rank_local", ()))
    if complete:
        check_shared([{k: v for k, v in d.items() if k not in local} for d in states], ranks, ADAM_KEY)
    merged = dict(states[source])
    for k in local:
        merged[k] = tensor_mean([d.get(k) for d in states], len(states), f"{ADAM_KEY}.{k}")
    return merged


def plan_optimizer(opt: Any, dicts: Any, complete: bool) -> Plan:
    """This rank's checks of every old rank's ``opt.state_dict()`` (no communication), and what it loads."""
    given = sequence_of(dicts, "DistributedOptimizer.state_dict()")
    crc = digest(content(given))
    for i, d in enumerate(given):
        if SPARSIFIER_KEY not in d:
            raise ValueError(f"entry {i} has no {SPARSIFIER_KEY!r}: not a DistributedOptimizer.state_dict() output")
    sps = [_from_torch(d[SPARSIFIER_KEY]) for d in given]
    order, ranks, n_old, source = ordered(sps, complete)
    ds, sps = [given[i] for i in order], [sps[i] for i in order]
    for d, r in zip(ds, ranks):
        problem = opt._exdyna_config.mismatch(d.get(CONFIG_KEY))
        if problem:
            raise ValueError(f"old rank {r}: {problem}")
    if complete:
        check_shared([{k: v for k, v in d.items() if k not in OWN_KEYS} for d in ds], ranks,
                     "the wrapped optimizer's state")
        if opt._exdyna_overlap is not None:
            check_shared([d.get(OVERLAP_KEY) for d in ds], ranks, f"{OVERLAP_KEY} (the pending exchanged average)")
    merged = dict(ds[source])
    adam, opts = opt._exdyna_adam, opt._exdyna_options
    for key, wanted in ((ADAM_KEY, adam is not None), (OPTIONS_KEY, opts.active)):
        lacking = [r for d, r in zip(ds, ranks) if not isinstance(d.get(key), dict)]
        if wanted and lacking:
            raise ValueError(f"old rank {lacking[0]}'s dict has no {key!r}, which this optimizer runs with")
    if adam is not None:
        merged[ADAM_KEY] = merge_adam(adam, [d[ADAM_KEY] for d in ds], ranks, source, complete)
    recipe = None
    if opts.active:
        recipe = merge_recipe([d[OPTIONS_KEY] for d in ds], ranks, n_old, source, complete, opts.recipe, opts.numel)
    problem = opt._check_dict(merged)   # presence of every part, the Adam path's and the overlap's checks
    if problem:
        raise ValueError(problem)
    return Plan(merged, sps, recipe, crc)


def reshard_optimizer(opt: Any, dicts: Any, complete: bool, own_state: Callable[[], dict[str, Any]],
                      own_load: Callable[[dict[str, Any]], None]) -> None:
    """``DistributedOptimizer.load_state_dict(dicts, reshard=True)`` (``complete=False``: the
    elastic shrink). Collective, all or nothing; ``own_state``/``own_load``: the wrapped
    optimizer's own ``state_dict``/``load_state_dict``.

    Raises:
        CollectiveError: any rank's problem (on every rank); nothing changes.
    """
    ov = opt._exdyna_overlap
    opt._settle_overlap()
    problem, plan = None, None
    before = copy.deepcopy(own_state())
    try:
        plan = plan_optimizer(opt, dicts, complete)
        try:   # torch's own checks, on this rank; undone below unless every rank's passes
            own_load({k: v for k, v in plan.merged.items() if k not in OWN_KEYS})
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise ValueError(f"the wrapped optimizer refused its state ({e})") from None
    except (ValueError, NotImplementedError) as e:
        problem = str(e) or type(e).__name__
    except (KeyError, TypeError, AttributeError) as e:
        problem = f"a state dict is malformed ({e!r})"
    fresh = None
    try:
        got = transport.agree_problems(transport.Exchange(opt._exdyna_comm), problem, WHO,
                                       [0 if plan is None else plan.crc])
        if (got != got[0]).any():
            raise exdyna_mpi.CollectiveError(f"{WHO}: the ranks were given different sequences of state dicts "
                                             "(every new rank passes the same: every old rank's state_dict())")
        assert plan is not None   # agree_problems raised on every rank otherwise
        old = opt._exdyna_options
        if plan.recipe is not None:   # a fresh recipe object, swapped in once everything loaded
            fresh = TrainingOptions(old.recipe, old.shapes, old.numel, opt.sparsifier.comm, old.who)
            load_recipe(fresh, plan.recipe, complete)
        reshard(opt.sparsifier, plan.sparsifier, complete=complete)
    except exdyna_mpi.CollectiveError:
        if fresh is not None:
            fresh.close()
        own_load(before)
        raise
    if fresh is not None:
        old.close()
        opt._exdyna_options = fresh
    merged = plan.merged
    if opt._exdyna_adam is not None:
        flat = opt._exdyna_grads.flat
        opt._exdyna_adam.load_state_dict({k: v.to(flat.device) if hasattr(v, "to") else v
                                          for k, v in merged[ADAM_KEY].items()})
    if ov is not None:
        ov.load_state_dict(merged[OVERLAP_KEY], opt.sparsifier)
        opt._exdyna_unused = list(merged[OVERLAP_KEY].get("unused", []))
