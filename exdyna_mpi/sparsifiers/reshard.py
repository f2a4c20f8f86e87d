"""Sparsifier layer: a state saved at ``P_old`` ranks resumed at another number of ranks
(``Sparsifier.load_state_dict(dicts, reshard=True)``).

``dicts`` is every old rank's ``state_dict()``, the same sequence on every new rank. The rule:

- every new rank's residual is the MEAN of the old ranks' residuals: their sum in old-rank order,
  divided by ``P_old``, in the residual's dtype. The exchange averages over the ranks, so what the
  residuals still owe the average is ``(1/P) * sum`` of them; with every new rank holding that mean,
  ``(1/P') * sum`` over the new ranks equals ``(1/P_old) * sum`` over the old: the pending average,
  the mass not yet sent, is kept exactly (up to the rounding of one sum and one division), and every
  new rank's residual is bit-identical. A dict whose residual is None (never stepped) stays None;
- the iteration is carried;
- the class's own entries come from ``reshard_extra_state`` (the shared state carried, what is
  laid out per rank made fresh for ``P'``; a class that cannot is refused clearly).

A load is all or nothing: every rank checks the whole sequence (header, options, the old ranks
0..P_old-1 exactly once each, equal iterations, each residual, the class's entries), then one
agreement that also compares a digest of the sequence, so ranks that were given different
sequences are refused too; a refusal raises the same ``CollectiveError`` on every rank and changes
nothing.

``reshard(sp, dicts, complete=False)`` is the elastic shrink: the survivors' dicts only (some old
ranks missing), the residual ``sum(known residuals) / P_old`` (the dead ranks' share is lost), the
largest iteration, and the class's entries from the dict of that iteration (the first such) alone.
"""
from __future__ import annotations

import zlib
from typing import Any, Mapping, Sequence

import numpy as np

from .._errors import CollectiveError
from ..transport import agree_problems
from . import checkpoint

__all__ = ["digest", "fresh_deadline_state", "old_ranks", "reshard"]

#: the header entries every old dict must share with the sparsifier it loads into
_SAME = ("name", "numel", "density")


def digest(obj: Any, crc: int = 0) -> int:
    """A CRC-32 of ``obj`` (mappings by sorted key, sequences in order, arrays by dtype, shape and
    bytes, anything else by ``repr``): equal on two ranks when they hold equal values.

    Args:
        obj: plain values, NumPy arrays, and mappings and sequences of them.
        crc: the running CRC to continue.

    Returns:
        The CRC, in ``[0, 2**32)``.
    """
    if isinstance(obj, Mapping):
        for k in sorted(obj, key=str):
            crc = digest(obj[k], zlib.crc32(repr(k).encode(), crc))
        return zlib.crc32(b"}", crc)
    if isinstance(obj, (list, tuple)):
        crc = zlib.crc32(f"[{len(obj)}".encode(), crc)
        for v in obj:
            crc = digest(v, crc)
        return crc
    if isinstance(obj, np.ndarray):
        crc = zlib.crc32(f"{obj.dtype.str}{obj.shape}".encode(), crc)
        return zlib.crc32(np.ascontiguousarray(obj).view(np.uint8).tobytes(), crc)
    return zlib.crc32(repr(obj).encode(), crc)


def old_ranks(ranks: Sequence[Any], nranks: Sequence[Any], complete: bool) -> tuple[list[int], int]:
    """Check the old ranks the dicts say they are, and order them.

    Args:
        ranks: each dict's ``"rank"``, in the order given.
        nranks: each dict's ``"nranks"``.
        complete: every old rank must be there (else some may be missing: the survivors).

    Returns:
        ``(order, P_old)``: the positions of the dicts in old-rank order, and the old rank count.

    Raises:
        ValueError: no dicts, different rank counts, a rank outside ``0..P_old-1`` or given twice,
            or (``complete``) a rank missing; the text names it.
    """
    if not ranks:
        raise ValueError("reshard=True takes a non-empty sequence of state dicts, one per old rank")
    counts = sorted({int(n) for n in nranks})
    if len(counts) != 1 or counts[0] < 1:
        raise ValueError(f"the dicts were saved at different numbers of ranks {counts}")
    n_old = counts[0]
    rs = [int(r) for r in ranks]
    for r in rs:
        if not 0 <= r < n_old:
            raise ValueError(f"a dict of old rank {r}, outside 0..{n_old - 1}")
    dup = sorted({r for r in rs if rs.count(r) > 1})
    if dup:
        raise ValueError(f"old rank {dup[0]} is given {rs.count(dup[0])} times (each old rank's dict once)")
    missing = sorted(set(range(n_old)) - set(rs))
    if complete and missing:
        raise ValueError(f"old rank {missing[0]} is missing ({len(missing)} of {n_old} old ranks' dicts "
                         f"missing: every old rank's state_dict() is needed)")
    return sorted(range(len(rs)), key=lambda i: rs[i]), n_old


def mass_mean(vectors: Sequence[np.ndarray], n_old: int, dtype: Any) -> np.ndarray:
    """``sum(vectors) / n_old`` in ``dtype``, summed in the order given (old-rank order): what each
    new rank holds of a rank-local mass not yet sent (a residual, a velocity).

    Args:
        vectors: the old ranks' vectors (all of them, or the survivors').
        n_old: the old rank count.
        dtype: the dtype of the sum and the result.

    Returns:
        The mean, a new array.

    Raises:
        ValueError: the sum is not finite (it overflows ``dtype``).
    """
    dt = np.dtype(dtype)
    acc = np.zeros(np.asarray(vectors[0]).shape, dt)
    for v in vectors:
        acc += np.asarray(v, dtype=dt)
    out = acc / dt.type(n_old)
    if not np.isfinite(out).all():
        raise ValueError(f"the sum of the old ranks' vectors overflows {dt}")
    return out


