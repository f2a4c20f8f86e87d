"""Static check of every CUDA kernel of the package exdyna_mpi/kernels/cuda/ for sm_90, without a GPU.

What it does, per kernel and dtype (run WITHOUT ``NUMBA_ENABLE_CUDASIM``):

1. ``numba.cuda.compile_ptx(py_func, signature, cc=(9, 0))`` (NVVM + libdevice from the
   ``nvidia-nvvm`` wheel; the driver look-ups Numba makes on the way only pick an architecture,
   which is given, so they are stubbed), then ``ptxas -arch=sm_90 -v`` (``nvidia-cuda-nvcc``
   wheel): registers, spill stores/loads, stack, shared memory.
2. ``nvdisasm -c`` (``nvidia-cuda-nvdisasm`` wheel) on the cubin: the SASS.
3. **Instructions per element of the hot loop.** Every backward branch ``BRA .L_x_n`` whose label
   ``.L_x_n`` precedes it closes a loop; the loop body is the SASS from the label to that branch,
   both included (nested loops inside it, e.g. a CAS spin loop, are counted once, at their static
   size). The *unit* of a kernel is one SASS opcode prefix that appears a fixed number of times per
   element (``unit`` / ``unit_per_elem`` in the budget file; e.g. ``LDG`` twice per element for
   ``acc = r + g``, ``LDG`` once per 32 elements for a bit-mask word): the hot loop is the loop
   with the most unit instructions, elements per iteration = units / ``unit_per_elem`` (so loops the
   compiler unrolled count right), and instructions per element = body size / elements per
   iteration. Spin loops (``CAS`` / ``.SPIN`` opcodes in the body) are flagged: their real cost
   grows with contention, which a static count cannot see.
4. **Estimate at 100M float32 elements on an H100 SXM** (3.35 TB/s HBM3, 132 SMs x 4 schedulers x
   32 lanes at 1.755 GHz = 2.97e13 thread-instructions/s, one instruction issued per scheduler per
   clock at best): ``max(bytes/elem x D / 3.35e12, instr/elem x D / 2.97e13)`` plus 2 us of
   launch latency, where D is the kernel's domain at N = 1e8 (``n``: 1e8 elements; ``k``: 1e5
   selected, density 0.001; ``blocks``: 1024 block counts; ``words``: 128 histogram words).
   ``bytes_per_elem`` is declared in the budget file from the kernel's loads and stores (random
   accesses at a 32-byte sector each). An estimate from a static model, not a measurement.

Fails (exit 1) on any spill, on registers or instructions per element above the budget, on a
kernel of the module that has no budget entry (new kernels are enumerated from the module, so one
added later fails here until it gets an entry: its signature and its budget), and on a budget entry
whose kernel is gone. Exit 77 (skip) only when NVVM, ptxas or nvdisasm cannot be found.

Usage: python jobs/gpu_static.py [--json out.json] [--budgets jobs/gpu_budgets.json] [--table-only]
"""
import argparse
import json
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import tempfile

if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
    sys.exit("run gpu_static.py without NUMBA_ENABLE_CUDASIM")

