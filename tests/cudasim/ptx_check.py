"""Compile the real-GPU CUDA kernels to PTX without a GPU (run WITHOUT the simulator).

Type inference and lowering of every kernel, both variants, float32/int32 and float64/int64,
for compute capability 9.0. Needs NVVM and libdevice (a CUDA toolkit or the nvidia-cuda-nvcc wheel);
exits 77 when they are missing. The driver and NVRTC lookups Numba makes on the way are stubbed:
they only pick an architecture, which is given here.
Usage: python tests/cudasim/ptx_check.py
"""
import os
import sys

if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
    sys.exit("run ptx_check.py without NUMBA_ENABLE_CUDASIM")

import numba.cuda.cuda_paths as cuda_paths  # noqa: E402
import numba.cuda.cudadrv.nvrtc as nvrtc  # noqa: E402
import numba.cuda.dispatcher as dispatcher  # noqa: E402
from numba import cuda, types as T  # noqa: E402

CC = (9, 0)


class _Device:
    compute_capability = CC


dispatcher.get_current_device = lambda: _Device()  # device functions ask the driver for the CC
nvrtc.get_supported_ccs = lambda: ((7, 5), (8, 0), (8, 6), (8, 9), (9, 0))
cuda_paths._get_nvrtc_path = lambda: None  # only used to report paths
try:
    from numba.cuda.cudadrv import nvvm

    nvvm.NVVM()
    cuda_paths.get_cuda_paths()["libdevice"]
except Exception as e:  # no toolkit here: nothing to check
    print(f"SKIP: NVVM/libdevice not available ({e!r})")
    sys.exit(77)

import exdyna_mpi.kernels.cuda as kc  # noqa: E402
from exdyna_mpi.kernels.cuda.scatter_gather import _gather, _scatter, _scatter_mean_zero, _zero_at  # noqa: E402
from exdyna_mpi.kernels.cuda.select import _acc_count, _compact_fast, _compact_safe, _count, _scan  # noqa: E402

assert not kc.SIMULATOR


def main():
    for ft in (T.float32, T.float64):
        fa = T.Array(ft, 1, "C")
        ia = T.Array(T.int32 if ft == T.float32 else T.int64, 1, "C")
        wa = T.Array(T.int64, 1, "C")
        ma = T.Array(T.uint32, 1, "C")
        i64 = T.int64
        sigs = [
            (_acc_count, (fa, fa, fa, i64, i64, ft, i64, wa, wa, ma)),
            (_count, (fa, i64, i64, ft, i64, wa, wa, ma, T.boolean)),
            (_scan, (wa, wa, i64, wa, wa)),
            (_compact_safe, (ma, i64, i64, i64, wa, ia)),
            (_compact_fast, (ma, i64, i64, i64, wa, ia)),
            (_gather, (fa, ia, fa)),
            (_scatter, (fa, ia, fa)),
            (_zero_at, (fa, ia)),
            (_scatter_mean_zero, (fa, fa, ia, fa, ft)),
        ]
        for kernel, sig in sigs:
            ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=CC)
            name = kernel.py_func.__name__
            if kernel is _compact_fast:
                assert "shfl.sync.up" in ptx, "fast compaction lost its warp shuffle"
            if name == "_scatter_mean_zero":
                width = "f32" if ft == T.float32 else "f64"
                assert f"div.rn.{width}" in ptx, "the mean must be an IEEE round-to-nearest divide"
            assert "approx" not in ptx, f"{name}: approximate math would break bit-identity"
            print(f"ok {name}{sig}")
    print("PTX OK")


if __name__ == "__main__":
    main()
