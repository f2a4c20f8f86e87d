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
