"""WAGMA-SGD schedule as pure functions: phases, group bits, groups, global steps."""
import itertools

import pytest

from exdyna_mpi.averaging import wagma


@pytest.mark.parametrize("P,S,R", [(1, 1, 1), (2, 1, 1), (2, 2, 1), (4, 2, 2), (4, 4, 1), (8, 2, 3),
                                   (8, 4, 2), (8, 8, 1), (16, 4, 2), (32, 4, 3), (64, 8, 2), (64, 4, 3)])
def test_number_of_phases(P, S, R):
    assert wagma.n_phases(P, S) == R


def test_group_bits_cover_all_bits_once():
    for L in range(0, 7):
        P = 1 << L
        for g in range(0, L + 1):
            S = 1 << g
            R = wagma.n_phases(P, S)
            bits = [b for s in range(R) for b in wagma.group_bits(s, P, S)]
            if g == 0:
                assert bits == []
            else:
                assert bits == list(range(L)), (P, S, bits)
                assert all(len(wagma.group_bits(s, P, S)) <= g for s in range(R))


@pytest.mark.parametrize("P,S,T", [(2, 2, 3), (4, 2, 5), (8, 2, 10), (8, 4, 4), (16, 4, 7), (8, 1, 3), (4, 4, 1)])
def test_groups_partition_ranks_and_rotate(P, S, T):
    R = wagma.n_phases(P, S)
    L = P.bit_length() - 1
    g = S.bit_length() - 1
    for t in range(3 * T + 2):
        kind = wagma.step_kind(t, T)
        assert kind == ("global" if (t + 1) % T == 0 else "group")
        groups = [tuple(wagma.group_of(r, t, P, S, T)) for r in range(P)]
        if kind == "global":
            assert all(gr == tuple(range(P)) for gr in groups)
            continue
        s = t % R
        lo, hi = s * g, min((s + 1) * g, L)
        for r in range(P):
            gr = groups[r]
            assert r in gr and len(gr) == 1 << (hi - lo)
            # the members differ from r only in bits [lo, hi)
            mask = ((1 << hi) - 1) ^ ((1 << lo) - 1)
            assert all((q ^ r) & ~mask == 0 for q in gr)
            assert all(groups[q] == gr for q in gr)  # symmetric: a partition
        kind2, phase, bits, grp = wagma.schedule(t, 0, P, S, T)
        assert kind2 == "group" and phase == s and bits == tuple(range(lo, hi)) and grp == list(groups[0])


@pytest.mark.parametrize("P,S", [(4, 2), (8, 2), (8, 4), (16, 4), (64, 8)])
def test_information_reaches_everyone_after_R_group_steps(P, S):
    R = wagma.n_phases(P, S)
    T = 10 ** 6  # no global step in the window
    reach = [{r} for r in range(P)]
    for t in range(R):
        new = []
        for r in range(P):
            new.append(set().union(*(reach[q] for q in wagma.group_of(r, t, P, S, T))))
        reach = new
    assert all(x == set(range(P)) for x in reach)


def test_is_pow2():
    assert [n for n in range(20) if wagma.is_pow2(n)] == [1, 2, 4, 8, 16]
    assert not wagma.is_pow2(True) and not wagma.is_pow2(2.0)


def test_member_index_is_a_bijection_on_each_group():
    from exdyna_mpi.transport.group import member_index

    P, S, T = 16, 4, 100
    for t, r in itertools.product(range(2), range(P)):
        bits = wagma.schedule(t, r, P, S, T)[2]
        grp = wagma.group_of(r, t, P, S, T)
        assert sorted(member_index(q, bits) for q in grp) == list(range(len(grp)))


class _Comm:
    def __init__(self, ub):
        self.ub = ub

    def Get_attr(self, key):
        from mpi4py import MPI
        assert key == MPI.TAG_UB
        return self.ub


@pytest.mark.parametrize("ub,window", [(2**31 - 1, 1 << 14), (2**20 - 1, 1 << 14), (2**19 - 1, 1 << 14),
                                       (2**19 - 2, 1 << 13), (32767, 1024)])
def test_tags_fit_the_mpi_tag_upper_bound(ub, window):
    """WAGMA's versioned tags, (v mod window) * TAG_STEPS + j, stay within MPI_TAG_UB; the standard
    promises only 32767."""
    from exdyna_mpi.transport.group import TAG_STEPS, tag_window

    got = tag_window(_Comm(ub))
    assert got == window and (got - 1) * TAG_STEPS + (TAG_STEPS - 1) <= ub
