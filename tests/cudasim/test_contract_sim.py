"""The shared contract (tests/contract.py) in the simulator lane: device="cuda" runs the CUDA kernels
and the device transport under the Numba CUDA simulator, bit for bit against the CPU, at P=1 (the
CPU side of the same bodies runs in the serial and MPI lanes)."""
import pytest

from tests.contract import (test_bad_input_on_one_rank, test_same_output_on_all_ranks_and_as_cpu,  # noqa: F401
                            test_state_round_trip)


@pytest.fixture
def backend():
    return "cuda"
