"""Compile the histogram kernels of kernels/cuda.py to PTX without a GPU (run WITHOUT the simulator).

Reuses ptx_check.py's stubs (architecture lookups) and checks what the simulator cannot: the forecast's
bit pattern comes from a register bitcast (``mov.b32`` / ``mov.b64`` from a float register, no memory),
the block histograms use shared-memory atomics, and no approximate math slipped in.
Exits 77 when NVVM/libdevice are missing. Usage: python tests/cudasim/ptx_check_hist.py
"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(__file__))
import ptx_check  # noqa: E402  (stubs the driver lookups; exits 77 without NVVM)
from numba import cuda, types as T  # noqa: E402

kc = ptx_check.kc


def main():
    i64, b = T.int64, T.boolean
    wa = T.Array(T.int64, 1, "C")
    ma = T.Array(T.uint32, 1, "C")
    for ft, kcount, khist, width in ((T.float32, kc._acc_count_hist32, kc._hist_range32, 32),
                                     (T.float64, kc._acc_count_hist64, kc._hist_range64, 64)):
        fa = T.Array(ft, 1, "C")
        sigs = [(kcount, (fa, fa, fa, i64, i64, ft, i64, wa, wa, ma, i64, i64, b, i64, i64, i64, i64, i64, i64, wa, i64)),
                (khist, (fa, i64, i64, i64, i64, i64, wa))]
        for kernel, sig in sigs:
            ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=ptx_check.CC)
            name = kernel.py_func.__name__
            freg = "%f" if width == 32 else "%fd"
            if kernel is kcount:  # p lives in a register; hist_range may load the bits as integers directly
                assert re.search(rf"mov\.b{width}\s+%rd?\d+, {freg}\d+;", ptx), f"{name}: no register bitcast"
            # int32 shared counters: native atomics (int64 ones are CAS spin loops on sm_90)
            assert "atom.shared.add.u32" in ptx, f"{name}: block histogram not in shared memory"
            assert "atom.shared.add.u64" not in ptx and "atom.shared.cas" not in ptx, f"{name}: 64-bit shared atomics"
            assert "atom.global.add.u64" in ptx, f"{name}: no global flush"
            assert "approx" not in ptx, f"{name}: approximate math would break bit-identity"
            print(f"ok {name}{sig}")
    ptx, _ = cuda.compile_ptx(kc._zero_words.py_func, (wa, i64), cc=ptx_check.CC)
    print("PTX HIST OK")


if __name__ == "__main__":
    main()
