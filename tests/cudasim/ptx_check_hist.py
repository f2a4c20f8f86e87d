"""Compile the histogram kernels of exdyna_mpi/kernels/cuda/measure.py to PTX without a GPU (run WITHOUT the
simulator).

Reuses ptx_check.py's stubs (architecture lookups) and checks what the simulator cannot: the
measuring pass takes the bit pattern of ``acc`` from a register bitcast (``mov.b32`` / ``mov.b64``
from a float register, no memory), the block histograms use 32-bit shared-memory atomics and a
64-bit global flush, and no approximate math slipped in.
Exits 77 when NVVM/libdevice are missing. Usage: python tests/cudasim/ptx_check_hist.py
"""
import re

import ptx_check  # stubs the driver lookups; exits 77 without NVVM (a script: its folder is on sys.path)
from numba import cuda, types as T

from exdyna_mpi.kernels.cuda.measure import (
    _acc_measure32,
    _acc_measure32_warp,
    _acc_measure64,
    _acc_measure64_warp,
    _hist_marked32,
    _hist_marked64,
    _hist_range32,
    _hist_range64,
)
from exdyna_mpi.kernels.cuda.scatter_gather import _zero_words


def main():
    i64 = T.int64
    wa = T.Array(T.int64, 1, "C")
    ma = T.Array(T.uint32, 1, "C")
    for ft, width, kmeasure, kwarp, krange, kmarked in (
            (T.float32, 32, _acc_measure32, _acc_measure32_warp, _hist_range32, _hist_marked32),
            (T.float64, 64, _acc_measure64, _acc_measure64_warp, _hist_range64, _hist_marked64)):
        fa = T.Array(ft, 1, "C")
        measure_sig = (fa, fa, fa, i64, i64, ft, i64, wa, wa, ma, i64, i64, i64, i64, i64, i64, wa, i64)
        sigs = [(kmeasure, measure_sig), (kwarp, measure_sig),
                (krange, (fa, i64, i64, i64, i64, i64, wa)),
                (kmarked, (fa, i64, i64, ma, i64, i64, i64, wa))]
        for kernel, sig in sigs:
            ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=ptx_check.CC)
            name = kernel.py_func.__name__
            freg = "%f" if width == 32 else "%fd"
            if kernel in (kmeasure, kwarp):  # acc lives in a register; hist_range may load the bits as integers
                assert re.search(rf"mov\.b{width}\s+%rd?\d+, {freg}\d+;", ptx), f"{name}: no register bitcast"
            if kernel is kwarp:
                assert "vote.sync.ballot" in ptx, f"{name}: marks lost their warp ballot"
            # int32 shared counters: native atomics (int64 ones are CAS spin loops on sm_90)
            assert "atom.shared.add.u32" in ptx, f"{name}: block histogram not in shared memory"
            assert "atom.shared.add.u64" not in ptx and "atom.shared.cas" not in ptx, f"{name}: 64-bit shared atomics"
            assert "atom.global.add.u64" in ptx, f"{name}: no global flush"
            assert "approx" not in ptx, f"{name}: approximate math would break bit-identity"
            print(f"ok {name}{sig}")
    ptx, _ = cuda.compile_ptx(_zero_words.py_func, (wa, i64), cc=ptx_check.CC)
    print("PTX HIST OK")


if __name__ == "__main__":
    main()
