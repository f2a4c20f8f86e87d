"""Sparsifier layer: the first collective of a step, its words, and its two paths.

``StepWords`` is the error-word protocol every rank's words open with (it also names the sparsifier
and the step, so ranks that step different sparsifiers or iterations are refused there);
``RankWords`` what ``combine`` gets of the gathered words. The first collective takes one of two
paths, with one interface (``FirstCollective.agree``):

- ``GatheredWords`` (``Selector.sum_size`` 0): one Allgather of every rank's ``StepWords`` and
  report words, after ``select``;
- ``SummedWords`` (``sum_size`` > 0): one Allreduce of the error flags and the selector's summed
  words (constant in P), then ``choose`` and an Allgather of the counts and report words; on any
  problem the ``StepWords`` Allgather gathers the details.

Either path returns the same ``RankWords`` layout, or None for a step skipped on every rank; a
refusal raises on every rank (through the step's ``StepGuard``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import numpy as np

from .._errors import InputCode, StepError, refusal
from ..arrays import ACCEPTED_DTYPES, DTYPE_NAMES
from .timing import timed

__all__ = ["GATHERED", "NONFINITE_CODES", "FirstCollective", "GatheredWords", "RankWords", "StepWords", "SummedWords",
           "first_collective"]


class StepWords:
    """The error-word protocol: ``[count, InputCode, detail, dtype code]`` opens every rank's words
    in the first collective, so a problem on any rank is seen by all before anyone moves on.

    The words also name the step: the iteration rides above the code's ``CODE_BITS`` in word 1, the
    sparsifier's identity (``Sparsifier.ident``) above the dtype code's in word 3, so no word is
    added and nothing more is sent. Ranks whose words name different sparsifiers or iterations (one
    rank steps ``a`` then ``b``, another ``b`` then ``a``) are refused on every rank (``mismatch``).
    A summed first collective carries a small hash of the same (``tag_word``) in its flags.
    """

    N = 4
    CODE_BITS = 8
    #: the dtype codes are below this (``arrays.DTYPE_NAMES``): the span of the code in a flag word
    CODE_SPAN = 32

    @staticmethod
    def make(count, err, dtype_code, tag=(0, 0)):
        """Words ``[count, code | t << 8, detail, dtype | ident << 8]``; ``tag``: ``(ident, t)``."""
        code, detail = err if err is not None else (InputCode.OK, 0)
        ident, t = (int(x) for x in tag)
        b = StepWords.CODE_BITS
        return [count, int(code) | (t << b), int(detail), int(dtype_code) | (ident << b)]

    @staticmethod
    def fields(words):
        """``(code, iteration, dtype code, ident)`` columns of gathered (P, >= 4) words."""
        b, m = StepWords.CODE_BITS, (1 << StepWords.CODE_BITS) - 1
        return words[:, 1] & m, words[:, 1] >> b, words[:, 3] & m, words[:, 3] >> b

    @staticmethod
    def mismatch(words):
        """Whether the ranks' words name different sparsifiers or iterations."""
        _, its, _, ids = StepWords.fields(words)
        return bool((its != its[0]).any() or (ids != ids[0]).any())

    @staticmethod
    def check(words, name, numel, nonfinite):
        """Raise the same StepError on every rank if any rank reported a problem; return True when
        the step is skipped on every rank (only non-finite values, policy ``"skip"``)."""
        codes, _, dts, _ = StepWords.fields(words)
        if codes.any():
            bad = [(r, int(codes[r]), int(words[r, 2])) for r in range(words.shape[0]) if codes[r]]
            if nonfinite == "skip" and all(c in NONFINITE_CODES for _, c, _ in bad):
                return True
            raise StepError(f"{name}: " + refusal(bad, numel, DTYPE_NAMES, accepted=ACCEPTED_DTYPES))
        if (dts != dts[0]).any():
            names = ", ".join(f"rank {r}: {DTYPE_NAMES.get(int(d), '?')}" for r, d in enumerate(dts))
            raise StepError(f"{name}: step refused on all ranks, state unchanged: "
                            f"ranks pass different dtypes ({names})")
        return False

    @staticmethod
    def tag_modulus(nranks, word_dtype):
        """How many values ``tag_word`` takes: the most for which P times the square of a flag word
        (``flags``) still fits ``word_dtype`` (>= 1; 1024 at P = 2 in int32, 45 at P = 1024)."""
        top = int(np.iinfo(word_dtype).max) // max(int(nranks), 1)
        return max(1, math.isqrt(top) // StepWords.CODE_SPAN)

    @staticmethod
    def tag_word(ident, t, modulus):
        """A small word for a summed first collective naming sparsifier ``ident`` at step ``t``:
        the same sparsifier at steps less than ``modulus`` apart, or two sparsifiers at one step whose
        serials are less than ``modulus`` apart, always get different words (2654435761 is a prime
        larger than any modulus)."""
        return (int(ident) * 2654435761 + int(t)) % int(modulus)

    @staticmethod
    def flags(err, dtype_code, tag_word=0):
        """The error words of a summed first collective: ``[refusing ranks, y, y squared]`` with
        ``y = dtype code + CODE_SPAN * tag_word``."""
        y = int(dtype_code) + StepWords.CODE_SPAN * int(tag_word)
        return [0 if err is None else 1, y, y * y]

    @staticmethod
    def flags_ok(summed, nranks):
        """No rank refused and every rank passed the same dtype and tag word (P * sum y^2 ==
        (sum y)^2 holds exactly when all the ``y`` are equal)."""
        n_bad, s1, s2 = (int(x) for x in summed[:3])
        return n_bad == 0 and nranks * s2 == s1 * s1


#: the codes a ``nonfinite="skip"`` step skips (every other refusal raises)
NONFINITE_CODES = (InputCode.NONFINITE, InputCode.OVERFLOW)




@dataclasses.dataclass(frozen=True, eq=False)
class RankWords:
    """Every rank's words of the step as ``combine`` receives them, one layout on every path.

    ``counts`` (P,) int64: each rank's ``Selection.count`` (its own array). ``report`` (P, R) int64:
    each rank's ``Selection.words`` (R = ``report_size``; a view of the gathered words; R may be 0).
    Row r is rank r's. ``gathered`` builds it from either first collective's words.
    """

    counts: np.ndarray
    report: np.ndarray

    @classmethod
    def gathered(cls, words: np.ndarray, head: int) -> RankWords:
        """From gathered (P, head + R) int64 words: column 0 each rank's count, then ``head - 1``
        protocol words the template has read (``StepWords.N``: the ``StepWords`` Allgather; 1: the
        count gathered after a summed first collective, whose flags the sum agreed), then the report."""
        return cls(np.array(words[:, 0], dtype=np.int64), words[:, head:])


class FirstCollective(Protocol):
    """A path of the step's first collective (``GatheredWords``, ``SummedWords``)."""

    def agree(self, sp: Any, step: Any, sel: Any, err: Any, code: int, guard: Any) -> tuple[Any, RankWords] | None:
        """Collective: agree this rank's words with every other rank's.

        Args:
            sp: the sparsifier stepping.
            step: the step's ``roles.Step``.
            sel: this rank's ``Selection`` (None when ``err`` was found before ``select``).
            err: this rank's problem ``(InputCode, detail)``, or None.
            code: the gradient's dtype code (0 with ``err``).
            guard: the step's ``StepGuard``: its ``refused(words)`` raises or tells a skip.

        Returns:
            ``(sel, words)``: the selection (chosen, on the summed path) and every rank's
            ``RankWords``; None when the step is skipped on every rank.
        """


class GatheredWords:
    """The first collective as one Allgather: ``StepWords`` and the report words of every rank."""

    def agree(self, sp: Any, step: Any, sel: Any, err: Any, code: int, guard: Any) -> tuple[Any, RankWords] | None:
        """``FirstCollective.agree``."""
        with timed(step.sec, "counts"):
            report = list(sel.words) if err is None else [0] * sp.report_size(step)
            words = sp.exchange.agree(StepWords.make(sel.count if err is None else 0, err, code, (sp.ident, step.t))
                                      + report)
        if guard.refused(words):
            return None
        return sel, RankWords.gathered(words, StepWords.N)


@dataclasses.dataclass(frozen=True)
class SummedWords:
    """The first collective as one Allreduce of the error flags and ``n`` summed words (measure,
    agree, then ``choose``), then the Allgather of the counts and report words."""

    n: int

    def agree(self, sp: Any, step: Any, sel: Any, err: Any, code: int, guard: Any) -> tuple[Any, RankWords] | None:
        """``FirstCollective.agree``."""
        with timed(step.sec, "sum_words"):
            sums = sel.sums if err is None else np.zeros(self.n, np.int64)
            wd = sp._word_dtype()
            tag_word = StepWords.tag_word(sp.ident, step.t, StepWords.tag_modulus(sp.nranks, wd))
            summed = sp.exchange.sum_words(np.concatenate((StepWords.flags(err, code, tag_word), sums)), wd)
        if not StepWords.flags_ok(summed, sp.nranks):
            words = sp.exchange.agree(StepWords.make(0, err, code, (sp.ident, step.t)))   # the details
            if guard.refused(words):
                return None
            raise AssertionError("summed flags and gathered words disagree")  # pragma: no cover
        with timed(step.sec, "choose"):
            sel = sp.choose(step, sel, summed[3:])
        with timed(step.sec, "counts"):   # the sum agreed the flags: count and report words only
            words = sp.exchange.agree([sel.count] + list(sel.words))
        return sel, RankWords.gathered(words, 1)


GATHERED = GatheredWords()


def first_collective(n_sum: int) -> FirstCollective:
    """The path for a selector whose ``sum_size`` is ``n_sum``: summed when > 0, else gathered."""
    return SummedWords(n_sum) if n_sum else GATHERED
