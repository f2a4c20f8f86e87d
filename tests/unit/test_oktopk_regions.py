"""Ok-Topk's balanced region repartition on hand-worked cases."""
import numpy as np

from exdyna_mpi.sparsifiers.baselines.oktopk import equal_bounds, proposed_cuts, region_bounds


def test_proposed_cuts_are_quantiles_of_own_selection():
    sel = np.array([10, 20, 30, 40, 50, 60, 70, 80])
    # P = 4: positions sel[8*j//4] for j = 1, 2, 3 -> sel[2], sel[4], sel[6]
    assert proposed_cuts(sel, 100, 4).tolist() == [30, 50, 70]
    # nothing selected: the equal cuts
    assert proposed_cuts(np.array([], np.int64), 100, 4).tolist() == [25, 50, 75]


def test_region_bounds_average_the_cuts():
    # rank 0 selected [10, 20, 30, 40] -> cut 30; rank 1 selected [50, 60] -> cut 60; mean 45
    cuts = [proposed_cuts(np.array([10, 20, 30, 40]), 100, 2), proposed_cuts(np.array([50, 60]), 100, 2)]
    assert region_bounds(cuts, 100).tolist() == [0, 45, 100]
    # three ranks, integer floor of the mean: (30+31+33)//3 = 31, (60+61+70)//3 = 63
    assert region_bounds([[30, 60], [31, 61], [33, 70]], 90).tolist() == [0, 31, 63, 90]


def test_equal_bounds():
    assert equal_bounds(10, 3).tolist() == [0, 3, 6, 10]
