"""The hook state at another number of ranks: ``ExDynaHookState.load_state_dict(dicts, reshard=True)``.

``dicts`` is every old rank's ``state_dict()``, the same sequence on every new rank. Each is
checked as a load checks it (``Checkpoint.check``: version, scope, sparsifier, density, layout,
bucket keys, the recipe's and the Adam path's parts, the recorded configuration, which holds no
rank count); then the rule of ``_torch_reshard.py``, per sparsifier: the step, the layout and the
bucket keys are shared (equal in every dict), each sparsifier (the model's, or each bucket's) is
resharded by the sparsifier layer (its residual the mean over the old ranks), the recipe's velocity
and carry are their mean and the Adam path's per-rank entries their mean. The result loads through
the usual agreed, all-or-nothing ``Checkpoint.load``, which also compares a digest of the sequence.
"""
from __future__ import annotations

from typing import Any

from .._torch_reshard import (Resharded, ReshardedRecipe, check_shared, content, digest, merge_adam, merge_recipe,
                              ordered, sequence_of)
from .checkpoint import Checked, Checkpoint

__all__ = ["check_resharded"]


def _sparsifier_dicts(scope: str, state: Any) -> list[tuple[tuple[int, ...], Any]]:
    """(bucket key, the sparsifier's state dict) of each sparsifier a checked ``state`` holds."""
    if not state:
        return []
    if scope == "model":
        return [((), state)]
    return [(tuple(key), sd) for key, sd in state]


def _merged(cp: Checkpoint, dicts: Any, complete: bool) -> Checked:
    """This rank's checks of every old dict and the fields to load (no communication)."""
    given = sequence_of(dicts, "ExDynaHookState.state_dict()")
    checks = [cp.check(d) for d in given]
    for i, c in enumerate(checks):
        if c.problem is not None:
            raise ValueError(f"entry {i} of the sequence: {c.problem}")
    gots = [c.got for c in checks]
    assert all(g is not None for g in gots)   # no problem: check() gave the fields
    parts = [_sparsifier_dicts(cp.scope.name, g["state"]) for g in gots]   # type: ignore[index]
    if not any(parts):   # no iteration ran before the save: nothing is per rank
        check_shared([given[i] for i in range(len(given))], list(range(len(given))), "the state")
        return Checked(None, dict(gots[0], crc=digest(content(given))), checks[0].entries)   # type: ignore[arg-type]
    if not all(parts):
        raise ValueError("some old dicts hold sparsifier state and others none (dicts of different steps?)")
    order, ranks, n_old, source = ordered([p[0][1] for p in parts], complete)
    gots, parts = [gots[i] for i in order], [parts[i] for i in order]
    entries = checks[order[source]].entries
    keys = [[k for k, _ in p] for p in parts]
    check_shared(keys, ranks, "the bucket keys")
    if complete:
        check_shared([(g["step"], g["layout"]) for g in gots], ranks, "the step and layout")   # type: ignore[index]
    got = dict(gots[source])   # type: ignore[arg-type]
    per_key = [Resharded([p[j][1] for p in parts], complete) for j in range(len(keys[0]))]
    got["state"] = per_key[0] if cp.scope.name == "model" else [[list(k), r] for k, r in zip(keys[0], per_key)]
    if cp.recipe_config is not None and got.get("recipe") is not None:
        states = [g["recipe"] for g in gots]   # type: ignore[index]
        if any(s is None for s in states):
            raise ValueError("some old dicts hold training-recipe state and others none")
        plan = merge_recipe(states, ranks, n_old, source, complete, cp.recipe_config,
                             sum(n for n, _ in entries or []))
        got["recipe"] = ReshardedRecipe(plan, complete)
        got["recipe_at"] = (plan[0]["step"], plan[0].get("stage"))
    if cp.adam is not None:
        got["adam"] = merge_adam(cp.adam, [g["adam"] for g in gots], ranks, source, complete)   # type: ignore[index]
        got["adam_step"] = int(got["adam"]["step"])
    got["crc"] = digest(content(given))
    return Checked(None, got, entries)


def check_resharded(cp: Checkpoint, dicts: Any, complete: bool) -> Checked:
    """What ``Checkpoint.load`` takes for ``load_state_dict(dicts, reshard=True)`` (``complete=False``:
    the survivors' dicts only): the fields in this rank's terms, or this rank's problem. No
    communication; changes nothing.

    Args:
        cp: the hook state's checkpoint object.
        dicts: every old rank's ``state_dict()``.
        complete: every old rank's dict is there.

    Returns:
        The ``Checked`` fields (``got["crc"]``: the sequence's digest, which the load agrees on).
    """
    try:
        return _merged(cp, dicts, complete)
    except (ValueError, NotImplementedError) as e:
        return Checked(str(e) or type(e).__name__, None, None)
    except (KeyError, TypeError, AttributeError) as e:
        return Checked(f"a state dict is malformed ({e!r})", None, None)
