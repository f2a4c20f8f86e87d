"""Sparsifier layer: a sparsifier's state dict, made and loaded (``Sparsifier.state_dict`` and
``load_state_dict``).

The dict holds host copies only (safe to pickle): the header (name, numel, density, ranks, rank,
options, iteration), the residual with its dtype and the gradients' dtype, and the sparsifier's own
entries (``extra_state``). A load is all or nothing: every rank checks its whole dict (header,
residual, the sparsifier's own entries through ``check_extra_state``) before one agreement, so a
wrong dict on any rank raises the same ``CollectiveError`` on every rank and changes no state.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .._errors import CollectiveError
from ..transport import agree_problems

#: the header entries a dict must match this sparsifier in
_HEADER = ("name", "numel", "nranks", "rank", "density")


def state_of(sp: Any) -> dict[str, Any]:
    """The state dict of the sparsifier ``sp`` (not collective)."""
    dtype = sp.memory.dtype
    return {
        "name": sp.name, "numel": sp.numel, "density": sp.density, "nranks": sp.nranks,
        "rank": sp.rank, "options": dict(sp.options), "iteration": sp.iteration,
        "dtype": None if dtype is None else dtype.str,
        "grad_dtype": sp._grad_dtype,
        "residual": None if not sp.memory.held else sp.residual,
        **sp.extra_state(),
    }


def check_residual(d: Mapping[str, Any], numel: int) -> None:
    """Raise ``ValueError`` unless the residual of ``d`` fits a sparsifier of ``numel`` elements:
    its dtype (float32 or float64, as the dict says), its length and its finiteness."""
    res = d["residual"]
    if res is None:
        return
    if d["dtype"] is None:
        raise ValueError("a residual without a dtype")
    dtype = np.dtype(d["dtype"])
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"residual dtype {dtype} is not float32 or float64")
    arr = np.asarray(res)
    if arr.shape != (numel,):
        raise ValueError(f"residual has shape {arr.shape}, this sparsifier has {numel} elements")
    if arr.dtype != dtype:
        raise ValueError(f"residual is {arr.dtype}, the dict says {dtype}")
    if not np.isfinite(arr).all():
        raise ValueError("residual holds non-finite values")


def load(sp: Any, d: Mapping[str, Any]) -> None:
    """Collective: check ``d`` on every rank, agree, then load it into ``sp`` (or raise on all)."""
    problem = None
    try:
        for key in _HEADER:
            mine = getattr(sp, key)
            if d[key] != mine:
                problem = f"state_dict has {key}={d[key]!r}, this sparsifier has {mine!r}"
                break
        it = int(d["iteration"])
        if problem is None:
            check_residual(d, sp.numel)
            sp.check_extra_state(d)
    except (KeyError, TypeError, ValueError) as e:
        problem, it = f"state_dict is malformed ({e})", -1
    got = agree_problems(sp.exchange, problem, f"{sp.name}: load_state_dict refused", [it])
    if (got[:, 0] != got[0, 0]).any():
        raise CollectiveError(f"{sp.name}: load_state_dict refused: ranks hold different iterations "
                              f"{got[:, 0].tolist()}")
    install(sp, it, d)


def options_of(sp: Any) -> dict[str, Any]:
    """The ``"options"`` entry of ``sp``'s state dict (a class's ``extra_state`` may write its own)."""
    return dict(sp.extra_state().get("options", sp.options))


def install(sp: Any, it: int, d: Mapping[str, Any]) -> None:
    """Load the agreed, checked state ``d`` (residual, dtypes, extra state) into ``sp`` at iteration
    ``it``; not collective (a deadline exchange's load completes what is in flight)."""
    sp.exchange.reset_counters()
    sp.iteration = it
    # an unbound sparsifier (device="auto", no step yet) keeps the residual on the host until
    # its first gradient names the device (binding it to the CPU here would refuse CUDA input)
    sp.memory.load(sp.ops, d["dtype"], d["residual"])
    # older dicts lack "grad_dtype": the residual's dtype then fixes what a gradient computes in
    sp._grad_dtype = d.get("grad_dtype") if d["residual"] is not None else None
    sp.load_extra_state(d)
