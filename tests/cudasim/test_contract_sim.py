"""The shared contract (tests/contract.py) on the simulated CUDA device at P=1: ``device="cuda"``
runs the CUDA kernels and the device transport under the Numba CUDA simulator, bit for bit against
the CPU, for every sparsifier. The simulator runs one OS thread per CUDA thread, so the state and
bad-input checks (the template's code, shared by all) run for the two sparsifiers with their own
device-side step (ExDyna's histogram pass and step 0, Top-k's union); the CPU lanes run them all.
"""
import pytest

from tests.contract import NAMES, check_bad_input, check_round_trip, check_same_output

DEVICE_STEP = ("exdyna", "topk")


@pytest.mark.parametrize("name", NAMES)
def test_same_output_as_cpu(wcomm, name):
    check_same_output(wcomm, "cuda", name, steps=2)


@pytest.mark.parametrize("name", DEVICE_STEP)
def test_state_round_trip(wcomm, name):
    check_round_trip(wcomm, "cuda", name)


@pytest.mark.parametrize("kind", ["length", "nan-skip"])
@pytest.mark.parametrize("name", DEVICE_STEP)
def test_bad_input_on_one_rank(wcomm, name, kind):
    check_bad_input(wcomm, "cuda", name, kind)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_refused_on_the_device(wcomm, dtype):
    # half gradients are a host feature for now: on the device every rank refuses with the same text
    import numpy as np

    import exdyna_mpi
    from tests.cudasim.simdevice import simulated

    sp = simulated(exdyna_mpi.ExDyna, 4096, 0.01, wcomm)
    if dtype == "bfloat16":
        torch = pytest.importorskip("torch")
        g = torch.zeros(4096, dtype=torch.bfloat16)
    else:
        g = np.zeros(4096, np.float16)
    with pytest.raises(exdyna_mpi.StepError, match=f"dtype {dtype} on a CUDA device;.*host"):
        sp.step(g)
    assert sp.iteration == 0
    sp.step(np.ones(4096, np.float32))   # float32 on the device still goes through
    assert sp.iteration == 1
