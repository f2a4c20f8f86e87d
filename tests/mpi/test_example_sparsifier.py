"""examples/topk_sparsifier.py, the sparsifier to copy: it works through the template as written.

- Its output and residual are those of the library's own ``topk`` bit for bit (the same rule), on
  every rank, for several steps of different per-rank gradients (error feedback included).
- The first step equals a reference computed here from the gathered gradients: each rank's k
  largest ``|g|``, their union, the mean over ranks there.
- ``exdyna_mpi.register`` puts it in ``make()``; bad input is refused on every rank.
- Registered, it passes the shared contract (tests/contract.py) on every backend, as the library's
  own sparsifiers do (tests/mpi/test_contract.py).
"""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

import exdyna_mpi
from exdyna_mpi.arrays import cuda_available
from exdyna_mpi.sparsifiers.registry import REGISTRY
from tests.conftest import allgather_array, mpi_assert
from tests.contract import check_bad_input, check_bad_state, check_round_trip, check_same_output

pytestmark = pytest.mark.mpi
N, DENSITY = 4096, 0.01
PATH = Path(__file__).resolve().parents[2] / "examples" / "topk_sparsifier.py"
#: the CUDA path joins where device="cuda" can run (a GPU, or NUMBA_ENABLE_CUDASIM=1)
BACKENDS = ["cpu", "cuda"] if cuda_available() else ["cpu"]


def _example():
    spec = importlib.util.spec_from_file_location("example_topk_sparsifier", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.ExampleTopK


def _grads(rank, steps):
    rng = np.random.default_rng(100 + rank)
    return [rng.standard_normal(N).astype(np.float32) * (1 + s) for s in range(steps)]


def test_same_bits_as_the_librarys_topk_on_every_rank(wcomm):
    ex = _example()(N, DENSITY, wcomm)
    ref = exdyna_mpi.make("topk", N, DENSITY, wcomm)
    for s, g in enumerate(_grads(wcomm.Get_rank(), 6)):
        a, b = ex.step(g.copy()), ref.step(g.copy())
        mpi_assert(a.tobytes() == b.tobytes() and ex.residual.tobytes() == ref.residual.tobytes(),
                   f"step {s}: the example differs from topk", wcomm)
        every = allgather_array(a, wcomm)
        mpi_assert(all(r.tobytes() == a.tobytes() for r in every), f"step {s}: ranks differ", wcomm)
        mpi_assert(ex.stats.selected == ref.stats.selected and ex.stats.selected >= int(DENSITY * N),
                   f"step {s}: selected {ex.stats.selected} vs {ref.stats.selected}", wcomm)


def test_first_step_is_the_union_mean_computed_here(wcomm):
    g = _grads(wcomm.Get_rank(), 1)[0]
    out = _example()(N, DENSITY, wcomm).step(g.copy())
    every = allgather_array(g, wcomm).astype(np.float64)
    k = int(DENSITY * N)
    union = np.unique(np.concatenate([np.argsort(-np.abs(r))[:k] for r in every]))
    want = np.zeros(N)
    want[union] = every[:, union].mean(axis=0)
    err = np.abs(out - want).max()
    mpi_assert(np.array_equal(np.flatnonzero(out), union) and err < 1e-5, f"max error {err:.3g}", wcomm)


def test_registered_it_is_made_by_name_and_refuses_bad_input_everywhere(wcomm):
    cls = _example()
    try:
        exdyna_mpi.register(cls)
        sp = exdyna_mpi.make("example_topk", N, DENSITY, wcomm)
        g = _grads(wcomm.Get_rank(), 1)[0]
        if wcomm.Get_rank() == wcomm.Get_size() - 1:
            g[7] = np.nan
        with pytest.raises(exdyna_mpi.StepError, match="non-finite"):
            sp.step(g)
        mpi_assert(sp.iteration == 0 and not sp.residual.any(), "a refused step changed the state", wcomm)
    finally:
        REGISTRY.pop("example_topk", None)


@pytest.fixture
def registered():
    """The example, registered under its name for the contract's ``make`` (and taken out after)."""
    cls = _example()
    exdyna_mpi.register(cls)
    try:
        yield cls.name
    finally:
        REGISTRY.pop(cls.name, None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_contract_same_output_and_round_trip(wcomm, registered, backend):
    check_same_output(wcomm, backend, registered)
    check_round_trip(wcomm, backend, registered)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["length", "nan-skip"])
def test_contract_bad_input_on_one_rank(wcomm, registered, backend, kind):
    check_bad_input(wcomm, backend, registered, kind)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["residual-length", "residual-nan"])
def test_contract_corrupt_state_on_one_rank(wcomm, registered, backend, kind):
    check_bad_state(wcomm, backend, registered, kind)
