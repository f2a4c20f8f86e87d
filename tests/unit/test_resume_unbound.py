"""A sparsifier that has not stepped (``device="auto"``) loads a state dict without choosing a device:
the residual waits on the host and goes to the device of the first gradient. (It used to be bound
to the CPU at load, so a resumed CUDA run refused its gradients.) One process, ``COMM_SELF``."""
import numpy as np
import pytest
from mpi4py import MPI

import exdyna_mpi
from exdyna_mpi import StepError

N = 50_000


def _grads(n_steps, dtype=np.float32):
    rng = np.random.default_rng(3)
    return [(rng.standard_t(3, N) * 1e-3).astype(dtype) for _ in range(n_steps)]


@pytest.mark.parametrize("name", ["exdyna", "topk", "micro"])
def test_load_before_the_first_step_waits_for_the_device(name):
    gs = _grads(6)
    a = exdyna_mpi.make(name, N, 0.01, MPI.COMM_SELF)
    for g in gs[:3]:
        a.step(g.copy())
    state = a.state_dict()
    b = exdyna_mpi.make(name, N, 0.01, MPI.COMM_SELF)
    b.load_state_dict(state)
    assert b.ops is None, "load_state_dict chose a device before any gradient was seen"
    assert b.residual.tobytes() == a.residual.tobytes()
    assert b.state_dict()["residual"].tobytes() == state["residual"].tobytes()   # saved again as loaded
    for g in gs[3:]:
        oa, ob = a.step(g.copy()), b.step(g.copy())
        assert ob.tobytes() == oa.tobytes() and b.residual.tobytes() == a.residual.tobytes()
    assert b.ops is not None and b.device == "cpu"


def test_a_refused_first_step_after_load_keeps_the_loaded_residual():
    gs = _grads(2)
    a = exdyna_mpi.ExDyna(N, 0.01, MPI.COMM_SELF)
    a.step(gs[0].copy())
    state = a.state_dict()
    b = exdyna_mpi.ExDyna(N, 0.01, MPI.COMM_SELF)
    b.load_state_dict(state)
    with pytest.raises(StepError, match="dtype"):
        b.step(gs[1].astype(np.float64))   # the loaded state is float32
    assert b.residual.tobytes() == state["residual"].tobytes() and b.iteration == state["iteration"]
    assert b.step(gs[1].copy()).tobytes() == a.step(gs[1].copy()).tobytes()


@pytest.mark.parametrize("bound", [True, False])
def test_scale_residual_multiplies_in_place_bound_or_waiting(bound):
    """``scale_residual`` (DiLoCo's ``error_decay``): each element times the factor in the residual's
    own dtype, whether the residual is on its device or loaded and waiting for the first gradient;
    a non-finite factor is refused and changes nothing."""
    gs = _grads(4)
    a = exdyna_mpi.ExDyna(N, 0.01, MPI.COMM_SELF)
    for g in gs[:2]:
        a.step(g.copy())
    before = a.residual
    if not bound:
        b = exdyna_mpi.ExDyna(N, 0.01, MPI.COMM_SELF)
        b.load_state_dict(a.state_dict())
        assert b.ops is None
        a = b
    a.scale_residual(0.95)
    want = before * np.float32(0.95)
    assert a.residual.dtype == np.float32 and a.residual.tobytes() == want.tobytes()
    assert np.abs(want).max() > 0
    with pytest.raises(ValueError, match="finite"):
        a.scale_residual(float("nan"))
    assert a.residual.tobytes() == want.tobytes()
    fresh = exdyna_mpi.ExDyna(N, 0.01, MPI.COMM_SELF)
    fresh.scale_residual(0.5)   # nothing held yet: nothing to scale, no device chosen
    assert fresh.ops is None and not fresh.residual.any()
