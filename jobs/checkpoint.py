"""Checkpoints for the jobs: one file per rank, written atomically, a marker written last, the last
two complete generations kept, a format that loads without running code, and nothing resumed from
a file that is not, bit for bit, what this rank wrote for that step.

Layout under ``<out>/checkpoints/``::

    step00000040.rank0.pt  step00000040.rank1.pt  ...   one per rank and generation
    COMPLETE      JSON {"version": 3, "step": 40, "nranks": P, "files": [...],
                        "generations": [{"step": 40, "files": [...]}, {"step": 36, "files": [...]}]}

Writing: every rank first checks its state (a type the format cannot hold, a non-finite value in a
tensor or array) and the ranks agree, with the digests of their shared parts, that it can be
written: a state that ``load_latest`` would refuse never becomes a generation and never pushes a
good one out. Then a rank writes ``<file>.tmp<pid>``, fsyncs it, renames it and fsyncs the folder,
so a rank killed mid-write leaves no half file under the real name and a power cut loses no
rename. ``COMPLETE`` names a step only after every rank has reported its file written (one small
collective), so it always points at a checkpoint that exists on every rank; files of older
generations than the two it names are removed after it moves.

Format (version 3): ``torch.save`` of ``{"format": FORMAT, "version": 3, "rank": r, "nranks": P,
"step": s, "shared": <digest of the shared part, or None>, "digest": <digest of all the rest>,
"state": ...}`` where the state holds only tensors and plain Python values: NumPy arrays and scalars
travel as a raw-byte uint8 tensor with their dtype and shape, exactly. It is read with
``torch.load(weights_only=True)``, which refuses anything else, so whoever can write the checkpoint
folder cannot make the ranks run code.

The shared part is what every rank must hold bit for bit (in the jobs: the model's parameters and
buffers, which the gradient exchange keeps identical); the caller names it with ``shared=``, the
same function of the state at save and at load. Digests are sha256 over the exact bits and the
structure. ``digest`` catches a file damaged or edited after it was written (it covers the header
too, so a file copied from another rank or step still says so); ``shared`` lets the ranks see that
they would resume from different parameters. They are checks, not a signature: whoever can write
the folder can write a consistent file (never one that runs code).

Versions 1 (``torch.save`` of the state itself) and 2 (the state without rank, step or digests) are
refused, saying why: a file that records neither the rank that wrote it nor a digest cannot be
checked, and resuming from an unchecked file is what this format exists to prevent.

Reading: ``load_latest`` checks everything on every rank before one agreement per generation: the
marker (keys, types, one file per rank in each generation), the steps every rank sees, this rank's
file (readable, version 3, written by this rank of a run of P ranks for that step, matching its
digest), the run's configuration, finiteness, and the digest of the shared part, which travels with
the agreement so that the ranks also refuse a generation whose shared parts differ. When a
generation fails on any rank, every rank falls back to the previous one together; the same
``CheckpointError``, naming each rank and its cause, is raised on every rank when none can be used.
Nothing is returned, so nothing reaches the job's objects, before the agreement. ``load_all``
(a resume at another number of ranks) reads every old rank's file of a generation on every rank,
each checked the same way, the shared parts equal across them, and returns them in rank order.
"""
import glob
import hashlib
import json
import os
import struct

import numpy as np
import torch

MARKER = "COMPLETE"
FORMAT = "exdyna-mpi-job-checkpoint"
VERSION = 3
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


# ---------------------------------------------------------------------------- digests and finiteness
def _tensor_bytes(t):
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def _blob(h, tag, data):
    h.update(b"%s%d;" % (tag, len(data)))
    h.update(data)


