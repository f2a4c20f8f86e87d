"""The faithful threshold rule, step by step, against hand-computed factors."""
import math

import pytest

from exdyna_mpi.algorithm.controllers import FaithfulController, SymmetricController, make_controller, target_count


def test_initial_threshold_is_one_over_two_root_k():
    c = FaithfulController(11_173_962, 0.001)
    assert c.k == 11_173
    assert c.threshold == 1 / (2 * math.sqrt(11_173))
    assert abs(c.threshold - 4.73e-3) < 1e-5          # the spec's ResNet-18 figure


@pytest.mark.parametrize("total,factor", [
    (1201, 1.005),     # ratio 1.201 > 1.1
    (1101, 1.005),     # 1.101
    (1100, 1.00125),   # exactly 1.1 is not > 1.1
    (1000, 1.00125),
    (910, 1.00125),    # 0.91 > 0.909
    (909, 0.995),      # exactly 0.909 is not > 0.909
    (0, 0.995),        # nothing selected
])
def test_faithful_factor_bands(total, factor):
    c = FaithfulController(1_000_000, 0.001)   # k = 1000
    t0 = c.threshold
    c.update([total // 2, total - total // 2])
    assert c.threshold == t0 * factor


def test_symmetric_uses_the_dead_branch_below_target():
    c = SymmetricController(1_000_000, 0.001)
    t0 = c.threshold
    c.update([950])
    assert c.threshold == t0 * 0.9987
    c.update([1050])
    assert c.threshold == t0 * 0.9987 * 1.00125


def test_density_one_selects_everything_and_tiny_k_is_clamped():
    assert make_controller("faithful", 100, 1.0).threshold == 0.0
    assert target_count(1e-9, 100) == 1
    assert FaithfulController(100, 1e-9).threshold == 0.5


def test_state_round_trip():
    a = FaithfulController(5000, 0.01)
    for n in (80, 10, 51, 49):
        a.update([n])
    b = FaithfulController(5000, 0.01)
    b.load_state(a.state())
    a.update([3])
    b.update([3])
    assert a.threshold == b.threshold


def test_the_histogram_controller_is_gone_and_asking_for_it_names_measured():
    """controller="histogram" (forecasting) was removed: a bad argument that points to "measured"."""
    from mpi4py import MPI

    import exdyna_mpi
    from exdyna_mpi.algorithm.controllers import CONTROLLERS

    assert "histogram" not in CONTROLLERS and "measured" in CONTROLLERS
    for cls in (exdyna_mpi.ExDyna, exdyna_mpi.MiCRO):
        with pytest.raises(ValueError, match=r"bad arguments: rank 0: controller 'histogram' was removed .*"
                                             r"use controller='measured' \(the default\)"):
            cls(1000, 0.01, MPI.COMM_SELF, controller="histogram")
