"""Benchmark (not a test): ``ExDyna.step`` on a GPU end to end, each of its kernels alone, and
baselines doing the same work, against the device's DRAM bandwidth.

For each numel (float32) and density, P=1, the default controller:

- **step**: ``ExDyna.step(grad)`` timed with CUDA events recorded on the stream the step launches
  on (CuPy's current stream), after ``--warmup`` steps (compile, allocate, controller settling);
  the host waits inside the step are part of it. With the AR stream each step starts on an idle
  device (all of its host time counts), and again queued behind the gradient's update with no
  wait (``step_queued_ms``: as after ``loss.backward()``, the host time before the first launch
  hides behind the producer). Bytes floor 16 B/element (read residual and grad,
  write acc, write the zeroed output); ``of floor`` = floor time / step time.
- **kernels**, each alone on the same buffers, events on the same stream: the fused
  accumulate + measure pass (``_acc_measure32``, its warp-ballot variant on a GPU; 12 B/element) on a
  fresh residual and on the step's own error-feedback residual, the block scan,
  the mask compaction (1/8 B/element + 4 B/index), ``fill_zero`` (memset, 4 B/element), gather
  and the scatter of the mean (per index). ``of peak`` = bytes / time / peak bandwidth.
- **baselines, same work** (accumulate, select, indices on the device, ready for the exchange):
  CuPy ``acc = r + g; flatnonzero(abs(acc) >= thr)``, and ``torch.topk(abs(r + g), k)`` on
  torch's current stream, timed with torch's own events.

    python jobs/bench_gpu.py                           # 10M, 100M, 400M x density 0.01, 0.001
    python jobs/bench_gpu.py --numel 1e7 --reps 50 --json out/bench_gpu.json
    python jobs/bench_gpu.py --check                   # no GPU: exercise the table/JSON code only
"""
import os
import platform
import sys
import time

from common import command, parser, write_json

def parse_args(argv=None):
    p = parser(__doc__, json_path="out/bench_gpu.json", threads=False)
    p.add_argument("--numel", default="1e7,1e8,4e8", help="comma-separated element counts")
    p.add_argument("--density", default="0.01,0.001", help="comma-separated densities")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="steps before timing (compile, controller settling)")
    p.add_argument("--no-topk", action="store_true", help="skip the top-k baselines")
    p.add_argument("--controller", default="measured",
                   help="comma-separated ExDyna controllers to time (measured is the default)")
    p.add_argument("--stream", default="ar", choices=("ar", "constant"),
                   help="gradients: ar = AR(0.9), a new one each step, generated outside the timed step and "
                        "synchronised before it (default); constant = one gradient every step, back to back")
    p.add_argument("--max-imbalance", type=float, default=None,
                   help="ExDyna's max_imbalance (per-rank quotas; matters under mpiexec -n P > 1)")
    p.add_argument("--rank-skew", type=float, default=0.0,
                   help="rank r's gradient is scaled by 1 + skew * r (unequal loads, so quotas move selections)")
    p.add_argument("--check", action="store_true", help="format fake rows; needs no GPU")
    p.add_argument("--profile", action="store_true",
                   help="cProfile of the timed steps (host time per function, waits included), per numel")
    return p.parse_args(argv)


def peak_bandwidth_gbs(props):
    """Theoretical DRAM bandwidth from CUDA device properties (DDR: two transfers per clock)."""
    clock_khz = props.get("memoryClockRate", 0)
    bus_bits = props.get("memoryBusWidth", 0)
    return 2.0 * clock_khz * 1e3 * bus_bits / 8 / 1e9


KERNEL_BYTES = {"acc_measure": 12.0, "acc_measure_ef": 12.0, "acc_measure_warp": 12.0,
                "acc_measure_warp_ef": 12.0, "scan": 0.0, "compact": 0.125, "fill_zero": 4.0}  # per element
STEP_FLOOR = 16.0


