"""What the jobs share: the common flags, MPI and thread setup, JSON and table output.

How jobs import each other: every job under jobs/ is a script (``python jobs/X.py`` or ``mpiexec -n P
python -m mpi4py jobs/X.py``), and Python puts a script's own folder first on ``sys.path``, so a job
imports its siblings by plain name: ``import common``, ``import models``, ``import streams``. Tests
import them the same way: pytest.ini's ``pythonpath = jobs`` puts this folder on the path under
pytest, so ``import fidelity`` in a test is the module the script runs. Nothing edits ``sys.path``.

What jobs import from the library: the public API (``exdyna_mpi``, ``exdyna_mpi.adapters.torch``).
A job whose subject is an internal (simulate.py runs the algorithm layer and the host ops without
MPI, bench_deadline.py drives the deadline transport's send delay, bench_gpu.py and gpu_static.py
time and budget the CUDA kernels) imports it from the library module that defines or exports it,
the subpackage where it exports the name, with a comment on why it reaches past the public API;
tests/unit/test_layers.py checks both.

Example::

    from common import parser, world, write_json, markdown_table
    ap = parser(__doc__, numel=1 << 20, density=0.01, steps=60, warmup=10, seed=0, out="out/bench")
    ap.add_argument("--names", default="")
    args = ap.parse_args()
    comm, rank, P = world(args)
"""
import argparse
import ast
import json
import os
import sys
import time
import traceback

_UNSET = object()


def count(text):
    """An element count from the command line: ``1048576``, ``1e7`` or ``1<<20``."""
    text = str(text).strip()
    if "<<" in text:
        a, b = text.split("<<")
        return int(a) << int(b)
    return int(float(text))


def parser(doc, *, numel=_UNSET, density=_UNSET, steps=_UNSET, warmup=_UNSET, seed=_UNSET, out=_UNSET,
           json_path=_UNSET, dtype=_UNSET, threads=True, raw=False):
    """An ``ArgumentParser`` (description: ``doc``'s first line, or all of it with ``raw``) holding
    the flags the jobs share, each added only when given a default here:

    ``--numel`` (accepts 1e7), ``--density``, ``--steps``, ``--warmup``, ``--seed``, ``--out`` (a
    folder), ``--json`` (a file), ``--dtype`` (float32/float64), and ``--threads`` (Numba threads
    per rank; 0 keeps Numba's default).
    """
    if raw:
        ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    else:
        ap = argparse.ArgumentParser(description=(doc or "").strip().split("\n")[0])
    if numel is not _UNSET:
        ap.add_argument("--numel", type=count, default=numel, help="elements per rank (1e7 and 1<<20 work)")
    if density is not _UNSET:
        ap.add_argument("--density", type=float, default=density, help="target fraction of elements sent")
    if steps is not _UNSET:
        ap.add_argument("--steps", type=int, default=steps)
    if warmup is not _UNSET:
        ap.add_argument("--warmup", type=int, default=warmup, help="steps left out of the summary")
    if seed is not _UNSET:
        ap.add_argument("--seed", type=int, default=seed)
    if out is not _UNSET:
        ap.add_argument("--out", default=out, help="output folder")
    if json_path is not _UNSET:
        ap.add_argument("--json", default=json_path, help="JSON output file")
    if dtype is not _UNSET:
        ap.add_argument("--dtype", default=dtype, choices=["float32", "float64"])
    if threads:
        ap.add_argument("--threads", type=int, default=0, help="Numba threads per rank (0: Numba's default)")
    return ap


def key_values(items):
    """``["a=1", "b=x"]`` -> ``{"a": 1, "b": "x"}``: values read as Python literals where they are
    one (numbers, True, None, tuples), else kept as text."""
    out = {}
    for item in items:
        key, _, val = item.partition("=")
        try:
            out[key] = ast.literal_eval(val)
        except (ValueError, SyntaxError):
            out[key] = val
    return out


def set_threads(n):
    """Numba's thread count for this rank (``n`` <= 0 leaves it alone)."""
    if n and n > 0:
        import numba

        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


def cores():
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def cpu_model():
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere): torch's CPU kernels
    give other last bits on other CPUs, so records say which one ran them."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def set_torch_threads(comm, requested=0):
    """torch's threads per rank: ``requested``, or cores / ranks on this node (at least 1), so
    ranks that fill the node's cores do not fight over them. Returns the number set."""
    import torch
    from mpi4py import MPI

    if not requested:
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        requested = max(1, cores() // local.Get_size())
        local.Free()
    torch.set_num_threads(requested)
    return requested


def world(args=None):
    """``(COMM_WORLD, rank, size)``; applies ``args.threads`` when present."""
    from mpi4py import MPI

    if args is not None:
        set_threads(getattr(args, "threads", 0))
    comm = MPI.COMM_WORLD
    return comm, comm.Get_rank(), comm.Get_size()


def mpi_library():
    """The first line of the MPI library's version text (for the JSON metadata)."""
    from mpi4py import MPI

    return MPI.Get_library_version().splitlines()[0]


def command():
    return " ".join(sys.argv)


def log(tag, msg):
    """``[tag] msg`` on stderr, flushed (progress lines; stdout keeps the tables)."""
    print(f"[{tag}] {msg}", file=sys.stderr, flush=True)


def write_json(path, obj, indent=1):
    """Write ``obj`` to ``path`` (folders made as needed); returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=indent)
    return path


def append_json_line(path, obj):
    """Append ``obj`` as one JSON line to ``path`` (folders made as needed)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(obj) + "\n")


def markdown_table(header, rows):
    """A Markdown table: ``header`` a sequence of titles, ``rows`` sequences of cell texts."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


class Timer:
    """``with Timer() as t: ...``; ``t.seconds`` afterwards."""

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        return False


def abort_on_exception(comm, grace=0.5):
    """An uncaught exception on any rank aborts every rank (as ``python -m mpi4py`` does), after
    printing its traceback in one write. ``grace`` seconds pass before the abort: MPI_Abort tears
    the job down at once, and the launcher (hydra, srun) may drop output it has not forwarded yet.
    The other ranks are waiting in a collective meanwhile, so the job still ends within a second."""
    def hook(kind, value, tb):
        sys.stdout.flush()
        sys.stderr.write("".join(traceback.format_exception(kind, value, tb)))
        sys.stderr.flush()
        time.sleep(grace)
        comm.Abort(1)

    sys.excepthook = hook
