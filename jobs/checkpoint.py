"""Checkpoints for the jobs: one file per rank, written atomically, a marker written last, the last
two complete generations kept, and a format that loads without running code.

Layout under ``<out>/checkpoints/``::

    step00000040.rank0.pt  step00000040.rank1.pt  ...   one per rank and generation
    COMPLETE      JSON {"version": 2, "step": 40, "nranks": P, "files": [...],
                        "generations": [{"step": 40, "files": [...]}, {"step": 36, "files": [...]}]}

Writing: a rank writes ``<file>.tmp<pid>``, fsyncs it, renames it and fsyncs the folder, so a rank
killed mid-write leaves no half file under the real name and a power cut loses no rename.
``COMPLETE`` names a step only after every rank has reported its file written (one small
collective), so it always points at a checkpoint that exists on every rank; files of older
generations than the two it names are removed after it moves.

Format (version 2): ``torch.save`` of ``{"format": FORMAT, "version": 2, "state": ...}`` where the
state holds only tensors and plain Python values: NumPy arrays and scalars travel as a raw-byte
uint8 tensor with their dtype and shape, exactly. It is read with ``torch.load(weights_only=True)``,
which refuses anything else, so whoever can write the checkpoint folder cannot make the ranks run
code. Version 1 files (``torch.save`` of the state with NumPy objects inside, no ``"format"``) are
read with ``weights_only=True`` too, with NumPy's array reconstruction allowed and nothing more.

Reading: ``load_latest`` checks everything (marker, the step every rank sees, this rank's file, its
format, the run's configuration) on every rank before one agreement; when the newest generation
fails on any rank, every rank falls back to the previous one together; the same ``CheckpointError``
is raised on every rank when neither can be used.
"""
import glob
import json
import os

import numpy as np
import torch

MARKER = "COMPLETE"
FORMAT = "exdyna-mpi-job-checkpoint"
VERSION = 2
KEEP = 2   # complete generations kept


class CheckpointError(Exception):
    """A checkpoint that cannot be written or resumed; raised with the same text on every rank."""


def folder(out):
    return os.path.join(out, "checkpoints")


def _name(step, rank):
    return f"step{step:08d}.rank{rank}.pt"


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path, write):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


# ---------------------------------------------------------------------------- a format without code
_ND, _NS = "__ndarray__", "__npscalar__"


def _bytes_tensor(a):
    if not a.nbytes:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(a.tobytes()), dtype=torch.uint8)


