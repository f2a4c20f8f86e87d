"""The shared contract over every sparsifier and backend (bodies in tests/contract.py)."""
import pytest

from tests.contract import (test_bad_input_on_one_rank, test_same_output_on_all_ranks_and_as_cpu,  # noqa: F401
                            test_state_round_trip)
from tests.contract import backend  # noqa: F401  (the fixture)

pytestmark = pytest.mark.mpi