def _feed(h, obj):
    """Hash ``obj`` (an encoded state: tensors, containers, plain values) with its structure, so
    that a list is not a tuple, 1 is not 1.0 and no two layouts give the same byte stream."""
    if isinstance(obj, torch.Tensor):
        h.update(f"T{obj.dtype}{tuple(obj.shape)};".encode())
        h.update(_tensor_bytes(obj))
    elif isinstance(obj, dict):
        h.update(b"D%d;" % len(obj))
        for k, v in obj.items():
            _feed(h, k)
            _feed(h, v)
    elif isinstance(obj, (list, tuple)):
        h.update(b"%s%d;" % (b"L" if isinstance(obj, list) else b"U", len(obj)))
        for v in obj:
            _feed(h, v)
    elif obj is None:
        h.update(b"N")
    elif isinstance(obj, bool):
        h.update(b"B1" if obj else b"B0")
    elif isinstance(obj, int):
        _blob(h, b"I", str(obj).encode())
    elif isinstance(obj, float):
        h.update(b"F" + struct.pack("<d", obj))
    elif isinstance(obj, str):
        _blob(h, b"S", obj.encode("utf-8", "surrogatepass"))
    elif isinstance(obj, bytes):
        _blob(h, b"Y", obj)
    else:
        raise TypeError(f"a {type(obj).__name__} has no digest")


def _digest(obj):
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def _seal(header, enc_state):
    """The digest a file records: its header (rank, run size, step, shared digest) and its state."""
    return _digest([VERSION, header["rank"], header["nranks"], header["step"], header["shared"], enc_state])


def _shared_digest(state, shared):
    """The digest of the part of ``state`` that ``shared`` selects, or None when it selects none."""
    part = None if shared is None else shared(state)
    return None if part is None else _digest(encode(part))


def _nonfinite(obj, where=""):
    """Where (``a/b/0``) ``obj`` holds a non-finite value in a tensor or NumPy array, or None."""
    if isinstance(obj, torch.Tensor):
        if (obj.is_floating_point() or obj.is_complex()) and obj.numel() and not bool(torch.isfinite(obj).all()):
            return where or "the state"
    elif isinstance(obj, (np.ndarray, np.generic)):
        a = np.asarray(obj)
        if a.dtype.kind in "fc" and a.size and not np.isfinite(a).all():
            return where or "the state"
    elif isinstance(obj, dict):
        for k, v in obj.items():
            bad = _nonfinite(v, f"{where}/{k}" if where else str(k))
            if bad is not None:
                return bad
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            bad = _nonfinite(v, f"{where}/{i}" if where else str(i))
            if bad is not None:
                return bad
    return None


# ---------------------------------------------------------------------------- one rank's file
_HEADER = ("rank", "nranks", "step", "shared")
_OLD = ("format version {}: it records neither the rank that wrote it nor a digest of its state, so it "
        f"cannot be checked before resuming; this code reads version {VERSION} only (finish that run with the "
        "code that wrote it, or start it afresh)")


