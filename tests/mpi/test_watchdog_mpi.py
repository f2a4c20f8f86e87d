"""A bad ``EXDYNA_TIMEOUT_S`` on one rank: the same error on every rank at construction, before any
step (a monitor thread that met it later would have to abort the job)."""
import numpy as np
import pytest

import exdyna_mpi
from exdyna_mpi.transport import watchdog
from tests.conftest import mpi_assert, same_error_everywhere

pytestmark = pytest.mark.mpi
NUMEL = 4_000


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["exdyna", "topk", "dense"])
@pytest.mark.parametrize("value", ["abc", "-1", "nan", "inf"])
def test_a_bad_timeout_on_one_rank_refuses_construction_on_every_rank(wcomm, monkeypatch, name, value):
    bad = 1
    wcomm.Barrier()   # the ranks reach the construction's agreement together
    with monkeypatch.context() as m:
        if wcomm.Get_rank() == bad:
            m.setenv(watchdog.ENV, value)
        msg = same_error_everywhere(lambda: exdyna_mpi.make(name, NUMEL, 0.05, wcomm))
    mpi_assert(f"rank {bad}: {watchdog.ENV}={value!r}" in msg and "bad arguments" in msg, msg, wcomm)
    mpi_assert("rank 0:" not in msg, msg, wcomm)
    # the refusal left nothing behind: with the value gone, the same construction steps
    sp = exdyna_mpi.make(name, NUMEL, 0.05, wcomm)
    out = sp.step(np.random.default_rng(wcomm.Get_rank()).standard_normal(NUMEL).astype(np.float32))
    mpi_assert(out.shape == (NUMEL,) and sp.iteration == 1, f"{out.shape} {sp.iteration}", wcomm)