def encode(obj):
    """``obj`` with every NumPy array and scalar replaced by tensors and plain values (exact bits);
    anything ``torch.load(weights_only=True)`` could not read raises ``TypeError``."""
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError("a NumPy array of Python objects cannot be checkpointed")
        a = obj if obj.flags.c_contiguous else obj.copy(order="C")   # (ascontiguousarray makes 0-d 1-d)
        return {_ND: a.dtype.str, "shape": list(a.shape), "data": _bytes_tensor(a)}
    if isinstance(obj, np.generic):
        return {_NS: obj.dtype.str, "data": _bytes_tensor(np.asarray(obj))}
    if isinstance(obj, dict):
        if any(not isinstance(k, (str, int)) for k in obj):
            raise TypeError(f"checkpoint dict keys must be str or int, got {[type(k) for k in obj]}")
        return {k: encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [encode(v) for v in obj]
        return out if isinstance(obj, list) else tuple(out)
    if obj is None or isinstance(obj, (bool, int, float, str, bytes, torch.Tensor)):
        return obj
    raise TypeError(f"a {type(obj).__name__} cannot be checkpointed (tensors, NumPy arrays and plain values only)")


def decode(obj):
    """The inverse of ``encode``."""
    if isinstance(obj, dict):
        if _ND in obj:
            flat = np.frombuffer(obj["data"].numpy().tobytes(), dtype=np.dtype(obj[_ND]))
            return flat.reshape(tuple(obj["shape"])).copy()
        if _NS in obj:
            return np.frombuffer(obj["data"].numpy().tobytes(), dtype=np.dtype(obj[_NS]))[0]
        return {k: decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(decode(v) for v in obj)
    return obj


def _numpy_globals():
    """What a version 1 file (NumPy objects pickled inside) needs beyond weights_only's defaults:
    array reconstruction, dtypes and ``bytes`` (pickle protocol 2 writes ``b""`` as ``bytes()``),
    nothing that can call arbitrary code."""
    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype, bytes]
    allowed += [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")]
    return allowed


def read(path):
    """A rank's state from ``path`` (version 2, or version 1 with only NumPy allowed), without code."""
    with torch.serialization.safe_globals(_numpy_globals()):
        raw = torch.load(path, weights_only=True, map_location="cpu")
    if isinstance(raw, dict) and raw.get("format") == FORMAT:
        if raw.get("version") != VERSION:
            raise ValueError(f"checkpoint format version {raw.get('version')!r}; this code reads 1 and {VERSION}")
        return decode(raw["state"])
    if isinstance(raw, dict) and "config" in raw:   # version 1: the state itself
        return raw
    raise ValueError("not a checkpoint written by these jobs")


def write(path, state):
    body = {"format": FORMAT, "version": VERSION, "state": encode(state)}
    _atomic_write(path, lambda f: torch.save(body, f))


# ---------------------------------------------------------------------------- collective save and load
def _read_marker(d):
    with open(os.path.join(d, MARKER)) as f:
        info = json.load(f)
    gens = info.get("generations") or [{"step": info["step"], "files": info["files"]}]   # version 1 marker
    return info, gens


def save(comm, out, step, state):
    """Write this rank's ``state`` for ``step`` (collective), then the marker (rank 0)."""
    rank, nranks = comm.Get_rank(), comm.Get_size()
    d = folder(out)
    problem = ""
    try:
        os.makedirs(d, exist_ok=True)
        write(os.path.join(d, _name(step, rank)), state)
    except (OSError, TypeError) as e:
        problem = f"rank {rank}: {e}"
    problems = [p for p in comm.allgather(problem) if p]
    if problems:
        raise CheckpointError(f"writing step {step} failed: " + "; ".join(problems))
    if rank == 0:
        files = [_name(step, r) for r in range(nranks)]
        gens = [{"step": step, "files": files}]
        try:
            _, old = _read_marker(d)
            gens += [g for g in old if g["step"] != step and len(g["files"]) == nranks][:KEEP - 1]
        except (OSError, ValueError, KeyError, TypeError):
            pass   # no usable marker yet: this generation is the only one
        body = json.dumps({"version": VERSION, "step": step, "nranks": nranks, "files": files,
                           "generations": gens}).encode()
        _atomic_write(os.path.join(d, MARKER), lambda f: f.write(body))
        keep = {f for g in gens for f in g["files"]}
        for stale in glob.glob(os.path.join(d, "step*.rank*.pt")):
            if os.path.basename(stale) not in keep:
                os.remove(stale)
    comm.Barrier()   # nobody goes on (or dies) believing in a checkpoint the marker does not name yet


def _try(d, gen, rank, config):
    """(problem or "", state) for this rank's file of generation ``gen``."""
    path = os.path.join(d, gen["files"][rank])
    if not os.path.exists(path):
        return f"rank {rank}'s file {path} is missing", None
    try:
        state = read(path)
        saved = state["config"]
    except Exception as e:   # noqa: BLE001 - a corrupt file may raise anything; all ranks hear of it
        return f"rank {rank} cannot read {os.path.basename(path)} ({type(e).__name__}: {e})", None
    diff = sorted(k for k in set(saved) | set(config) if saved.get(k) != config.get(k))
    if diff:
        return "it was written with other settings: " + ", ".join(
            f"{k}={saved.get(k)!r} (now {config.get(k)!r})" for k in diff), None
    return "", state


def load_latest(comm, out, config, report=None):
    """This rank's state from the last complete checkpoint in ``out`` that every rank can read, or
    None when there is none.

    ``config`` (a dict of what must match: ranks, runs, model, hyper-parameters) is compared with
    the one saved. The newest generation is tried first, then the previous one, every rank together.
    ``report``: a list that receives a line for every generation passed over. Any problem that
    leaves no usable generation raises the same ``CheckpointError`` on every rank.
    """
    rank, nranks = comm.Get_rank(), comm.Get_size()
    d = folder(out)
    marker = os.path.join(d, MARKER)
    problem, gens = "", []
    exists = os.path.exists(marker)
    if exists:
        try:
            info, gens = _read_marker(d)
            if info["nranks"] != nranks:
                problem = f"it was written by {info['nranks']} ranks, this job has {nranks}"
        except (OSError, ValueError, KeyError, TypeError) as e:
            problem = f"rank {rank} cannot read {marker} ({e!r})"
    views = comm.allgather((exists, problem, [g["step"] for g in gens] if not problem else None))
    if len({e for e, _, _ in views}) > 1:
        raise CheckpointError(f"ranks disagree on whether {marker} exists (is --out on a shared file system?)")
    problems = sorted({p for _, p, _ in views if p})
    if problems:
        raise CheckpointError(f"cannot resume from {d}: " + "; ".join(problems))
    if not exists:
        return None
    if len({tuple(s) for _, _, s in views}) > 1:
        raise CheckpointError(f"ranks see different checkpoints in {d}: " + "; ".join(
            f"rank {r}: steps {s}" for r, (_, _, s) in enumerate(views)))
    passed = []
    for gen in gens:
        problem, state = _try(d, gen, rank, config)
        problems = sorted({p for p in comm.allgather(problem) if p})
        if not problems:
            if report is not None:
                report.extend(passed)
            return state
        passed.append(f"step {gen['step']}: " + "; ".join(problems))
        if any("other settings" in p for p in problems):
            break   # an older generation of the same run has the same settings
    raise CheckpointError(f"cannot resume from {d}: " + " | ".join(passed))
