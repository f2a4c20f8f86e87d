"""Benchmark (not a test): the fused GPU select path per step, against the device's bandwidth and top-k.

For each numel (float32) and density: ``CudaOps.accumulate_select`` over the whole vector (the P=1
owned range: acc = residual + grad, count, compact), including the one small device->host read of
the count, timed with CUDA events over ``--reps`` steps after a warm-up. Effective bandwidth uses
the 12 bytes/element floor (read residual and grad, write acc); the compaction re-reads acc, so
the kernel moves a little more than that. "hist ms" times the pass the default (histogram)
controller runs every step: the same select plus its two forecast histograms over the owned range
(P=1: the next owner is this rank), one ~1 KB device->host read. Side by side on the same data: CuPy's threshold select
(``flatnonzero(abs(acc) >= thr)``), CuPy top-k (``argpartition``) and ``torch.topk`` when a CUDA
torch is installed.

    python jobs/bench_gpu.py                           # 10M, 100M, 400M x density 0.01, 0.001
    python jobs/bench_gpu.py --numel 1e7 --reps 50 --json out/bench_gpu.json
    python jobs/bench_gpu.py --check                   # no GPU: exercise the table/JSON code only
"""
import platform
import sys
import time

from common import command, parser, write_json


def parse_args(argv=None):
    p = parser(__doc__, json_path="out/bench_gpu.json", threads=False)
    p.add_argument("--numel", default="1e7,1e8,4e8", help="comma-separated element counts")
    p.add_argument("--density", default="0.01,0.001", help="comma-separated densities")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--no-topk", action="store_true", help="skip the top-k baselines")
    p.add_argument("--check", action="store_true", help="format fake rows; needs no GPU")
    return p.parse_args(argv)


def peak_bandwidth_gbs(props):
    """Theoretical DRAM bandwidth from CUDA device properties (DDR: two transfers per clock)."""
    clock_khz = props.get("memoryClockRate", 0)
    bus_bits = props.get("memoryBusWidth", 0)
    return 2.0 * clock_khz * 1e3 * bus_bits / 8 / 1e9


def row(numel, density, select_ms, peak_gbs, cupy_sel_ms=None, cupy_topk_ms=None, torch_topk_ms=None,
        selected=None, hist_ms=None):
    eff = 12.0 * numel / (select_ms * 1e-3) / 1e9
    return {
        "numel": int(numel), "density": density, "selected": selected,
        "select_ms": select_ms, "effective_GBs_12B": eff, "select_hist_ms": hist_ms,
        "fraction_of_peak": eff / peak_gbs if peak_gbs else None,
        "cupy_threshold_select_ms": cupy_sel_ms, "cupy_topk_ms": cupy_topk_ms,
        "torch_topk_ms": torch_topk_ms,
    }


def table(rows, device, peak):
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = [f"device: {device}, peak DRAM bandwidth {peak:.0f} GB/s",
             f"{'numel':>11} {'density':>8} {'selected':>10} {'select ms':>10} {'hist ms':>8} {'GB/s@12B':>9} "
             f"{'of peak':>8} {'cupy sel':>9} {'cupy topk':>10} {'torch topk':>11}"]
    for r in rows:
        lines.append(f"{r['numel']:>11,} {r['density']:>8g} {f(r['selected'], 'd'):>10} "
                     f"{r['select_ms']:>10.3f} {f(r.get('select_hist_ms'), '.3f'):>8} "
                     f"{r['effective_GBs_12B']:>9.0f} "
                     f"{f(r['fraction_of_peak'], '.0%'):>8} {f(r['cupy_threshold_select_ms'], '.3f'):>9} "
                     f"{f(r['cupy_topk_ms'], '.3f'):>10} {f(r['torch_topk_ms'], '.3f'):>11}")
    return "\n".join(lines)


def _time_ms(cp, fn, reps):
    fn()  # warm-up: compile, allocate
    cp.cuda.get_current_stream().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / reps


def _torch_topk(cp, acc, k, reps):
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    t = torch.from_dlpack(acc)

    def run():
        torch.topk(t.abs(), k, sorted=False)

    return _time_ms(cp, run, reps)  # torch runs on its current stream; events bracket device work


