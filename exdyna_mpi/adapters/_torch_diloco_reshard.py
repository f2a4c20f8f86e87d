"""``DiLoCo`` at another number of ranks: ``DiLoCo.load_state_dict(dicts, reshard=True)``.

``dicts`` is every old rank's ``DiLoCo.state_dict()``, the same sequence on every new rank. The
rule (the torch entry points' of ``_torch_reshard.py``):

- shared, from old rank 0's dict after checking every old dict agrees: the global parameters, the
  outer optimizer's state, ``outer_steps``, the inner optimizer's param groups;
- the sparsifier: resharded by the sparsifier layer (its residual the mean over the old ranks);
- the inner optimizer's state, which is each rank's own (its moments follow its own gradients): the
  mean of its floating tensors over the old ranks; its ``step`` entries and every non-floating one
  must be equal;
- every rank's local model restarts from the global parameters and ``inner_steps`` is 0: the local
  steps taken since the last outer step are dropped (the models they made differ by rank and have no
  place at the new rank count).

The elastic shrink (``complete=False``) takes the survivors' dicts: the shared parts from the dict
of the largest sparsifier iteration (the first such) unchecked, the inner means over the survivors.
"""
from __future__ import annotations

import copy
from typing import Any

import exdyna_mpi
from exdyna_mpi import transport
from exdyna_mpi.sparsifiers.reshard import digest, reshard

from ._torch_common import _from_torch, _torch
from ._torch_reshard import check_shared, content, ordered, sequence_of, tensor_mean

WHO = "DiLoCo.load_state_dict(reshard=True) refused on all ranks, state unchanged"


def _inner_mean(states: list[dict[str, Any]], ranks: list[int], source: int, complete: bool) -> dict[str, Any]:
    """The inner optimizer's dict at the new rank count: param groups shared, floating state
    tensors the mean over the dicts given, ``step`` and the other entries equal."""
    torch = _torch()
    src = states[source]
    if complete:
        check_shared([s["param_groups"] for s in states], ranks, "the inner optimizer's param groups")
    params = sorted({k for s in states for k in s["state"]}, key=str)
    out: dict[str, Any] = {"state": {}, "param_groups": copy.deepcopy(src["param_groups"])}
    for p in params:
        per = [s["state"].get(p) for s in states]
        if any(v is None for v in per):
            raise ValueError(f"the inner optimizer's state of parameter {p} is in some old dicts and not others")
        merged = {}
        for key in sorted({k for v in per for k in v}, key=str):
            vals = [v.get(key) for v in per]
            floating = all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in vals)
            if key == "step" or not floating:
                check_shared(vals, ranks, f"the inner optimizer's state.{p}.{key}")
                merged[key] = vals[source]
            else:
                merged[key] = tensor_mean(vals, len(vals), f"the inner optimizer's state.{p}.{key}")
        out["state"][p] = merged
    return out


def _plan(dl: Any, dicts: Any, complete: bool) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]], int]:
    """This rank's checks of every old dict (no communication): ``(inner dict, outer part, the old
    sparsifier dicts in old-rank order, the sequence's digest)``."""
    given = sequence_of(dicts, "DiLoCo.state_dict()")
    crc = digest(content(given))
    owns = []
    for i, d in enumerate(given):
        problem, own = dl._check(d)
        if problem is not None:
            raise ValueError(f"entry {i} of the sequence: {problem}")
        owns.append(own)
    sps = [_from_torch(own["sparsifier"]) for own in owns]
    order, ranks, _, source = ordered(sps, complete)
    given, owns, sps = [given[i] for i in order], [owns[i] for i in order], [sps[i] for i in order]
    if complete:
        check_shared([{k: own[k] for k in ("global", "outer", "outer_steps")} for own in owns], ranks,
                     "the global parameters, outer optimizer or outer_steps")
    inner = _inner_mean([d["inner"] for d in given], ranks, source, complete)
    return inner, owns[source], sps, crc


def reshard_diloco(dl: Any, dicts: Any, complete: bool) -> None:
    """``DiLoCo.load_state_dict(dicts, reshard=True)`` (``complete=False``: the elastic shrink).
    Collective, all or nothing.

    Raises:
        CollectiveError: any rank's problem (on every rank); nothing changes.
    """
    problem, crc, plan = None, 0, None
    inner_before = copy.deepcopy(dl.optimizer.state_dict())
    outer_before = copy.deepcopy(dl.outer.state_dict())
    try:
        plan = _plan(dl, dicts, complete)
        crc = plan[3]
        try:   # torch's own checks of the inner and outer optimizers' dicts, on this rank
            dl.optimizer.load_state_dict(plan[0])
            dl.outer.load_state_dict(plan[1]["outer"])
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"an optimizer refused its state ({e})") from None
    except (ValueError, NotImplementedError) as e:
        problem = str(e) or type(e).__name__
    except (KeyError, TypeError, AttributeError) as e:
        problem = f"a state dict is malformed ({e!r})"
    try:
        got = transport.agree_problems(dl._exchange, problem, WHO, [crc])
        if (got != got[0]).any():
            raise exdyna_mpi.CollectiveError(f"{WHO}: the ranks were given different sequences of state dicts "
                                             "(every new rank passes the same: every old rank's state_dict())")
        assert plan is not None   # agree_problems raised on every rank otherwise
        reshard(dl.sparsifier, plan[2], complete=complete)
    except exdyna_mpi.CollectiveError:
        dl.optimizer.load_state_dict(inner_before)
        dl.outer.load_state_dict(outer_before)
        raise
    own = plan[1]
    with _torch().no_grad():
        dl.global_params.copy_(own["global"])
    dl._set_local(dl.global_params.detach())   # the local steps since the last outer step are dropped
    dl.inner_steps, dl.outer_steps = 0, int(own["outer_steps"])
