"""GPU lane tests (run where CuPy sees a CUDA device and torch was built with CUDA)."""


def needs_cuda_torch(torch):
    """The skip mark of the tests that run torch on the GPU: a CUDA device visible to CuPy and a
    torch built with CUDA."""
    import pytest

    from exdyna_mpi.arrays import gpu_available

    return pytest.mark.skipif(not gpu_available() or not torch.cuda.is_available(),
                              reason="needs a CUDA device visible to CuPy and a torch built with CUDA")


def cuda_steps(net, opt, start, stop):
    """Steps ``start`` .. ``stop - 1`` of the loop the GPU tests share: this rank's batch of 64 (32
    features, 10 classes, seeded by step and rank) on the device, cross-entropy, ``opt.step()``."""
    import torch
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    for s in range(start, stop):
        g = torch.Generator().manual_seed(1000 * s + rank)
        x, y = torch.randn(64, 32, generator=g).cuda(), torch.randint(0, 10, (64,), generator=g).cuda()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    torch.cuda.synchronize()
