"""Sparsifiers whose step is host NumPy code (``CAPABILITIES.device_step`` False: fft, oktopk) refuse a real CUDA
device clearly: ``device="cuda"`` at construction, and a CUDA gradient at a step (a collective
``StepError`` naming the cause, state unchanged). The real GPU's side runs in tests/gpu; here the
checks themselves are exercised with the GPU's answers stood in."""
import numpy as np
import pytest
from mpi4py import MPI

import exdyna_mpi
from exdyna_mpi._errors import InputCode, describe
from exdyna_mpi.sparsifiers import base, config
from exdyna_mpi.sparsifiers.capabilities import names_where
from exdyna_mpi.sparsifiers.registry import REGISTRY


def test_the_host_step_sparsifiers_are_the_ones_with_numpy_steps():
    host = sorted(n for n in exdyna_mpi.available() if not REGISTRY[n].CAPABILITIES.device_step)
    assert host == ["fft", "oktopk"]
    device = names_where(base.Sparsifier, "device_step")
    assert "exdyna" in device and "fft" not in device


@pytest.mark.parametrize("name", ["fft", "oktopk"])
def test_device_cuda_refused_at_construction_on_a_real_gpu(monkeypatch, name):
    monkeypatch.setattr(config, "cuda_available", lambda: True)
    monkeypatch.setattr(config, "cuda_simulated", lambda: False)
    with pytest.raises(exdyna_mpi.CollectiveError, match=rf"device='cuda': {name}'s step is host NumPy code"):
        exdyna_mpi.make(name, 1000, 0.05, MPI.COMM_SELF, device="cuda")


def test_a_cuda_gradient_is_refused_at_the_step_and_changes_nothing(monkeypatch):
    sp = exdyna_mpi.make("fft", 1000, 0.05, MPI.COMM_SELF)
    real = base.as_input

    def on_cuda(obj):   # the view a CuPy or torch CUDA gradient gets
        inp = real(obj)
        inp.device = "cuda"
        return inp

    monkeypatch.setattr(base, "as_input", on_cuda)
    g = np.ones(1000, np.float32)
    with pytest.raises(exdyna_mpi.StepError, match="lives on a CUDA device, and this sparsifier's step is host"):
        sp.step(g)
    assert sp.iteration == 0 and sp.ops is None
    monkeypatch.setattr(base, "as_input", real)
    assert sp.step(g).shape == (1000,) and sp.device == "cpu"


def test_the_refusal_text():
    text = describe(InputCode.HOST_STEP, 0, 10, {})
    assert "CUDA device" in text and "tensor.cpu()" in text