HERE = os.path.dirname(os.path.abspath(__file__))
BUDGETS = os.path.join(HERE, "gpu_budgets.json")
CC = (9, 0)
HBM = 3.35e12                      # H100 SXM, bytes/s
ISSUE = 132 * 4 * 32 * 1.755e9     # thread-instructions/s
LAUNCH_US = 2.0                    # device-side launch latency per kernel
N = 100_000_000
DOMAIN = {"n": N, "k": N // 1000, "blocks": 1024, "words": 128}


def _toolchain():
    """(ptxas, nvdisasm) paths or a reason string; also stubs Numba's driver look-ups."""
    import numba.cuda.cuda_paths as cuda_paths
    import numba.cuda.cudadrv.nvrtc as nvrtc
    import numba.cuda.dispatcher as dispatcher

    class _Device:
        compute_capability = CC

    dispatcher.get_current_device = lambda: _Device()
    nvrtc.get_supported_ccs = lambda: ((7, 5), (8, 0), (8, 6), (8, 9), (9, 0))
    cuda_paths._get_nvrtc_path = lambda: None
    try:
        from numba.cuda.cudadrv import nvvm

        nvvm.NVVM()
        cuda_paths.get_cuda_paths()["libdevice"]
    except Exception as e:
        return None, f"NVVM/libdevice not available ({e!r}); pip install nvidia-nvvm"
    found = []
    for tool in ("ptxas", "nvdisasm"):
        path = None
        try:  # the wheels' tools first: the same CUDA release as the NVVM that wrote the PTX
            import nvidia

            for root in nvidia.__path__:
                for sub in ("cu13/bin", "cuda_nvcc/bin", "cuda_nvdisasm/bin", "cu12/bin"):
                    cand = os.path.join(root, sub, tool)
                    if os.path.exists(cand):
                        path = path or cand
        except ImportError:
            pass
        path = path or shutil.which(tool)
        if path is None:
            return None, f"{tool} not found (pip install nvidia-cuda-nvcc nvidia-cuda-nvdisasm)"
        found.append(path)
    return tuple(found), None


def kernels_of(module):
    """{attribute name: dispatcher} for every ``@cuda.jit`` kernel (not device function) of ``module``
    and, for a package, of each of its modules (a kernel is one entry, whichever module names it)."""
    from numba.cuda.dispatcher import CUDADispatcher

    mods = [module]
    for info in pkgutil.iter_modules(getattr(module, "__path__", [])):
        mods.append(sys.modules.get(f"{module.__name__}.{info.name}"))
    out, seen = {}, set()
    for mod in mods:
        if mod is None:
            continue
        for name in sorted(vars(mod)):
            v = getattr(mod, name)
            if isinstance(v, CUDADispatcher) and not v.targetoptions.get("device", False) and id(v) not in seen:
                seen.add(id(v))
                if name in out:
                    raise ValueError(f"two kernels named {name}: budgets are by name")
                out[name] = v
    return dict(sorted(out.items()))


def signature(spec, dtype):
    from numba import types as T

    ft = {"float32": T.float32, "float64": T.float64}.get(dtype, T.float32)
    it = T.int32 if ft == T.float32 else T.int64
    table = {"x": T.Array(ft, 1, "C"), "X": ft, "ix": T.Array(it, 1, "C"), "w": T.Array(T.int64, 1, "C"),
             "u": T.Array(T.uint32, 1, "C"), "h": T.Array(T.uint16, 1, "C"), "H": T.Array(T.uint16, 2, "C"),
             "i": T.int64, "b": T.boolean, "d": T.float64}
    return tuple(table[s] for s in spec)


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRA = re.compile(r"\bBRA\s+(?:\w+\s+)?`\((\.L_x_\d+)\)")


def parse_sass(text):
    """(instructions: list of (opcode, full text), labels: {label: index of next instruction})."""
    instrs, labels = [], {}
    for line in text.splitlines():
        m = _LABEL.match(line.strip())
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = _INSTR.search(line)
        if m:
            body = m.group(2).strip()
            body = re.sub(r"^@!?U?P[T0-9]+\s+", "", body)
            instrs.append((body.split()[0] if body else "", body))
    return instrs, labels


def loops(instrs, labels):
    """Back-edge regions ``(start, end)`` (instruction indices, both included)."""
    out = []
    for j, (op, body) in enumerate(instrs):
        if op.startswith("BRA"):
            m = _BRA.search(body)
            if m and m.group(1) in labels and labels[m.group(1)] <= j:
                out.append((labels[m.group(1)], j))
    return out


def hot_loop(instrs, labels, unit, unit_per_elem):
    """(instructions per element, body size, elements per iteration, spin) of the hot loop, or None."""
    best = None
    for s, e in loops(instrs, labels):
        body = instrs[s:e + 1]
        units = sum(1 for op, _ in body if op.startswith(unit))
        if units == 0:
            continue
        key = (units, e - s)  # ties: the longest body (the costliest path)
        if best is None or key > best[0]:
            spin = any("CAS" in op or ".SPIN" in op for op, _ in body)
            best = (key, len(body), units / unit_per_elem, spin)
    if best is None:
        return None
    _, size, elems, spin = best
    return size / elems, size, elems, spin


def ptxas_info(text):
    def num(pat, default=0):
        m = re.search(pat, text)
        return int(m.group(1)) if m else default

    return {"registers": num(r"Used (\d+) registers"), "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads"), "stack": num(r"(\d+) bytes stack frame"),
            "smem": num(r"(\d+) bytes smem")}


