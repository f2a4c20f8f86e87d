"""The shared contract over every sparsifier and backend, at every P (bodies in tests/contract.py)."""
import pytest

from exdyna_mpi.arrays import cuda_available
from tests.contract import NAMES, check_bad_input, check_bad_state, check_round_trip, check_same_output

pytestmark = pytest.mark.mpi
#: the CUDA path joins where device="cuda" can run (a GPU, or NUMBA_ENABLE_CUDASIM=1)
BACKENDS = ["cpu", "cuda"] if cuda_available() else ["cpu"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.mark.parametrize("name", NAMES)
def test_same_output_on_all_ranks_and_as_cpu(wcomm, backend, name):
    check_same_output(wcomm, backend, name)


@pytest.mark.parametrize("name", NAMES)
def test_state_round_trip(wcomm, backend, name):
    check_round_trip(wcomm, backend, name)


@pytest.mark.parametrize("kind", ["length", "nan-skip"])
@pytest.mark.parametrize("name", NAMES)
def test_bad_input_on_one_rank(wcomm, backend, name, kind):
    check_bad_input(wcomm, backend, name, kind)


@pytest.mark.parametrize("kind", ["residual-length", "residual-nan"])
@pytest.mark.parametrize("name", NAMES)
def test_corrupt_state_on_one_rank(wcomm, backend, name, kind):
    check_bad_state(wcomm, backend, name, kind)
