"""Checkpoints for the jobs: one file per rank, written atomically, and a marker written last.

Layout under ``<out>/checkpoints/``::

    step00000040.rank0.pt  step00000040.rank1.pt  ...   one per rank (torch.save of that rank's dict)
    COMPLETE                                           JSON {"step": 40, "nranks": P, "files": [...]}

A rank writes ``<file>.tmp`` and renames it (atomic on POSIX), so a rank killed mid-write leaves no
half file under the real name. ``COMPLETE`` names a step only after every rank has reported its
file written (one small collective), so it always points at a checkpoint that exists on every
rank; older checkpoints are removed after the marker moves. ``load_latest`` checks everything
(marker, this rank's file, the run's configuration) on every rank and raises the same
``CheckpointError`` on all of them before any training step.
"""
import glob
import json
import os

import torch

MARKER = "COMPLETE"


class CheckpointError(Exception):
    """A checkpoint that cannot be written or resumed; raised with the same text on every rank."""


def folder(out):
    return os.path.join(out, "checkpoints")


def _name(step, rank):
    return f"step{step:08d}.rank{rank}.pt"


def _atomic_write(path, write):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(comm, out, step, state):
    """Write this rank's ``state`` for ``step`` (collective), then the marker (rank 0)."""
    rank, nranks = comm.Get_rank(), comm.Get_size()
    d = folder(out)
    os.makedirs(d, exist_ok=True)
    problem = ""
    try:
        _atomic_write(os.path.join(d, _name(step, rank)), lambda f: torch.save(state, f))
    except OSError as e:
        problem = f"rank {rank}: {e}"
    problems = [p for p in comm.allgather(problem) if p]
    if problems:
        raise CheckpointError(f"writing step {step} failed: " + "; ".join(problems))
    if rank == 0:
        files = [_name(step, r) for r in range(nranks)]
        body = json.dumps({"step": step, "nranks": nranks, "files": files}).encode()
        _atomic_write(os.path.join(d, MARKER), lambda f: f.write(body))
        for old in glob.glob(os.path.join(d, "step*.rank*.pt")):
            if os.path.basename(old) not in files:
                os.remove(old)
    comm.Barrier()   # nobody goes on (or dies) believing in a checkpoint the marker does not name yet


def load_latest(comm, out, config):
    """This rank's state from the last complete checkpoint in ``out``, or None when there is none.

    ``config`` (a dict of what must match: ranks, runs, model, hyper-parameters) is compared with
    the one saved. Any problem on any rank raises the same ``CheckpointError`` on every rank.
    """
    rank, nranks = comm.Get_rank(), comm.Get_size()
    d = folder(out)
    marker = os.path.join(d, MARKER)
    problem, state = "", None
    if not os.path.exists(marker):
        exists = False
    else:
        exists = True
        try:
            with open(marker) as f:
                info = json.load(f)
            if info["nranks"] != nranks:
                problem = f"it was written by {info['nranks']} ranks, this job has {nranks}"
            else:
                path = os.path.join(d, info["files"][rank])
                if not os.path.exists(path):
                    problem = f"rank {rank}'s file {path} is missing"
                else:
                    state = torch.load(path, weights_only=False)   # our own file: metrics, RNG, numpy
                    saved = state["config"]
                    diff = sorted(k for k in set(saved) | set(config) if saved.get(k) != config.get(k))
                    if diff:
                        problem = "it was written with other settings: " + ", ".join(
                            f"{k}={saved.get(k)!r} (now {config.get(k)!r})" for k in diff)
        except (OSError, ValueError, KeyError, IndexError, RuntimeError) as e:
            problem = f"rank {rank} cannot read it ({e!r})"
    views = comm.allgather((exists, problem))
    if len({e for e, _ in views}) > 1:
        raise CheckpointError(f"ranks disagree on whether {marker} exists (is --out on a shared file system?)")
    problems = sorted({p for _, p in views if p})
    if problems:
        raise CheckpointError(f"cannot resume from {d}: " + "; ".join(problems))
    return state