def measure(numel, density, reps, topk=True):
    import cupy as cp
    import numpy as np

    from exdyna_mpi.arrays import ops_for

    CudaOps = ops_for("cuda")

    n = int(numel)
    rng = cp.random.default_rng(0)
    res = rng.standard_normal(n, dtype=cp.float32) * 0.01
    grad = rng.standard_normal(n, dtype=cp.float32) * 0.01
    acc = cp.empty(n, cp.float32)
    idx = cp.empty(n, cp.int32)
    # threshold for the density from a sample of |res + grad| (set once, not timed)
    sample = cp.abs(res[: min(n, 1 << 22)] + grad[: min(n, 1 << 22)])
    thr = np.float32(float(cp.quantile(sample, 1.0 - density)))
    counts = []

    def select():
        c, _ = CudaOps.accumulate_select(res, grad, acc, 0, n, thr, idx)
        counts.append(c)

    select_ms = _time_ms(cp, select, reps)

    from exdyna_mpi.algorithm.controllers import HistogramController

    ctl = HistogramController(n, density)
    ctl.threshold = float(thr)
    plan = ctl.plan(1, np.float32)      # what the controller asks of a step's pass
    spec, fspec = plan.hist, plan.fine
    hist, fine = np.zeros(spec[0], np.int64), np.zeros(fspec[0], np.int64)

    def select_hist():
        CudaOps.accumulate_select_hist(res, grad, acc, 0, n, thr, idx, spec[1], spec[2], hist, plan.predict,
                                       (fspec[1], fspec[2], fine), (0, n), plan.stride)

    hist_ms = _time_ms(cp, select_hist, reps)
    k = max(1, int(n * density))
    cupy_sel = cupy_topk = torch_topk = None
    if topk:
        cupy_sel = _time_ms(cp, lambda: cp.flatnonzero(cp.abs(acc) >= thr), reps)
        cupy_topk = _time_ms(cp, lambda: cp.argpartition(cp.abs(acc), n - k)[n - k:], max(1, reps // 4))
        torch_topk = _torch_topk(cp, acc, k, max(1, reps // 4))
    del res, grad, acc, idx
    cp.get_default_memory_pool().free_all_blocks()
    return select_ms, counts[-1], cupy_sel, cupy_topk, torch_topk, hist_ms


def main(argv=None):
    a = parse_args(argv)
    numels = [int(float(x)) for x in a.numel.split(",")]
    densities = [float(x) for x in a.density.split(",")]
    rows = []
    if a.check:
        device, peak = "fake (--check)", 3350.0
        for n in numels:
            for d in densities:
                rows.append(row(n, d, 12.0 * n / 2.5e12 * 1e3, peak, None, None, None, int(n * d),
                                12.0 * n / 2.2e12 * 1e3))
    else:
        import cupy as cp

        from exdyna_mpi.arrays import gpu_available

        if not gpu_available():
            sys.exit("bench_gpu: no CUDA device visible to CuPy (use --check to test the script)")
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        device = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        peak = peak_bandwidth_gbs(props)
        free = cp.cuda.Device().mem_info[0]
        for n in numels:
            if 20 * n > free:  # res, grad, acc, idx and the baselines' temporaries
                print(f"skip numel {n:,}: needs ~{20 * n / 2**30:.1f} GiB, {free / 2**30:.1f} free")
                continue
            for d in densities:
                ms, sel, cs, ct, tt, hm = measure(n, d, a.reps, topk=not a.no_topk)
                rows.append(row(n, d, ms, peak, cs, ct, tt, sel, hm))
                print(table(rows[-1:], device, peak).splitlines()[-1], flush=True)
    print(table(rows, device, peak))
    doc = {"device": device, "peak_GBs": peak, "host": platform.node(), "time": time.time(),
           "reps": a.reps, "bytes_per_element_floor": 12, "rows": rows, "command": command()}
    if a.json:
        print(f"wrote {write_json(a.json, doc)}")
    return doc


if __name__ == "__main__":
    main()
