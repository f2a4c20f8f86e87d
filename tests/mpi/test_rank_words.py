"""``combine`` gets one layout of the gathered words (``step_words.RankWords``) whichever first collective
the step ran: the ``StepWords`` Allgather, or a summed Allreduce followed by the count gather.

A small selector runs both ways with the same per-rank selection and records what ``combine`` got;
the two records must match (values, dtype, shape), and must hold every rank's own count and report
words in rank order. The bytes the two paths send differ by design (the summed path agrees its flags
in the sum), so only the words are compared.
"""
import numpy as np
import pytest

from exdyna_mpi.sparsifiers.base import Option, Selection, Sparsifier
from exdyna_mpi.sparsifiers.step_words import RankWords, StepWords
from tests.conftest import mpi_assert

pytestmark = pytest.mark.mpi
N = 64
REPORT = 3


def _count(rank, t):
    return 5 + 3 * rank + t


def _report(rank, t):
    return [100 * rank + t, -(rank + 1), 2**40 + rank]


def _is_bool(v):
    if not isinstance(v, bool):
        raise ValueError("must be a bool")


class _Recorder(Sparsifier):
    """Selects nothing; reports a count and ``REPORT`` words that name the rank and step, through
    the ``StepWords`` Allgather (``summed=False``) or a summed first collective (``summed=True``)."""

    name = "rank_words_recorder"
    OPTIONS = {"summed": Option(False, _is_bool, "the summed first collective instead of the gathered one")}

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen = []

    def report_size(self, step):
        return REPORT

    def sum_size(self, step):
        return 2 if self.options["summed"] else 0

    def select(self, step, grad, acc):
        bad = self.accumulate(grad, acc)
        if self.options["summed"]:   # measure only: the summed words are the count, twice
            c = _count(self.rank, step.t)
            return Selection(acc, 0, (), bad, sums=np.array([c, 2 * c], np.int64))
        return Selection(acc, _count(self.rank, step.t), _report(self.rank, step.t), bad)

    def choose(self, step, sel, sums):
        sel.count, sel.words = _count(self.rank, step.t), _report(self.rank, step.t)
        return sel

    def combine(self, step, sel, words):
        self.seen.append(words)
        self.memory.keep(sel.acc)
        return self.ops.zeros(self.numel, self._dtype), dict(counts=words.counts, selected=0, density=0.0,
                                                             threshold=None, bounds=None, owned=None)


def test_both_first_collectives_give_combine_the_same_words(wcomm):
    p = wcomm.Get_size()
    runs = {}
    for summed in (False, True):
        sp = _Recorder(N, 0.5, wcomm, summed=summed)
        assert (sp.sum_size(None) > 0) is summed
        for _ in range(3):
            sp.step(np.ones(N, np.float32))
        runs[summed] = sp.seen
    ok = len(runs[False]) == len(runs[True]) == 3
    for t, (a, b) in enumerate(zip(runs[False], runs[True])):
        ok &= isinstance(a, RankWords) and isinstance(b, RankWords)
        ok &= a.counts.dtype == b.counts.dtype == np.int64 and a.report.dtype == b.report.dtype == np.int64
        ok &= a.counts.shape == b.counts.shape == (p,) and a.report.shape == b.report.shape == (p, REPORT)
        ok &= a.counts.tobytes() == b.counts.tobytes() and a.report.tobytes() == b.report.tobytes()
        ok &= a.counts.tolist() == [_count(r, t) for r in range(p)]
        ok &= a.report.tolist() == [_report(r, t) for r in range(p)]
    mpi_assert(ok, "combine got different words from the two first collectives", wcomm)


def test_the_builder_drops_the_protocol_words():
    counts, report = [7, 0, 12], [[1, 2], [0, 0], [-3, 2**50]]
    step_words = np.array([StepWords.make(c, None, 1) + r for c, r in zip(counts, report)], np.int64)
    count_words = np.array([[c] + r for c, r in zip(counts, report)], np.int64)
    a, b = RankWords.gathered(step_words, StepWords.N), RankWords.gathered(count_words, 1)
    for w in (a, b):
        assert w.counts.tolist() == counts and w.report.tolist() == report
        assert w.counts.dtype == np.int64 and w.counts.flags.c_contiguous
    none = RankWords.gathered(np.array([StepWords.make(4, None, 1)], np.int64), StepWords.N)
    assert none.counts.tolist() == [4] and none.report.shape == (1, 0)