def _numpy_globals():
    """What a version 1 file (NumPy objects pickled inside) needs beyond weights_only's defaults, so
    that it is recognised and refused by name: array reconstruction, dtypes and ``bytes`` (pickle
    protocol 2 writes ``b""`` as ``bytes()``), nothing that can call arbitrary code."""
    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, core.multiarray.scalar, np.ndarray, np.dtype, bytes]
    allowed += [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")]
    return allowed


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def read(path):
    """``(header, state)`` of the file at ``path``, read without running code; ``header`` holds
    the rank that wrote it, the run's size, the step and the shared part's digest.

    Raises ``ValueError`` for a file of another format or version, a malformed header, or contents
    that do not match the digest written with them.
    """
    header, state, _ = _read_sealed(path)
    return header, state


def _read_sealed(path):
    """``read``'s ``(header, state)`` and the digest the file was sealed with."""
    with torch.serialization.safe_globals(_numpy_globals()):
        raw = torch.load(path, weights_only=True, map_location="cpu")
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        if isinstance(raw, dict) and "config" in raw:   # version 1: the state itself
            raise ValueError(_OLD.format(1))
        raise ValueError("not a checkpoint written by these jobs")
    version = raw.get("version")
    if version != VERSION:
        if version in (1, 2):
            raise ValueError(_OLD.format(version))
        raise ValueError(f"checkpoint format version {version!r}; this code reads version {VERSION}")
    header = {k: raw.get(k) for k in _HEADER}
    if not (all(_is_int(header[k]) for k in ("rank", "nranks", "step"))
            and isinstance(header["shared"], (str, type(None))) and isinstance(raw.get("digest"), str)):
        raise ValueError(f"its header is malformed ({header}, digest {raw.get('digest')!r:.80})")
    if _seal(header, raw.get("state")) != raw["digest"]:
        raise ValueError("its contents do not match the digest written with them: the file was changed or "
                         "damaged after it was written")
    return header, decode(raw["state"]), raw["digest"]


def _write_encoded(path, enc, rank, nranks, step, shared_digest):
    header = {"rank": rank, "nranks": nranks, "step": step, "shared": shared_digest}
    body = {"format": FORMAT, "version": VERSION, **header, "digest": _seal(header, enc), "state": enc}
    _atomic_write(path, lambda f: torch.save(body, f))


def write(path, state, *, rank, nranks, step, shared=None):
    """Write ``state`` to ``path`` atomically as rank ``rank``'s file of a run of ``nranks`` ranks
    at ``step``; ``shared`` as for ``save``. One rank's file, no marker: ``save`` is the collective."""
    _write_encoded(path, encode(state), rank, nranks, step, _shared_digest(state, shared))


# ---------------------------------------------------------------------------- the marker
def _generation_problem(g, nranks):
    what = "its entry for this generation"
    if not isinstance(g, dict):
        return f"{what} is not an object ({g!r:.80})"
    step, files = g.get("step"), g.get("files")
    if not _is_int(step) or step < 0:
        return f"{what} has step {step!r:.80}"
    if not isinstance(files, list):
        return f"{what} has no list of files ({files!r:.80})"
    if len(files) != nranks:
        return f"{what} lists {len(files)} file{'' if len(files) == 1 else 's'} for {nranks} ranks"
    for r, f in enumerate(files):
        if f != _name(step, r):
            return f"{what} names {f!r:.80} as rank {r}'s file, not {_name(step, r)!r}"
    return ""


def _marker(d, nranks):
    """``(problem, generations, version)`` of the marker in ``d`` (``nranks`` None: of any size). A
    problem refuses the whole marker; each generation is ``(step or None, files, problem)``, and one
    with a problem is refused alone (the others can still be resumed from)."""
    with open(os.path.join(d, MARKER)) as f:
        info = json.load(f)
    if not isinstance(info, dict):
        return f"it is not a JSON object ({info!r:.80})", [], None
    if not _is_int(info.get("nranks")):
        return f"it has no number of ranks (nranks={info.get('nranks')!r:.80})", [], None
    nranks = info["nranks"] if nranks is None else nranks   # None: the number it records
    if info["nranks"] != nranks or nranks < 1:
        return f"it was written by {info['nranks']} ranks, this job has {nranks}", [], None
    newest = {"step": info.get("step"), "files": info.get("files")}
    entries = info.get("generations", [newest])   # version 1 markers name one generation
    if not isinstance(entries, list) or not entries:
        return f"its generations are not a non-empty list ({entries!r:.80})", [], None
    gens = []
    for g in entries:
        step = g.get("step") if isinstance(g, dict) else None
        gens.append([step if _is_int(step) else None, g.get("files") if isinstance(g, dict) else None,
                     _generation_problem(g, nranks)])
    if not gens[0][2] and entries[0] != newest:
        gens[0][2] = "its step and files disagree with its newest generation"
    return "", [tuple(g) for g in gens], info.get("version")


# ---------------------------------------------------------------------------- collective save and load
def _ranks(ranks, nranks):
    if len(ranks) == nranks > 1:
        return "every rank"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _join(problems):
    """One text for the ranks' problems (one entry per rank, "" for none): texts that name their
    rank as they are, any other cause once with the ranks that found it."""
    causes = {}
    for r, p in enumerate(problems):
        if p:
            causes.setdefault(p, []).append(r)
    return "; ".join(p if p.startswith("rank ") else f"{_ranks(rs, len(problems))}: {p}" for p, rs in causes.items())


def _differ(digests):
    """The text for shared parts that differ between ranks (``digests``: one per rank)."""
    groups = {}
    for r, g in enumerate(digests):
        groups.setdefault(g, []).append(r)
    return ("the state that must be identical on every rank differs between ranks: " + "; ".join(
        f"{_ranks(rs, len(digests))}: {'none' if g is None else 'sha256 ' + g[:16]}" for g, rs in groups.items()))


def save(comm, out, step, state, shared=None):
    """Write this rank's ``state`` for ``step`` (collective), then the marker (rank 0).

    ``shared``: a function of the state that returns the part every rank must hold bit for bit
    (or None); pass the same one to ``load_latest``. Refused with the same ``CheckpointError`` on
    every rank, before any file is written, when a rank's state holds something the format cannot
    hold or a non-finite value in a tensor or array, or when the shared parts differ between ranks.
    """
    rank, nranks = comm.Get_rank(), comm.Get_size()
    d = folder(out)
    problem, enc, digest = "", None, None
    try:
        enc = encode(state)
        digest = _shared_digest(state, shared)
        bad = _nonfinite(state)
        if bad is not None:
            problem = f"rank {rank}: a non-finite value in {bad}"
    except Exception as e:   # noqa: BLE001 - whatever ``shared`` raises, every rank must hear of it
        problem = f"rank {rank}: {type(e).__name__}: {e}"
    views = comm.allgather((problem, digest))
    problems = [p for p, _ in views if p]
    if problems:
        raise CheckpointError(f"writing step {step} refused: " + "; ".join(problems))
    if len({g for _, g in views}) > 1:
        raise CheckpointError(f"writing step {step} refused: " + _differ([g for _, g in views]))
    problem = ""
    try:
        os.makedirs(d, exist_ok=True)
        _write_encoded(os.path.join(d, _name(step, rank)), enc, rank, nranks, step, digest)
    except (OSError, TypeError) as e:
        problem = f"rank {rank}: {e}"
    problems = [p for p in comm.allgather(problem) if p]
    if problems:
        raise CheckpointError(f"writing step {step} failed: " + "; ".join(problems))
    problem = ""
    if rank == 0:
        files = [_name(step, r) for r in range(nranks)]
        gens = [{"step": step, "files": files}]
        try:
            _, old, version = _marker(d, nranks)
            if version == VERSION:   # older generations of an older format could never be resumed from
                gens += [{"step": s, "files": f} for s, f, p in old if not p and s != step][:KEEP - 1]
        except Exception:   # noqa: BLE001 - no usable marker yet: this generation is the only one
            pass
        body = json.dumps({"version": VERSION, "step": step, "nranks": nranks, "files": files,
                           "generations": gens}).encode()
        try:
            _atomic_write(os.path.join(d, MARKER), lambda f: f.write(body))
        except OSError as e:
            problem = f"rank 0 cannot write {MARKER}: {e}"
        else:
            keep = {f for g in gens for f in g["files"]}
            for stale in glob.glob(os.path.join(d, "step*.rank*.pt")):
                if os.path.basename(stale) not in keep:
                    try:
                        os.remove(stale)
                    except OSError:
                        pass   # left for the next save to remove; the marker does not name it
    # nobody goes on (or dies) believing in a checkpoint the marker does not name yet
    problem = comm.bcast(problem, root=0)
    if problem:
        raise CheckpointError(f"writing step {step} failed: {problem}")


def _try(d, step, name, rank, nranks, config, shared, ignore=(), whose="this job has"):
    """``(problem or "", state, shared digest, seal)`` for rank ``rank``'s file ``name`` of generation
    ``step`` of a run of ``nranks`` ranks; ``ignore``: configuration keys not compared."""
    path = os.path.join(d, name)
    if not os.path.exists(path):
        return f"rank {rank}'s file {path} is missing", None, None, None
    try:
        header, state, seal = _read_sealed(path)
        saved = state["config"]
        if not isinstance(saved, dict):
            raise TypeError(f"its config is a {type(saved).__name__}")
    except Exception as e:   # noqa: BLE001 - a corrupt file may raise anything; all ranks hear of it
        return f"rank {rank} cannot read {name} ({type(e).__name__}: {e})", None, None, None
    mine = f"rank {rank}'s file {name}"
    if header["rank"] != rank:
        return f"{mine} was written by rank {header['rank']}", None, None, None
    if header["nranks"] != nranks:
        return f"{mine} was written by a run of {header['nranks']} ranks, {whose} {nranks}", None, None, None
    if header["step"] != step:
        return f"{mine} holds step {header['step']}, not {step}", None, None, None
    diff = sorted(k for k in set(saved) | set(config) if k not in ignore and saved.get(k) != config.get(k))
    if diff:
        return "it was written with other settings: " + ", ".join(
            f"{k}={saved.get(k)!r} (now {config.get(k)!r})" for k in diff), None, None, None
    try:
        bad = _nonfinite(state)
        digest = _shared_digest(state, shared)
    except Exception as e:   # noqa: BLE001 - ``shared`` on a state it does not expect: all ranks hear of it
        return f"{mine} has no shared part to check ({type(e).__name__}: {e})", None, None, None
    if bad is not None:
        return f"{mine} holds a non-finite value in {bad}", None, None, None
    if digest != header["shared"]:
        return (f"{mine}: the part that must be identical on every rank is not the one it was written with "
                "(another shared= at save)"), None, None, None
    return "", state, digest, seal


def _agreed_marker(comm, d, nranks):
    """The generations of the marker in ``d`` that every rank reads alike (None: there is no marker);
    ``nranks``: the ranks its generations must name, or None for the number it records."""
    rank = comm.Get_rank()
    marker = os.path.join(d, MARKER)
    problem, gens = "", []
    exists = os.path.exists(marker)
    if exists:
        try:
            problem, gens, _ = _marker(d, nranks)
        except Exception as e:   # noqa: BLE001 - anything that stops one rank must reach every rank
            problem = f"rank {rank} cannot read {marker} ({e!r})"
    views = comm.allgather((exists, problem, [g[0] for g in gens]))
    if len({e for e, _, _ in views}) > 1:
        raise CheckpointError(f"ranks disagree on whether {marker} exists (is --out on a shared file system?)")
    if any(p for _, p, _ in views):
        raise CheckpointError(f"cannot resume from {d}: {MARKER}: " + _join([p for _, p, _ in views]))
    if not exists:
        return None
    if len({tuple(s) for _, _, s in views}) > 1:
        raise CheckpointError(f"ranks see different checkpoints in {d}: " + "; ".join(
            f"rank {r}: steps {s}" for r, (_, _, s) in enumerate(views)))
    return gens


def load_latest(comm, out, config, report=None, shared=None, ignore=()):
    """This rank's state from the last complete checkpoint in ``out`` that every rank can use, or
    None when there is none.

    ``config`` (a dict of what must match: ranks, runs, model, hyper-parameters) is compared with
    the one saved, but for the keys in ``ignore``. ``shared``: the function given to ``save``; the
    part it selects must be identical on every rank. The newest generation is tried first, then the
    previous one, every rank together. ``report``: a list that receives a line for every generation
    passed over. Any problem that leaves no usable generation raises the same ``CheckpointError``
    on every rank.
    """
    rank, nranks = comm.Get_rank(), comm.Get_size()
    d = folder(out)
    gens = _agreed_marker(comm, d, nranks)
    if gens is None:
        return None
    passed = []
    for i, (step, files, problem) in enumerate(gens):
        if problem:
            problem, state, digest = f"{MARKER}: {problem}", None, None
        else:
            problem, state, digest, _ = _try(d, step, files[rank], rank, nranks, config, shared, ignore)
        views = comm.allgather((problem, digest))
        problems = [p for p, _ in views]
        if not any(problems):
            digests = [g for _, g in views]
            if len(set(digests)) == 1:
                if report is not None:
                    report.extend(passed)
                return state
            text = _differ(digests)
        else:
            text = _join(problems)
        passed.append(f"step {step}: {text}" if step is not None else f"generation {i + 1}: {text}")
        if any(p and "other settings" in p for p in problems):
            break   # an older generation of the same run has the same settings
    raise CheckpointError(f"cannot resume from {d}: " + " | ".join(passed))


def _try_all(d, step, files, config, shared, ignore):
    """``(problem or "", states, digest of what was read)`` for every file of one generation."""
    states, digests, seals = [], [], []
    for r, name in enumerate(files):
        problem, state, digest, seal = _try(d, step, name, r, len(files), config, shared, ignore,
                                            whose="its marker names")
        if problem:
            return problem, None, None
        states.append(state)
        digests.append(digest)
        seals.append(seal)
    if len(set(digests)) > 1:
        return "its files: " + _differ(digests), None, None
    return "", states, _digest([digests[0], seals])


def load_all(comm, out, config, report=None, shared=None, ignore=()):
    """Every old rank's state from the last complete checkpoint in ``out`` that every rank can use,
    in the old ranks' order, whatever number of ranks wrote it; None when there is none.

    For a job that resumes at another number of ranks: every rank reads all ``P_old`` files of a
    generation and checks each as ``load_latest`` checks its own (readable, version 3, written by
    that old rank of a run of ``P_old`` ranks for that step, its digest, the configuration but for
    the keys in ``ignore``, finiteness, its shared part against the digest written with it); the
    shared parts must be equal across the files, and the ranks agree, with a digest of everything
    they read, that they read the same bits. A generation that fails on any rank is passed over by
    every rank together, as in ``load_latest`` (``report``: its lines).

    Args:
        comm: the job's communicator (any size).
        out: the job's output folder (checkpoints under ``folder(out)``).
        config, report, shared, ignore: as for ``load_latest``.

    Returns:
        A list of ``P_old`` states (index ``r``: old rank ``r``'s), or None without a marker.

    Raises:
        CheckpointError: the same on every rank, when no generation can be used.

    Example::

        states = load_all(comm, out, config, shared=shared_state, ignore=("ranks",))
        mine = None if states is None else states[comm.Get_rank() % len(states)]
    """
    d = folder(out)
    gens = _agreed_marker(comm, d, None)
    if gens is None:
        return None
    passed = []
    for i, (step, files, problem) in enumerate(gens):
        states, digest = None, None
        if problem:
            problem = f"{MARKER}: {problem}"
        else:
            problem, states, digest = _try_all(d, step, files, config, shared, ignore)
        views = comm.allgather((problem, digest))
        problems = [p for p, _ in views]
        if not any(problems):
            if len({g for _, g in views}) == 1:
                if report is not None:
                    report.extend(passed)
                return states
            text = "ranks read different files (is --out on a shared file system?)"
        else:
            text = _join(problems)
        passed.append(f"step {step}: {text}" if step is not None else f"generation {i + 1}: {text}")
        if any(p and "other settings" in p for p in problems):
            break
    raise CheckpointError(f"cannot resume from {d}: " + " | ".join(passed))