def fresh_deadline_state(sp: Any) -> dict[str, Any]:
    """The deadline option's entries at the new rank count: a fresh history. The history is the
    slowest rank's exchange times at the old rank count, which depend on it.

    Args:
        sp: a sparsifier with the deadline option.

    Returns:
        ``{"deadline": {"history": []}}`` in deadline mode, else ``{}``.
    """
    return {"deadline": {"history": []}} if sp.options.get("deadline_ms") is not None else {}


def _merged(sp: Any, dicts: Any, complete: bool) -> tuple[int, dict[str, Any]]:
    """This rank's checks of ``dicts`` (no communication): ``(iteration, the dict to install)``."""
    if isinstance(dicts, Mapping) or not isinstance(dicts, Sequence):
        raise ValueError(f"reshard=True takes a sequence of state dicts (every old rank's state_dict()), "
                         f"got {type(dicts).__name__}")
    if not all(isinstance(d, Mapping) for d in dicts):
        raise ValueError("reshard=True takes a sequence of state dicts: an entry is not a dict")
    order, n_old = old_ranks([d["rank"] for d in dicts], [d["nranks"] for d in dicts], complete)
    ds = [dicts[i] for i in order]
    mine = checkpoint.options_of(sp)
    for d in ds:
        r = int(d["rank"])
        for key in _SAME:
            if d[key] != getattr(sp, key):
                raise ValueError(f"old rank {r}'s dict has {key}={d[key]!r}, this sparsifier has {getattr(sp, key)!r}")
        if dict(d["options"]) != mine:
            raise ValueError(f"old rank {r}'s dict has options {dict(d['options'])!r}, this sparsifier {mine!r}")
        try:
            checkpoint.check_residual(d, sp.numel)
        except ValueError as e:
            raise ValueError(f"old rank {r}: {e}") from None
    its = [int(d["iteration"]) for d in ds]
    if complete and len(set(its)) > 1:
        raise ValueError(f"the old ranks hold different iterations {its} (dicts of different steps?)")
    it = max(its)
    source = ds[its.index(it)]
    held = [d["residual"] is not None for d in ds]
    if any(held) and not all(held):
        raise ValueError(f"old ranks {[int(d['rank']) for d, h in zip(ds, held) if not h]} hold no residual, "
                         "the others one")
    if len({d["dtype"] for d in ds}) > 1 or len({d.get("grad_dtype") for d in ds}) > 1:
        raise ValueError(f"the old ranks' residual dtypes differ: {[(d['dtype'], d.get('grad_dtype')) for d in ds]}")
    residual = mass_mean([d["residual"] for d in ds], n_old, source["dtype"]) if all(held) else None
    # complete=False: the class's shared state from the source dict alone (no equality check)
    extra = sp.reshard_extra_state(ds if complete else [source])
    merged = {"name": sp.name, "numel": sp.numel, "density": sp.density, "nranks": sp.nranks, "rank": sp.rank,
              "options": mine, "iteration": it, "dtype": source["dtype"], "grad_dtype": source.get("grad_dtype"),
              "residual": residual, **extra}
    sp.check_extra_state(merged)
    return it, merged


def reshard(sp: Any, dicts: Sequence[Mapping[str, Any]], *, complete: bool = True) -> None:
    """Load the old ranks' state dicts ``dicts`` into ``sp`` at its rank count (module docstring).
    Collective over ``sp``'s ranks; every rank passes the same sequence.

    Args:
        sp: the sparsifier to load, built at the new rank count.
        dicts: ``state_dict()`` outputs of the old run, one per old rank, in any order.
        complete: every old rank's dict is there (``load_state_dict(dicts, reshard=True)``); False:
            the survivors' only (the elastic shrink: module docstring).

    Returns:
        None.

    Raises:
        CollectiveError: any rank's problem with the sequence, or ranks given different sequences
            (on every rank, naming each rank and its problem); nothing changes.

    Example::

        >>> dicts = comm_old.allgather(sp_old.state_dict())     # saved at P_old ranks
        >>> sp = exdyna_mpi.make("exdyna", numel, 0.01, comm)   # P' ranks
        >>> sp.load_state_dict(dicts, reshard=True)             # the same as reshard(sp, dicts)
    """
    what = f"{sp.name}: load_state_dict(reshard=True) refused"
    problem: str | None = None
    it, crc, merged = -1, 0, None
    try:
        crc = digest(list(dicts))
        it, merged = _merged(sp, dicts, complete)
    except (NotImplementedError, ValueError) as e:
        problem = str(e) or type(e).__name__
    except (KeyError, TypeError, AttributeError) as e:
        problem = f"a state dict is malformed ({e!r})"
    got = agree_problems(sp.exchange, problem, what, [it, crc])
    if (got != got[0]).any():
        raise CollectiveError(f"{what}: the ranks were given different sequences of state dicts (every new rank "
                              "passes the same: every old rank's state_dict())")
    assert merged is not None   # agree_problems raised on every rank otherwise
    checkpoint.install(sp, it, merged)
