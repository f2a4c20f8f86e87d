"""Block layout, rotation and the authors' rebalancing rule, against hand-worked cases."""
import numpy as np
import pytest

from exdyna_mpi.algorithm.layout import BlockLayout, EqualLayout, block_size, initial_blocks, owners, partition_of
from tests.reference import AuthorsExDyna


@pytest.mark.parametrize("numel,sz,rem", [
    (11_173_962, 10_912, 74),      # ResNet18-CIFAR10 (the ExDyna paper, arXiv 2402.13781)
    (28_949_319, 28_256, 15_175),  # LSTM-WikiText2
    (6_166_250, 6_016, 5_866),     # GoogLeNet-CIFAR10
    (32_768, 32, 0),
    (1_000_003, 960, 16_963),      # prime: 1_000_003 // 1024 = 976 -> 960
])
def test_block_size_matches_authors(numel, sz, rem):
    s, nb = block_size(numel, 1024, 32)
    assert (s, nb) == (sz, 1024)
    assert numel - s * nb == rem


def test_small_vectors_get_fewer_blocks():
    assert block_size(1000, 1024, 32) == (32, 31)      # 31 blocks of 32, remainder 8
    assert block_size(20, 1024, 32) == (1, 20)         # below one aligned block: unit blocks
    lay = BlockLayout(1000, 3)
    assert lay.bounds().tolist() == [0, 11 * 32, 21 * 32, 1000]


def test_initial_blocks_first_partitions_get_the_extra():
    assert initial_blocks(1024, 3) == [342, 341, 341]
    assert initial_blocks(1024, 6) == [171, 171, 171, 171, 170, 170]
    assert sum(initial_blocks(1024, 7)) == 1024


def test_bounds_put_remainder_in_last_partition():
    lay = BlockLayout(6_166_250, 3)
    assert lay.bounds().tolist() == [0, 342 * 6016, 683 * 6016, 6_166_250]
    assert lay.range_of(2) == (683 * 6016, 6_166_250)


def test_rotation_owner_formula():
    # rank r owns (t mod P + r) mod P; equivalently partition p is owned by rank (p - t) mod P.
    P = 4
    for t in range(9):
        own = owners(t, P)
        assert sorted(own) == list(range(P))
        for r in range(P):
            assert own[r] == partition_of(r, t, P) == (t % P + r) % P
            assert (own[r] - t) % P == r


def test_rebalance_moves_one_block_toward_underloaded_neighbour():
    # numel 1_024_000: sz_blk 992, rem 8192; P=4 -> 256 blocks each, min 64.
    lay = BlockLayout(1_024_000, 4)
    # Step t-1 = 1: rank r owned partition (1 + r) % 4, so rank 3 owned partition 0.
    lay.rebalance_faithful([10_000, 10_000, 10_000, 50_000], t=2)
    # mean 20000: p0 2.5x (over), p1 0.5x (under) -> boundary 0|1 moves left one block.
    # m = int(992 * 80000/1024000) = 77 moves with it: p1 -> 10077 (0.504x), no further move.
    assert lay.blk_part == [255, 257, 256, 256]


def test_rebalance_mirror_case_and_hysteresis():
    lay = BlockLayout(1_024_000, 4)
    # t-1 = 0: rank r owned partition r. p1 over, p0 under -> boundary 0|1 moves right.
    # p2 at 1.04x is inside the +-5% band: boundary 1|2 stays although p1 is over.
    lay.rebalance_faithful([9_000, 31_000, 20_800, 19_200], t=1)
    assert lay.blk_part == [257, 255, 256, 256]


def test_rebalance_respects_min_partition():
    lay = BlockLayout(1_024_000, 8)          # 128 blocks each, min_blk = 32
    lay.blk_part = [32, 224, 128, 128, 128, 128, 128, 128]
    lay.rebalance_faithful([90_000, 1_000, 10_000, 10_000, 10_000, 10_000, 10_000, 10_000], t=1)
    assert lay.blk_part[0] == 32 and lay.blk_part[1] == 224   # 32 - 1 < 32: no move
    assert sum(lay.blk_part) == 1024


def test_rebalance_zero_mean_and_single_rank_are_no_ops():
    lay = BlockLayout(100_000, 4)
    before = list(lay.blk_part)
    lay.rebalance_faithful([0, 0, 1, 0], t=1)   # mean floor(1/4) = 0: the authors' code divides by it
    assert lay.blk_part == before
    one = BlockLayout(100_000, 1)
    one.rebalance_faithful([7], t=1)
    assert one.blk_part == [1024]


