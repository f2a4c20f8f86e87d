"""Test helper: run a sparsifier's device path on simulator buffers."""


def on_simulated_device(sp, cuda_aware=False):
    """Route a CPU-bound sparsifier through ``CudaOps`` + ``DeviceExchange`` (simulator buffers).

    Under the simulator device buffers are NumPy arrays, so the sparsifier keeps accepting NumPy
    gradients while every per-element op runs the CUDA kernels and every exchange goes through
    the device transport (``cuda_aware=False``: staged through host buffers; True: direct).
    """
    from exdyna_mpi._cuda_ops import CudaOps
    from exdyna_mpi._device_transport import DeviceExchange

    sp._ops = CudaOps
    sp.xch = DeviceExchange(sp.xch, cuda_aware=cuda_aware)
    return sp
