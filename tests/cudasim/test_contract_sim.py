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
def test_half_on_the_device_equals_the_host(wcomm, dtype):
    # a half gradient on the device: widened and rounded by the device kernels, 16-bit values on
    # the wire; the host run gives the same bits
    import numpy as np

    import exdyna_mpi
    from tests.cudasim.simdevice import simulated

    sp = simulated(exdyna_mpi.ExDyna, 4096, 0.01, wcomm)
    ref = exdyna_mpi.ExDyna(4096, 0.01, wcomm, device="cpu")
    rng = np.random.default_rng(wcomm.Get_rank())
    for _ in range(2):
        g = (rng.standard_normal(4096) * 0.1).astype(np.float32)
        if dtype == "bfloat16":
            torch = pytest.importorskip("torch")
            x, y = torch.from_numpy(g).to(torch.bfloat16), torch.from_numpy(g).to(torch.bfloat16)
            got, want = sp.step(x).view(torch.int16).numpy(), ref.step(y).view(torch.int16).numpy()
        else:
            got, want = sp.step(g.astype(np.float16)), ref.step(g.astype(np.float16))
        assert got.tobytes() == want.tobytes() and sp.residual.tobytes() == ref.residual.tobytes()
    assert sp.iteration == 2 and sp.device == "cuda"