@pytest.mark.parametrize("numel,P", [(1_000_003, 3), (2_000_000, 4), (3_333_333, 7), (6_166_250, 8)])
def test_rebalance_follows_authors_code_on_random_count_streams(numel, P):
    rng = np.random.default_rng(numel + P)
    ours = BlockLayout(numel, P)
    ref = AuthorsExDyna(numel, 0.001, P)
    for t in range(1, 400):
        # Skewed loads so boundaries really move, with zeros now and then.
        ks = (rng.pareto(1.5, P) * 300).astype(int).tolist()
        if t % 37 == 0:
            ks[t % P] = 0
        ours.rebalance_faithful(ks, t)
        ref.t = t - 1
        ref.advance(ks)
        assert ours.bounds().tolist() == ref.bounds()
        assert min(ours.blk_part) >= ours.min_blk - 1


def test_equal_layout_is_micro():
    lay = EqualLayout(10, 4)
    assert lay.bounds().tolist() == [0, 3, 6, 8, 10]
    lay.rebalance_faithful([100, 0, 0, 0], 1)
    assert lay.bounds().tolist() == [0, 3, 6, 8, 10]


def test_rebalance_blocks_scale_weighs_each_partition_exactly():
    """``scale=(num, den)`` weighs partition p's block counts by num[p] / den[p], in exact integer
    arithmetic (Python integers here), also where ``counts << FIX`` times ``num`` passes 2**63."""
    lay = BlockLayout(1 << 20, 4, 64, 32)
    part = list(lay.blk_part)
    rng = np.random.default_rng(5)
    counts = rng.integers(0, lay.sz_blk + 1, size=lay.n_blocks)
    counts[part[0] + part[1]] = lay.sz_blk   # a full block of partition 2: (sz_blk << FIX) * num > 2**63
    num, den = np.array([3, 0, 1 << 31, 7]), np.array([2, 5, (1 << 31) - 1, 7])
    lay.rebalance_blocks(None, 1, counts=counts, scale=(num, den))
    owner = np.repeat(np.arange(4), part)
    want = [(int(c) << lay.FIX) * int(num[o]) // int(den[o]) for c, o in zip(counts, owner)]
    assert [int(x) for x in lay._blk_load] == want
    assert (lay.sz_blk << lay.FIX) * (1 << 31) > 2**63 and sum(lay.blk_part) == lay.n_blocks


def test_rebalance_blocks_equal_scale_is_no_scale():
    a, b = BlockLayout(1 << 18, 4, 256, 32), BlockLayout(1 << 18, 4, 256, 32)
    rng = np.random.default_rng(6)
    for t in range(1, 6):
        counts = rng.integers(0, 50, size=a.n_blocks)
        q = rng.integers(1, 1000, size=4)
        a.rebalance_blocks(None, t, counts=counts)
        b.rebalance_blocks(None, t, counts=counts, scale=(q, q))
        assert a.blk_part == b.blk_part and np.array_equal(a._blk_load, b._blk_load)


def test_rebalancing_is_resolved_once_against_the_controller():
    """``balance=True`` means the controller's rule (the authors' moves for theirs, exact per-block
    counts for the measured one); a name picks that rule; False turns it off."""
    import exdyna_mpi
    from exdyna_mpi.algorithm import Balance, make_controller

    measured = make_controller("measured", 10_000, 0.01, 4).balance_rule
    faithful = make_controller("faithful", 10_000, 0.01, 4).balance_rule
    assert measured is Balance.BLOCKS and faithful is Balance.FAITHFUL
    assert Balance.of(True, measured) is Balance.BLOCKS
    assert Balance.of(np.bool_(True), faithful) is Balance.FAITHFUL
    assert Balance.of(False, measured) is Balance.OFF
    assert Balance.of("adaptive", measured) is Balance.ADAPTIVE
    with pytest.raises(ValueError):
        Balance.of("sideways", measured)
    from mpi4py import MPI

    for balance, controller, want in [(True, "measured", Balance.BLOCKS), (True, "faithful", Balance.FAITHFUL),
                                      (False, "measured", Balance.OFF), ("blocks", "faithful", Balance.BLOCKS)]:
        sp = exdyna_mpi.ExDyna(4096, 0.01, MPI.COMM_SELF, controller=controller, balance=balance)
        assert sp.rebalancing is want, (balance, controller)
    assert exdyna_mpi.MiCRO(4096, 0.01, MPI.COMM_SELF).rebalancing is Balance.OFF
