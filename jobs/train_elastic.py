"""``jobs/train.py --elastic``: a run that loses ranks goes on with the survivors (Open MPI with ULFM).

The run's optimizer is a ``DistributedOptimizer(elastic=True)``: a failure inside its step recovers
there (revoke, shrink, the most advanced survivor's state on every survivor, partitions for the
ranks left) and raises ``RanksLost``. A failure in one of the job's own collectives (the step's
metrics, the evaluation, a checkpoint write) is turned into the same recovery by ``guard``. Either
way every survivor then calls ``go_on``, which brings them all to one point of the run:

1. the job's records become the longest survivor's (every rank logs the same records in the same
   order, so each survivor's are a prefix of it); the last step that the most advanced survivor
   completed but nobody recorded gets a record of the survivors' mean, marked ``"survivors"``;
2. the run's position follows from the records: the epoch of the last step and the steps done in
   it (the next epoch when that epoch's evaluation is recorded);
3. the workload takes the lost ranks' data (``rebind``: the lm's global batch is the same at any
   number of ranks), a ``ranks_lost`` record is logged, and rank 0 rewrites metrics.jsonl;
4. a checkpoint due at that step is written again, by the survivors (a generation of P - 1 files).

A failure in ``go_on`` itself, in the construction of a later run's optimizer or after the last
step ends the job, as any error on one rank does (``python -m mpi4py``).

Example::

    try:
        rec, stop = run.step(epoch, x, y, weight)
    except exdyna_mpi.RanksLost as lost:
        epoch, done = go_on(run, lost)
"""
import json
import os
import sys

import numpy as np
from mpi4py import MPI

# the job's own collectives recover as the entry points do: it asks the MPI whether it can shrink
# and whether an error is a lost rank, which only the transport layer knows
from exdyna_mpi.transport.ulfm import LAUNCH, fault_tolerance_problem, is_rank_failure


def problem(args, averaging):
    """This rank's problem with ``--elastic`` (None: none); ``averaging``: the job's runs that
    average models (wagma, local). Not collective."""
    if averaging:
        return f"--elastic goes with sparse gradient exchange only ({', '.join(averaging)} average models)"
    if args.deadline_ms is not None:
        return "--elastic does not run with --deadline-ms (its late messages are not recovered)"
    found = fault_tolerance_problem()
    if found is not None:
        return f"{found}; launch as {LAUNCH}"
    return None


def guard(run, fn, *a, **k):
    """``fn(*a, **k)``, one of the job's collectives over ``run.comm``; a lost rank reported by it
    recovers the run's optimizer (collective over the survivors) and raises its ``RanksLost``."""
    if not run.args.elastic:
        return fn(*a, **k)
    try:
        return fn(*a, **k)
    except Exception as e:   # noqa: BLE001 - only MPI's report of a lost rank is recovered
        if not is_rank_failure(e, run.comm):
            raise
        raise run.opt.recover() from None


def _survivor_record(run, lost, comm):
    """The record of the step the most advanced survivor completed and nobody logged: the mean over
    the survivors of what each saw (the dead ranks' share of the loss is not in it)."""
    local = np.array(run.pending, dtype=np.float64)
    mean = np.empty_like(local)
    comm.Allreduce(local, mean, op=MPI.SUM)
    mean /= comm.Get_size()
    # the density and imbalance of a survivor whose exchange completed (the most advanced one's at least)
    shape = next(s for s in comm.allgather(run.pending_shape) if s is not None)
    # the step ran at the old number of ranks
    return run.step_record(run.pending_epoch, mean, shape, ranks=comm.Get_size() + len(lost.lost), survivors=True)


def go_on(run, lost):
    """Bring every survivor to the same point of ``run`` after ``lost`` (a ``RanksLost``) and
    return ``(epoch, steps done in it)`` to go on from. Collective over the survivors."""
    job, comm = run.job, lost.comm
    run.comm = job.comm = comm
    rank, nranks = comm.Get_rank(), comm.Get_size()
    sizes = comm.allgather(len(job.records))
    longest = sizes.index(max(sizes))
    tail = comm.bcast(job.records[min(sizes):] if rank == longest else None, root=longest)
    job.records = job.records[:min(sizes)] + tail
    mine = [r for r in job.records if r.get("run") == run.label]
    steps = [r for r in mine if r["kind"] == "step"]
    completed = run.first_step + lost.step   # the run's steps the most advanced survivor completed
    run.steps = steps
    if len(steps) + 1 == completed:
        steps.append(_survivor_record(run, lost, comm))
        job.records.append(steps[-1])
    elif len(steps) != completed:
        raise RuntimeError(f"--elastic: {len(steps)} steps recorded, {completed} completed")
    run.epochs = [r for r in mine if r["kind"] == "epoch"]
    job.step = sum(r["kind"] == "step" for r in job.records)
    run.work.rebind(rank, nranks, comm)
    run.count_dense_bytes(nranks)
    job.records.append({"kind": "ranks_lost", "job_step": job.step, "run": run.label, "step": completed,
                        "lost": list(lost.lost), "from_ranks": nranks + len(lost.lost), "to_ranks": nranks,
                        "seconds": lost.seconds})
    if rank == 0:   # the old rank 0 may be the one lost: the new one writes the whole log
        if job.log_file is not None:
            job.log_file.close()
        os.makedirs(run.args.out, exist_ok=True)
        job.log_file = open(os.path.join(run.args.out, "metrics.jsonl"), "w")
        for rec in job.records:
            job.log_file.write(json.dumps(rec, default=str) + "\n")
        job.log_file.flush()
        print(f"[{run.label}] rank(s) {list(lost.lost)} lost at job step {job.step}: {nranks} ranks go on "
              f"(recovered in {lost.seconds:.3f} s)", flush=True)
    if not steps:
        return run.first_epoch, run.first_skip
    epoch = steps[-1]["epoch"]
    done = sum(r["epoch"] == epoch for r in steps)
    every = run.args.checkpoint_every
    # a checkpoint due now that some survivor did not finish writing: all write it again (the
    # decision is the same on every rank)
    if every and job.step % every == 0 and any(s != job.step for s in comm.allgather(run.saved_at)):
        run.save_at(epoch, done)
    return (epoch + 1, 0) if any(e["epoch"] == epoch for e in run.epochs) else (epoch, done)


def leave(comm, status):
    """End a survivor's process once every survivor is done (a barrier on the survivors' ``comm``),
    without ``MPI_Finalize``: after a lost rank, Open MPI's finalize can wait for ever on the dead
    one (seen about once in five runs of the 4-rank LM with ULFM over TCP); every file is closed
    and every output flushed first."""
    comm.Barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