def copy_bandwidth_gbs(cp, nbytes=2 << 30, reps=10):
    """Measured ceiling: a device-to-device copy, bytes read plus bytes written per second."""
    a = cp.empty(nbytes // 4, cp.float32)
    a.fill(1.0)
    b = cp.empty_like(a)
    ms = _time_ms(cp, lambda: b.__setitem__(Ellipsis, a), reps, warmup=2)
    a = b = None   # frees both (the lambda reads the names, so no del)
    cp.get_default_memory_pool().free_all_blocks()
    return 2.0 * nbytes / (ms * 1e-3) / 1e9


def row(numel, density, peak_gbs, step_ms, kernels, baselines, selected=None, controller="measured"):
    """One table row. ``kernels``: {name: ms}; ``baselines``: {name: ms or None}."""
    per = {}
    for name, ms in kernels.items():
        b = KERNEL_BYTES.get(name)
        frac = (b * numel / (ms * 1e-3) / 1e9 / peak_gbs) if (b and ms and peak_gbs) else None
        per[name] = {"ms": ms, "bytes_per_element": b, "fraction_of_peak": frac}
    floor_ms = STEP_FLOOR * numel / (peak_gbs * 1e9) * 1e3 if peak_gbs else None
    return {"numel": int(numel), "density": density, "controller": controller, "selected": selected, "step_ms": step_ms,
            "step_floor_ms": floor_ms, "step_of_floor": (floor_ms / step_ms) if floor_ms and step_ms else None,
            "kernels": per, "baselines": baselines,
            "speedup_vs_torch_topk": (baselines.get("torch_topk") / step_ms)
            if baselines.get("torch_topk") and step_ms else None}


def table(rows, device, peak):
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = [f"device: {device}, DRAM bandwidth {peak:.0f} GB/s (measured copy); step floor {STEP_FLOOR:g} B/element",
             f"{'numel':>11} {'density':>8} {'ctrl':>5} {'selected':>10} {'step ms':>8} {'of floor':>8} "
             f"{'pass ms':>8} {'of peak':>7} {'measure':>8} {'of peak':>7} {'scan ms':>7} {'compact':>8} "
             f"{'fill ms':>7} {'of peak':>7} "
             f"{'cupy sel':>9} {'torch topk':>10} {'x torch':>7}"]
    for r in rows:
        k, bl = r["kernels"], r["baselines"]

        def km(n, key="ms", fmt=".3f"):
            return f(k.get(n, {}).get(key), fmt)

        mk = next((m for m in ("acc_measure_warp_ef", "acc_measure_ef", "acc_measure") if m in k), "acc_measure")
        mp = "acc_measure_warp" if "acc_measure_warp" in k else "acc_measure"

        lines.append(f"{r['numel']:>11,} {r['density']:>8g} {r.get('controller', 'measured')[:5]:>5} "
                     f"{f(r['selected'], 'd'):>10} {f(r['step_ms'], '.3f'):>8} "
                     f"{f(r['step_of_floor'], '.0%'):>8} {km(mp):>8} "
                     f"{km(mp, 'fraction_of_peak', '.0%'):>7} {km(mk):>8} "
                     f"{km(mk, 'fraction_of_peak', '.0%'):>7} {km('scan'):>7} {km('compact'):>8} "
                     f"{km('fill_zero'):>7} {km('fill_zero', 'fraction_of_peak', '.0%'):>7} "
                     f"{f(bl.get('cupy_threshold_select'), '.3f'):>9} {f(bl.get('torch_topk'), '.3f'):>10} "
                     f"{f(r['speedup_vs_torch_topk'], '.1f'):>7}")
    return "\n".join(lines)


def _time_ms(cp, fn, reps, warmup=1):
    """Mean ms of ``fn`` over ``reps`` calls, CuPy events on CuPy's current stream (the stream
    ``CudaOps`` launches on); warm-up calls excluded."""
    for _ in range(warmup):
        fn()
    stream = cp.cuda.get_current_stream()
    stream.synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    for _ in range(reps):
        fn()
    stop.record(stream)
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / reps


def _torch_topk(r, g, k, reps):
    """``topk(|r + g|, k)`` indices, the same work as the fused pass, timed on torch's stream."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    tr, tg = torch.from_dlpack(r), torch.from_dlpack(g)

    def run():
        acc = tr + tg
        return torch.topk(acc.abs(), k, sorted=False).indices

    run()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / reps


def measure(numel, density, reps, warmup, topk=True, profile=False, controller="measured", gen="ar",
            max_imbalance=None, skew=0.0):
    import cupy as cp
    import numpy as np

    import exdyna_mpi
    # the CUDA kernels themselves are what this benchmark times (it needs numba-cuda: loaded here)
    import exdyna_mpi.kernels.cuda as kc

    n = int(numel)
    rng = cp.random.default_rng(0)
    sp = exdyna_mpi.ExDyna(n, density, device="cuda", controller=controller, max_imbalance=max_imbalance)
    scale = np.float32(0.01 * (1.0 + skew * sp.rank))
    grad = rng.standard_normal(n, dtype=cp.float32) * scale
    zooms, moved, secs = [], [], []
    step_queued_ms = None
    if gen == "constant":   # the same gradient every step (the controller's hardest case)
        step_ms = _time_ms(cp, lambda: sp.step(grad), reps, warmup=warmup)
    else:                      # AR(0.9): g = 0.9 g + 0.44 noise, generated outside the timed steps
        noise = cp.empty_like(grad)
        stream = cp.cuda.get_current_stream()

        def advance():   # the next gradient, queued on the stream
            rng.standard_normal(dtype=cp.float32, out=noise)
            grad.__imul__(0.9)
            grad.__iadd__(noise * np.float32(scale * 0.4359))

        times = []
        for t in range(warmup + reps):
            advance()
            stream.synchronize()   # the step's own host time is all exposed
            ms = _time_ms(cp, lambda: sp.step(grad), 1, warmup=0)
            if t >= warmup:
                times.append(ms)
                zooms.append(getattr(sp.controller, "zooms", 0))
                moved.append(int(getattr(sp.stats, "quota_moved", 0) or 0))
                secs.append(dict(sp.stats.seconds or {}))
        step_ms = float(np.median(times))
        # the same steps queued behind the gradient's producer, as after loss.backward(): the host
        # reaches step() while the device still runs the update, so the step's host time before its
        # first launch is hidden; what the host does after the count words are read is not
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        queued = []
        for t in range(reps):
            advance()
            start.record(stream)
            sp.step(grad)
            stop.record(stream)
            stop.synchronize()
            queued.append(cp.cuda.get_elapsed_time(start, stop))
        step_queued_ms = float(np.median(queued))
    selected = int(sp.stats.selected)
    if profile:
        import cProfile
        import io
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        for _ in range(reps):
            sp.step(grad)
        cp.cuda.get_current_stream().synchronize()
        pr.disable()
        buf = io.StringIO()
        st = pstats.Stats(pr, stream=buf)
        st.sort_stats("tottime").print_stats(25)
        st.sort_stats("cumulative").print_stats(30)
        print(f"--- profile, numel {n:,}, density {density}, {reps} steps\n{buf.getvalue()}", flush=True)

    # each kernel alone, on buffers of the step's shape, the plan the controller asks for now
    res_ef = sp.memory.residual.copy()   # the error-feedback state the step's own pass meets
    res = rng.standard_normal(n, dtype=cp.float32) * 0.01
    acc = cp.empty(n, cp.float32)
    idx = cp.empty(n, cp.int32)
    out = cp.empty(n, cp.float32)
    plan = sp.controller.plan(1, np.float32)
    thr = np.float32(sp.controller.mark(plan) if plan.measure else plan.threshold)   # the step marks from here
    spec, fspec = plan.hist, plan.fine
    scratch = kc.Scratch(cp.zeros(kc.Scratch.size(), cp.int64), zeros=lambda m, dt: cp.zeros(m, dt))
    stream = kc.cuda.external_stream(cp.cuda.get_current_stream().ptr)
    mask = scratch.mask_for(n)
    nb, bd = kc.grid_shape(n)
    cs = kc.chunk_size(n, nb, bd)
    kpass = kc.measure_kernel(np.float32)   # the variant the step launches

    def run_pass(kernel, r):
        kc.launch_kernel(kernel, nb, bd, stream, r, grad, acc, 0, n, thr, cs, scratch.block_counts,
                         scratch.block_bad, mask, spec[1], spec[2], spec[0], fspec[1], fspec[2], fspec[0],
                         scratch.hist, plan.stride)

    def scan():
        kc.scan_async(scratch, nb, stream)

    def compact():
        kc.compact_async(scratch, nb, 0, n, cs, mask, idx, stream)

    def one_select():  # the mask must be set before each compaction (it clears what it reads)
        run_pass(kpass, res)
        scan()
        compact()

    # each kernel alone through Numba's own launch, the same path for every kernel and every version
    with kc.configured(launch="numba"):
        kernels = {"pass": _time_ms(cp, lambda: run_pass(kpass, res), reps)}
        if plan.measure:   # each variant alone, on a fresh residual and on the step's own
            for v in ("safe", "fast"):
                kmeasure = kc.measure_kernel(np.float32, v)
                # the step's residual: its pile just under the threshold marks more
                for tag, rr in (("", res), ("_ef", res_ef)):
                    kernels[f"acc_measure{'_warp' if v == 'fast' else ''}{tag}"] = _time_ms(
                        cp, lambda: run_pass(kmeasure, rr), reps)
                    kc.zero_words(mask, (n + 31) // 32, stream)   # marks off
        del res_ef
        kernels["scan"] = _time_ms(cp, scan, reps)
        t_all = _time_ms(cp, one_select, reps)
    kernels["compact"] = max(t_all - kernels.pop("pass") - kernels["scan"], 0.0)
    kernels["fill_zero"] = _time_ms(cp, lambda: out.data.memset_async(0, out.nbytes), reps)
    count = int(scratch.totals.get()[0])
    union = idx[:count]
    vals = cp.empty(count, cp.float32)
    if count:
        kernels["gather"] = _time_ms(cp, lambda: kc.gather(acc, union, vals, stream), reps)
        kernels["scatter_mean_zero"] = _time_ms(
            cp, lambda: kc.scatter_mean_zero(out, res, union, vals, np.float32(1), stream), reps)
    baselines = {"cupy_threshold_select": None, "torch_topk": None}
    if topk:
        def cupy_sel():
            a = res + grad
            return cp.flatnonzero(cp.abs(a) >= thr)

        baselines["cupy_threshold_select"] = _time_ms(cp, cupy_sel, reps)
        baselines["torch_topk"] = _torch_topk(res, grad, max(1, int(n * density)), max(1, reps // 4))
    nranks = sp.nranks
    sp = res = grad = acc = idx = out = vals = None   # free before the pool (lambdas read these names)
    cp.get_default_memory_pool().free_all_blocks()
    phases = sorted({k for s in secs for k in s})
    extra = {"zoom_steps": sum(1 for z in zooms if z), "steps": len(zooms), "nranks": nranks,
             "max_imbalance": max_imbalance, "step_queued_ms": step_queued_ms,
             "quota_moved_mean": float(np.mean(moved)) if moved else 0.0,
             "host_phase_ms": {k: 1e3 * float(np.median([s.get(k, 0.0) for s in secs])) for k in phases}}
    return step_ms, kernels, baselines, selected, extra


def launch_costs(cp, kc, stream, reps=300):
    """Host microseconds per launch of a tiny kernel through ``kc.launch_kernel`` with each launch
    path (``CONFIG.launch``: ``numba``, Numba's dispatcher; ``core``, cuda.core's launch; ``fast``,
    the raw driver launch): the two-argument word zeroing (``zero_words``, grid sizing included),
    and the 18-argument measuring pass on 4096 elements."""
    import numpy as np

    w = cp.zeros(64, cp.int64)
    x = cp.ones(4096, cp.float32)
    acc = cp.empty_like(x)
    s = kc.Scratch(cp.zeros(kc.Scratch.size(), cp.int64), zeros=lambda m, dt: cp.zeros(m, dt))
    mask = s.mask_for(4096)
    kcount = kc.measure_kernel(np.float32)
    hist_args = (x, x, acc, 0, 4096, np.float32(np.nan), 4096, s.block_counts, s.block_bad, mask,
                 20, 100, 4, 15, 30000, 4, s.hist, 1)
    out = {}
    for name, fn in (("zero_words", lambda: kc.zero_words(w, 64, stream)),
                     ("measure_pass", lambda: kc.launch_kernel(kcount, 1, 256, stream, *hist_args))):
        for label in ("numba", "core", "fast"):
            with kc.configured(launch=label):
                for _ in range(5):
                    fn()
                cp.cuda.get_current_stream().synchronize()
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                host = (time.perf_counter() - t0) / reps * 1e6
                cp.cuda.get_current_stream().synchronize()
            out[f"{name}_{label}"] = host
    print("host us per launch: " + ", ".join(f"{k} {v:.1f}" for k, v in out.items()), flush=True)
    return out


def main(argv=None):
    a = parse_args(argv)
    numels = [int(float(x)) for x in a.numel.split(",")]
    densities = [float(x) for x in a.density.split(",")]
    rows = []
    if a.check:
        device, peak = "fake (--check)", 3350.0
        for n in numels:
            for d in densities:
                fake = {"acc_measure": 12.0 * n / 2.2e12 * 1e3, "scan": 0.003, "compact": 0.02,
                        "fill_zero": 4.0 * n / 3.0e12 * 1e3}
                rows.append(row(n, d, peak, 16.0 * n / 1.8e12 * 1e3, fake,
                                {"cupy_threshold_select": None, "torch_topk": None}, int(n * d)))
    else:
        import cupy as cp

        # whether CuPy sees a device, asked before the CUDA kernels load
        from exdyna_mpi.arrays import gpu_available

        if "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ:   # under mpiexec: rank 0 reports
            from mpi4py import MPI
            if MPI.COMM_WORLD.Get_rank():
                sys.stdout = open(os.devnull, "w")
                a.json = None

        if not gpu_available():
            sys.exit("bench_gpu: no CUDA device visible to CuPy (use --check to test the script)")
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        device = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        spec = peak_bandwidth_gbs(props)  # 0 where CUDA 13 no longer reports the memory clock
        copy = copy_bandwidth_gbs(cp)
        print(f"DRAM: datasheet-style peak {spec:.0f} GB/s (from device properties), "
              f"measured device-to-device copy {copy:.0f} GB/s (read + write); fractions use the copy")
        peak = copy
        # the CUDA kernels themselves are what this benchmark times
        import exdyna_mpi.kernels.cuda as kc

        launch_us = (launch_costs(cp, kc, kc.cuda.external_stream(cp.cuda.get_current_stream().ptr))
                     if hasattr(kc, "configured") else None)   # (an older exdyna_mpi on PYTHONPATH: before/after runs)
        free = cp.cuda.Device().mem_info[0]
        for n in numels:
            if 28 * n > free:  # grad, residual, acc, out, idx, the kernels' copies, the baselines' temporaries
                print(f"skip numel {n:,}: needs ~{28 * n / 2**30:.1f} GiB, {free / 2**30:.1f} free")
                continue
            for d in densities:
                for c in a.controller.split(","):
                    step_ms, kernels, baselines, sel, extra = measure(n, d, a.reps, a.warmup, topk=not a.no_topk,
                                                                      profile=a.profile, controller=c, gen=a.stream,
                                                                      max_imbalance=a.max_imbalance, skew=a.rank_skew)
                    rows.append(row(n, d, peak, step_ms, kernels, baselines, sel, c))
                    rows[-1].update(extra, stream=a.stream)
                    print(table(rows[-1:], device, peak).splitlines()[-1], flush=True)
                    if extra.get("step_queued_ms"):
                        q = extra["step_queued_ms"]
                        fl = rows[-1]["step_floor_ms"]
                        tk = baselines.get("torch_topk")
                        print(f"    queued behind the gradient's update: step {q:.3f} ms, {fl / q:.0%} of floor"
                              + (f", {tk / q:.1f}x torch.topk" if tk else ""), flush=True)
    print(table(rows, device, peak))
    doc = {"device": device, "peak_GBs": peak, "peak_is": "measured device-to-device copy", "host": platform.node(),
           "time": time.time(), "reps": a.reps, "warmup": a.warmup, "stream": a.stream,
           "launch_us": None if a.check else launch_us, "bytes_per_element_floor": STEP_FLOOR, "rows": rows,
           "command": command()}
    if a.json:
        print(f"wrote {write_json(a.json, doc)}")
    return doc


if __name__ == "__main__":
    main()
