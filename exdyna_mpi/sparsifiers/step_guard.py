"""Sparsifier layer: the ways a step ends without committing, each leaving the state as it was.

``StepGuard`` holds what one step must give back if it is not agreed: the ``acc`` buffer it took
from the memory and the provisional binding it made (``snapshot``). The step template asks it:

- ``refused(words)`` after the first collective: raise the same ``StepError`` on every rank (bad
  input on any rank, or ranks stepping different sparsifiers or iterations), or tell a step that
  every rank skips (only non-finite values, ``nonfinite="skip"``);
- ``skip()``: a zero update and skipped ``stats``, nothing else changed;
- ``not_finite(cause)`` when ``combine`` raised ``SumNotFinite`` (on every rank alike, before any
  commit): refused or skipped as a non-finite gradient is.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import StepError
from .stats import Stats
from .step_words import StepWords

#: attributes a step that is refused or skipped does not take back with its binding: what the
#: template sets after the verdict, and a deadline exchange built collectively in the step
KEEPS = frozenset({"stats", "deadline"})


def snapshot(sp: Any) -> tuple[dict, dict]:
    """The attributes of the sparsifier ``sp`` and of its memory, to take a binding back."""
    return dict(vars(sp)), dict(vars(sp.memory))


def _restore(now: dict, then: dict, keeps: frozenset) -> None:
    """Make the attribute dict ``now`` what ``then`` was, but for the names in ``keeps``; no name that
    both hold is ever missing on the way (another thread may read one)."""
    for k in [k for k in now if k not in then and k not in keeps]:
        del now[k]
    for k, v in then.items():
        if k not in keeps:
            now[k] = v


class StepGuard:
    """One step's exits before it commits (see the module docstring).

    Args:
        sp: the sparsifier stepping.
        inp: the step's input view (``arrays.as_input``).
        out: the caller's output buffer (a backend array) or None.
    """

    __slots__ = ("sp", "inp", "out", "acc", "undo")

    def __init__(self, sp: Any, inp: Any, out: Any) -> None:
        self.sp, self.inp, self.out = sp, inp, out
        self.acc: Any = None                     # the buffer select filled, given back to the memory
        self.undo: tuple[dict, dict] | None = None   # a binding this step made (``snapshot``)

    def refused(self, words: np.ndarray) -> bool:
        """After the first collective's ``StepWords``: raise the same ``StepError`` on every rank,
        or return True for a step skipped everywhere, with the state untouched; False: it goes on."""
        sp = self.sp
        try:
            if StepWords.mismatch(words):
                self._order_error()
            skip = StepWords.check(words, sp.name, sp.numel, sp.nonfinite)
        except Exception:
            sp.memory.keep(self.acc)
            self.unbind()
            raise
        if skip:
            sp.memory.keep(self.acc)
        return skip

    def _order_error(self) -> None:
        """The ranks' first words name different sparsifiers or iterations: every rank has seen the
        same words, so each gathers the others' descriptions and raises the same ``StepError``."""
        sp = self.sp
        mine = f"{sp.name} #{sp.serial} at iteration {sp.iteration}"
        parts = "; ".join(f"rank {r}: {d}" for r, d in enumerate(sp.exchange.gather_objects(mine)))
        raise StepError(f"step refused on all ranks, state unchanged: the ranks step different sparsifiers or "
                        f"iterations ({parts}); every rank must step the same sparsifiers in the same order")

    def not_finite(self, cause: str) -> Any:
        """A step whose sum over ranks is not finite (``SumNotFinite``, on every rank alike): refused
        (``nonfinite="raise"``) or skipped, as a non-finite gradient is; nothing was committed."""
        sp = self.sp
        sp._undo_exchange()
        sp.memory.keep(self.acc)
        if sp.nonfinite == "skip":
            return self.skip()
        self.unbind()
        raise StepError(f"{sp.name}: step refused on all ranks, state unchanged: {cause}")

    def skip(self) -> Any:
        """A step skipped on every rank: zero update, nothing else changes (a binding it made is
        taken back, after its output and stats are made where the step ran)."""
        sp, inp, out = self.sp, self.inp, self.out
        if sp.ops is None:
            res = np.zeros(sp.numel, dtype=inp.array.dtype) if inp.array is not None else None
        else:
            res = out if out is not None else sp.ops.zeros(sp.numel, inp.array.dtype)
            sp.ops.fill_zero(res)
        sp.stats = Stats(iteration=sp.iteration, counts=np.zeros(sp.nranks, np.int64), selected=0,
                         density=0.0, threshold=None, bounds=None, owned=None,
                         bytes_sent=sp.exchange.bytes_sent, bytes_received=sp.exchange.bytes_received,
                         seconds={}, skipped=True)
        self.unbind()
        return inp.wrap(res)

    def unbind(self) -> None:
        """Take back the binding the step made, if it made one: every attribute of the sparsifier
        and of its memory as it was before the step."""
        if self.undo is None:
            return
        attrs, memory = self.undo
        _restore(vars(self.sp), attrs, KEEPS)
        _restore(vars(self.sp.memory), memory, frozenset())
