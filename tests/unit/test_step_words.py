"""The words that open every step (``step_words.StepWords``) name the sparsifier and its iteration without
adding a word; the summed first collective's flags carry a small tag whose squares cannot overflow
the word dtype; the serials of sparsifiers built one after the other differ."""
import numpy as np
import pytest
from mpi4py import MPI

import exdyna_mpi
from exdyna_mpi._errors import InputCode
from exdyna_mpi.sparsifiers.roles import SERIALS, ident_of
from exdyna_mpi.sparsifiers.step_words import StepWords


def test_the_words_carry_identity_and_iteration_in_four_words():
    ident = ident_of(12345, "topk numel=10 density=0.5")
    w = StepWords.make(7, (InputCode.NONFINITE, 3), 1, (ident, 2**40 + 5))
    assert len(w) == StepWords.N
    code, t, dt, who = (int(c[0]) for c in StepWords.fields(np.array([w], np.int64)))
    assert (w[0], code, w[2], dt, t, who) == (7, InputCode.NONFINITE, 3, 1, 2**40 + 5, ident)
    assert 0 <= ident < 2**55 and max(w) < 2**63


@pytest.mark.parametrize("row,field", [(1, "ident"), (2, "iteration")])
def test_a_different_identity_or_iteration_is_a_mismatch(row, field):
    a, b = ident_of(3, "exdyna"), ident_of(4, "exdyna")
    rows = [StepWords.make(5, None, 1, (a, 9)) for _ in range(3)]
    assert not StepWords.mismatch(np.array(rows, np.int64))
    rows[row] = StepWords.make(5, None, 1, (b, 9) if field == "ident" else (a, 8))
    assert StepWords.mismatch(np.array(rows, np.int64))


def test_the_checks_read_the_code_and_dtype_under_the_packed_words():
    ident = ident_of(0, "x")
    ok = np.array([StepWords.make(1, None, 1, (ident, 77))] * 2, np.int64)
    assert StepWords.check(ok, "x", 10, "raise") is False
    bad = np.array([StepWords.make(1, None, 1, (ident, 77)), StepWords.make(0, (InputCode.NONFINITE, 2), 1,
                                                                             (ident, 77))], np.int64)
    assert StepWords.check(bad, "x", 10, "skip") is True
    with pytest.raises(exdyna_mpi.StepError, match="rank 1: grad has 2 non-finite"):
        StepWords.check(bad, "x", 10, "raise")
    dts = np.array([StepWords.make(1, None, 1, (ident, 77)), StepWords.make(1, None, 2, (ident, 77))], np.int64)
    with pytest.raises(exdyna_mpi.StepError, match="different dtypes"):
        StepWords.check(dts, "x", 10, "raise")


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("p", [2, 3, 4, 64, 1024, 2**20])
def test_summed_flags_fit_the_word_dtype_and_tell_tags_apart(dtype, p):
    m = StepWords.tag_modulus(p, dtype)
    top = StepWords.CODE_SPAN * m - 1   # the largest flag word: the largest code at the largest tag
    assert m >= 1 and p * top * top <= np.iinfo(dtype).max
    ident = ident_of(10, "exdyna")
    same = [StepWords.flags(None, 1, StepWords.tag_word(ident, 4, m))] * p
    assert StepWords.flags_ok(np.sum(np.array(same, dtype), axis=0), p)
    if m > 1:   # one rank a step behind, or stepping the next sparsifier: the flags disagree
        for other in (StepWords.tag_word(ident, 3, m), StepWords.tag_word(ident_of(11, "exdyna"), 4, m)):
            rows = same[:-1] + [StepWords.flags(None, 1, other)]
            assert not StepWords.flags_ok(np.sum(np.array(rows, dtype), axis=0), p)


def test_small_differences_always_change_the_tag():
    m = StepWords.tag_modulus(4, np.int32)
    a = ident_of(100, "topk")
    words = {StepWords.tag_word(a, t, m) for t in range(m)}
    assert len(words) == m   # every iteration within one modulus: its own word
    serials = {StepWords.tag_word(ident_of(s, "topk"), 5, m) for s in range(100, 100 + m)}
    assert len(serials) == m


def test_serials_increase_and_pass_every_agreed_one():
    a = exdyna_mpi.make("topk", 64, 0.5, MPI.COMM_SELF)
    b = exdyna_mpi.make("topk", 64, 0.5, MPI.COMM_SELF)
    assert b.serial > a.serial and b.ident != a.ident
    SERIALS.passed(b.serial + 40)   # another rank had taken more: construction moves past the largest
    assert exdyna_mpi.make("topk", 64, 0.5, MPI.COMM_SELF).serial == b.serial + 41