def analyse(name, kernel, entry, dtype, tools, tmp):
    from numba import cuda

    ptxas, nvdisasm = tools
    ptx, _ = cuda.compile_ptx(kernel.py_func, signature(entry["sig"], dtype), cc=CC)
    base = os.path.join(tmp, f"{name}_{dtype}")
    with open(base + ".ptx", "w") as f:
        f.write(ptx)
    p = subprocess.run([ptxas, "-arch=sm_90", "-v", "-o", base + ".cubin", base + ".ptx"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"ptxas failed on {name} ({dtype}): {p.stderr[-2000:]}")
    info = ptxas_info(p.stdout + p.stderr)
    d = subprocess.run([nvdisasm, "-c", base + ".cubin"], capture_output=True, text=True, check=True)
    instrs, labels = parse_sass(d.stdout)
    info["sass"] = len(instrs)
    info["spin"] = False
    info["approx"] = "approx" in ptx
    hot = hot_loop(instrs, labels, entry.get("unit", "LDG"), entry.get("unit_per_elem", 1))
    if hot is None:
        info["ipe"], info["loop"], info["elems_per_iter"] = None, 0, 0
    else:
        info["ipe"], info["loop"], info["elems_per_iter"], info["spin"] = hot
    return info


def estimate_us(entry, ipe, dtype="float32"):
    dom = DOMAIN[entry.get("domain", "n")]
    bw = (_budget_for(entry, "bytes_per_elem", dtype) or 0) * dom / HBM
    issue = (ipe or 0) * dom / ISSUE
    return (max(bw, issue) * 1e6 + LAUNCH_US), ("issue" if issue > bw else "memory")


def _budget_for(entry, key, dtype):
    v = entry.get(key)
    if isinstance(v, dict):
        return v.get(dtype)
    return v


def _load(kernels_file):
    """The kernels package, or ``kernels_file``: a module file or a package folder (an older or
    edited copy, checked with its own --budgets)."""
    if kernels_file is None:
        # the kernels' compiled code is what this job budgets (it needs numba-cuda: loaded here)
        import exdyna_mpi.kernels.cuda as kc

        return kc
    import importlib.util

    path = os.path.abspath(kernels_file)
    if os.path.isdir(path):
        # a package: its modules import each other relatively, and the host kernels beside it
        # (``from ..cpu_half import ...``), so its parent folder is loaded as a package first
        root = importlib.util.spec_from_file_location(
            "kernels_under_check_root", os.path.join(os.path.dirname(path), "__init__.py"),
            submodule_search_locations=[os.path.dirname(path)])
        sys.modules[root.name] = importlib.util.module_from_spec(root)
        spec = importlib.util.spec_from_file_location("kernels_under_check_root.under_check",
                                                      os.path.join(path, "__init__.py"),
                                                      submodule_search_locations=[path])
    else:
        spec = importlib.util.spec_from_file_location("kernels_under_check", path)
    kc = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = kc
    spec.loader.exec_module(kc)
    return kc


def run(budgets_path=BUDGETS, kernels_file=None, names_only=False):
    tools, why = _toolchain()
    if tools is None:
        return None, [why]
    kc = _load(kernels_file)

    assert not kc.SIMULATOR
    with open(budgets_path) as f:
        budgets = json.load(f)["kernels"]
    found = kernels_of(kc)
    errors = []
    for name in found:
        if name not in budgets:
            errors.append(f"{name}: a CUDA kernel with no entry in {os.path.basename(budgets_path)} "
                          "(add its signature and budgets)")
    for name in budgets:
        if name not in found:
            errors.append(f"{name}: budget entry for a kernel that exdyna_mpi/kernels/cuda/ no longer has")
    rows = []
    if names_only:
        return rows, errors
    with tempfile.TemporaryDirectory() as tmp:
        for name, kernel in found.items():
            entry = budgets.get(name)
            if entry is None:
                continue
            for dtype in entry.get("dtypes", ["float32", "float64"]):
                info = analyse(name, kernel, entry, dtype, tools, tmp)
                us, bound = estimate_us(entry, info["ipe"], dtype)
                row = dict(kernel=name, dtype=dtype, bytes_per_elem=_budget_for(entry, "bytes_per_elem", dtype) or 0,
                           domain=entry.get("domain", "n"), est_us=us, bound=bound, **info)
                rows.append(row)
                tag = f"{name} ({dtype})"
                if info["spill_stores"] or info["spill_loads"] or info["stack"]:
                    errors.append(f"{tag}: spills ({info['spill_stores']} B stores, {info['spill_loads']} B "
                                  f"loads, {info['stack']} B stack)")
                if info["approx"]:
                    errors.append(f"{tag}: approximate math in the PTX would break bit-identity")
                reg_max = _budget_for(entry, "max_registers", dtype)
                if reg_max is not None and info["registers"] > reg_max:
                    errors.append(f"{tag}: {info['registers']} registers > budget {reg_max}")
                ipe_max = _budget_for(entry, "max_instr_per_elem", dtype)
                if ipe_max is not None:
                    if info["ipe"] is None:
                        errors.append(f"{tag}: no hot loop with unit {entry.get('unit', 'LDG')} found")
                    elif info["ipe"] > ipe_max:
                        errors.append(f"{tag}: {info['ipe']:.1f} SASS instructions/element > budget {ipe_max}")
                if entry.get("no_spin_loops") and info["spin"]:
                    errors.append(f"{tag}: a CAS spin loop in the hot loop")
    return rows, errors


def table(rows):
    head = (f"{'kernel':<22} {'dtype':<8} {'regs':>4} {'spill':>5} {'smem':>6} {'loop':>5} {'el/it':>6} "
            f"{'instr/el':>8} {'B/el':>6} {'dom':>6} {'est us':>8} {'bound':>6}  spin")
    lines = [head, "-" * len(head)]
    for r in rows:
        ipe = f"{r['ipe']:.2f}" if r["ipe"] is not None else "-"
        lines.append(f"{r['kernel']:<22} {r['dtype']:<8} {r['registers']:>4} {r['spill_stores'] + r['spill_loads']:>5} "
                     f"{r['smem']:>6} {r['loop']:>5} {r['elems_per_iter']:>6.3g} {ipe:>8} "
                     f"{r['bytes_per_elem']:>6.3g} {r['domain']:>6} {r['est_us']:>8.1f} {r['bound']:>6}  "
                     f"{'SPIN' if r['spin'] else ''}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--budgets", default=BUDGETS)
    ap.add_argument("--table-only", action="store_true", help="print the table, never fail on budgets")
    ap.add_argument("--kernels", help="check this kernels package folder or module file instead of "
                                      "exdyna_mpi.kernels.cuda (e.g. an older copy, with its own --budgets)")
    ap.add_argument("--names-only", action="store_true", help="only match the module's kernels with the budgets")
    a = ap.parse_args(argv)
    rows, errors = run(a.budgets, a.kernels, a.names_only)
    if rows is None:
        print(f"SKIP: {errors[0]}")
        return 77
    print(f"sm_90, estimates at N = {N:.0e} (k = {DOMAIN['k']:.0e}) on an H100 SXM: HBM {HBM / 1e12:.2f} TB/s, "
          f"issue {ISSUE:.3g} thread-instr/s, +{LAUNCH_US} us launch; estimates, not measurements")
    print(table(rows))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "errors": errors}, f, indent=1)
    if errors and not a.table_only:
        print("\nFAILED:")
        for e in errors:
            print("  " + e)
        return 1
    print("\nSTATIC OK" if not errors else f"\n{len(errors)} budget problems (--table-only)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
