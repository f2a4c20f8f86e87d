"""Per-element kernels (installed as ``exdyna_mpi.kernels``).

``cpu`` holds Numba ``@njit`` kernels on NumPy buffers; ``cuda`` holds ``@cuda.jit`` kernels on CUDA
device buffers with the same semantics. Kernels know nothing of MPI, sparsifier state or frameworks:
they take buffers and scalars and return counts.
"""
