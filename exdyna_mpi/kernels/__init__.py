"""Per-element kernels (``exdyna_mpi.kernels``, the bottom layer of docs/architecture.md).

``cpu`` holds Numba ``@njit`` kernels on NumPy buffers; ``cuda`` holds ``@cuda.jit`` kernels on CUDA
device buffers with the same semantics. Kernels know nothing of MPI, sparsifier state or frameworks:
they take buffers and scalars and return counts.
"""
