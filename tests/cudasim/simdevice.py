"""Test helper: a sparsifier on the simulated CUDA device, through the public ``device="cuda"``."""
import os


def simulated(cls, *args, cuda_aware=False, **kw):
    """``cls(*args, device="cuda", **kw)`` under the simulator, its exchange direct
    (``cuda_aware=True``) or staged through host buffers (False), as ``EXDYNA_CUDA_AWARE`` says.

    Under the simulator device buffers are NumPy arrays, so the sparsifier takes NumPy gradients
    while every per-element op runs the CUDA kernels and every exchange goes through the device
    transport.
    """
    old = os.environ.get("EXDYNA_CUDA_AWARE")
    os.environ["EXDYNA_CUDA_AWARE"] = "1" if cuda_aware else "0"
    try:
        return cls(*args, device="cuda", **kw)
    finally:
        if old is None:
            del os.environ["EXDYNA_CUDA_AWARE"]
        else:
            os.environ["EXDYNA_CUDA_AWARE"] = old


def step_both(ref, dev, g, step):
    """One step of the host reference ``ref`` and the simulated device sparsifier ``dev`` on copies
    of ``g``: outputs and residuals must be the same bytes. Returns ``(want, got)`` for more checks."""
    want = ref.step(g.copy())
    got = dev.step(g.copy())
    assert got.tobytes() == want.tobytes(), f"step {step}: output"
    assert dev.residual.tobytes() == ref.residual.tobytes(), f"step {step}: residual"
    return want, got
