"""What jobs/train.py trains, per ``--model``: the model, each step's batch, the loss and the evaluation.

- ``ImageWork`` (``cnn``, ``big``): ``models.build``'s model and this rank's shard (rank r of P takes
  every P-th example of a seeded permutation), shuffled per epoch; cross-entropy; test accuracy and
  loss. Exactly the data and bits these models always had.
- ``TextWork`` (``lm``): the GPT-style byte-level transformer (``models.GPT``) on the Python standard
  library's source, split by file (``models.stdlib_corpus``); each step's global batch is a
  ``sampler.GlobalBatch`` of ``batch_size * start_ranks`` windows, the same at any number of ranks;
  the validation loss in nats per byte.

Both have ``steps_per_epoch``, ``batches(epoch, skip)`` (``(in-epoch step, x, y, weight)`` from step
``skip`` on; ``weight`` scales the mean loss, None for none), ``loss``, ``evaluate`` (collective) and
``rebind(rank, nranks)`` (the same run at another number of ranks from the next epoch or step).

Example::

    work = WORKS[args.model](args, comm, start_ranks=comm.Get_size())
    for s, x, y, w in work.batches(epoch=0, skip=0):
        work.loss(work.model, x, y, w).backward()
"""
import torch
from mpi4py import MPI

import models
from sampler import GlobalBatch

LM_STEPS_PER_EPOCH = 100   # an lm "epoch" without --max-steps: steps between evaluations


class ImageWork:
    """``--model cnn`` or ``big``: a classifier on this rank's shard."""

    metric = ("test_acc", "test acc")   # the evaluation's headline (key, label)

    def __init__(self, args, comm, start_ranks):
        self.args, self.comm, self.rank = args, comm, comm.Get_rank()
        self.model, self.data = models.build(args.model, args.width, args.seed, self.rank, comm.Get_size())
        self._count_steps()

    def _count_steps(self):
        shard = self.comm.allreduce(self.data.x_train.shape[0], op=MPI.MIN)
        steps = max(1, shard // self.args.batch_size)
        self.steps_per_epoch = min(steps, self.args.max_steps) if self.args.max_steps else steps

    def rebind(self, rank, nranks, comm=None):
        """This rank's shard of a run of ``nranks`` ranks (collective over ``comm``); the epoch's
        order from here on is that shard's, not the one the old shard would have given."""
        self.comm, self.rank = comm or self.comm, rank
        _, make = models.MODELS[self.args.model]
        self.data = make(self.args.seed, rank, nranks)
        self._count_steps()

    def batches(self, epoch, skip=0):
        a = self.args
        for s, (x, y) in enumerate(self.data.batches(epoch, a.batch_size, self.steps_per_epoch, a.seed, self.rank)):
            if s >= skip:   # resumed: the steps before ``skip`` were trained on before the checkpoint
                yield s, x, y, None

    def loss(self, model, x, y, weight):
        return torch.nn.functional.cross_entropy(model(x), y)

    def evaluate(self, model, comm):
        acc, loss = models.evaluate(model, self.data, comm)
        return {"test_acc": acc, "test_loss": loss}


class TextWork:
    """``--model lm``: the byte-level GPT on a rank-independent global batch."""

    metric = ("val_loss", "val loss")

    def __init__(self, args, comm, start_ranks):
        self.args = args
        torch.manual_seed(args.seed)
        self.model = models.GPT(d_model=args.d_model, layers=args.layers, heads=args.heads, context=args.context)
        train, val = models.stdlib_corpus()
        self.data = models.TextData(train, val, seq=args.context, val_windows=64, val_seq=args.context)
        self.corpus = models.corpus_id(train, val)
        self.sampler = GlobalBatch(self.data.train, seq=args.context, per_rank=args.batch_size,
                                   start_ranks=start_ranks, seed=args.seed, rank=comm.Get_rank(),
                                   nranks=comm.Get_size())
        self.steps_per_epoch = args.max_steps or LM_STEPS_PER_EPOCH

    def rebind(self, rank, nranks, comm=None):
        """Take windows ``rank::nranks`` of each global batch from the next step on."""
        self.sampler.rebind(rank, nranks)

    def batches(self, epoch, skip=0):
        for s in range(skip, self.steps_per_epoch):
            x, y, w = self.sampler.batch(epoch * self.steps_per_epoch + s)
            yield s, x, y, w

    def loss(self, model, x, y, weight):
        """This rank's mean loss times ``weight`` (``n_r * P / N``): the ranks' mean is the global
        batch's mean loss, and so is the mean of their gradients. No windows: a zero, no graph."""
        if x.shape[0] == 0:
            return torch.zeros(())
        return models.text_loss(model, x, y) * weight

    def evaluate(self, model, comm):
        return {"val_loss": models.text_val_loss(model, self.data, comm)}


WORKS = {"cnn": ImageWork, "big": ImageWork, "lm": TextWork}
