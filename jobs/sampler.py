"""A global batch that does not depend on the number of ranks, for jobs/train.py's language model.

The global batch of step ``t`` is ``per_rank * start_ranks`` windows of the training text, drawn
from a generator seeded by ``(seed, t)`` only; ``start_ranks`` is the number of ranks the run
started with (recorded in the job's configuration), so the batch stays the same when the run goes
on at another number of ranks. Rank ``r`` of ``P`` takes windows ``r::P`` and scales its mean loss
by ``n_r * P / N`` (``n_r`` its windows, ``N`` the global batch): the mean over ranks of the ranks'
gradients, which the gradient exchange computes, is then the gradient of the mean loss over the
global batch, whatever ``P`` is. ``rebind(rank, P)`` moves a sampler to another rank and run size
between steps (a resume at another ``-n``, or survivors going on without a lost rank).

Example::

    from sampler import GlobalBatch
    gb = GlobalBatch(text, seq=64, per_rank=8, start_ranks=4, seed=0, rank=1, nranks=3)
    x, y, weight = gb.batch(step=0)
    (weight * models.text_loss(model, x, y)).backward()
"""
import torch


class GlobalBatch:
    """Windows ``rank::nranks`` of the rank-independent global batch of each step.

    Args:
        text: the training bytes, a 1-D int64 tensor.
        seq: the window length (inputs; each window holds ``seq + 1`` bytes).
        per_rank: windows per rank at the run's start.
        start_ranks: the ranks the run started with; the global batch is ``per_rank * start_ranks``.
        seed: the run's seed.
        rank, nranks: this rank and the run's size now.

    Raises:
        ValueError: a size below 1, a rank outside ``[0, nranks)`` or a text shorter than a window.
    """

    def __init__(self, text, *, seq, per_rank, start_ranks, seed, rank, nranks):
        if min(seq, per_rank, start_ranks) < 1:
            raise ValueError(f"seq, per_rank and start_ranks must be >= 1, got {seq}, {per_rank}, {start_ranks}")
        if text.numel() < seq + 2:
            raise ValueError(f"the text ({text.numel()} bytes) is shorter than one window of {seq + 1}")
        self.text, self.seq, self.seed = text, int(seq), int(seed)
        self.total = int(per_rank) * int(start_ranks)
        self.rank, self.nranks = 0, 1
        self.rebind(rank, nranks)

    def rebind(self, rank, nranks):
        """Take windows ``rank::nranks`` from the next step on.

        Args:
            rank, nranks: this rank and the run's size from now on.

        Raises:
            ValueError: ``nranks < 1`` or ``rank`` outside ``[0, nranks)``.
        """
        if nranks < 1 or not 0 <= rank < nranks:
            raise ValueError(f"rank {rank} of {nranks} ranks")
        self.rank, self.nranks = int(rank), int(nranks)

    def starts(self, step):
        """The start offsets of step ``step``'s whole global batch (``total`` of them), a function
        of ``(seed, step)`` only."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 7919 + 101)
        return torch.randint(0, self.text.numel() - self.seq - 1, (self.total,), generator=g)

    def indices(self):
        """Which windows of each step's global batch this rank takes (positions in ``starts``)."""
        return range(self.rank, self.total, self.nranks)

    def weight(self):
        """The factor on this rank's mean loss: ``n_r * P / N``."""
        return len(self.indices()) * self.nranks / self.total

    def batch(self, step):
        """``(x, y, weight)``: this rank's windows of step ``step`` as ``(n_r, seq)`` int64 inputs and
        next-byte targets, and the factor on their mean loss (``n_r`` may be 0 when ``P > N``)."""
        starts = self.starts(step)[self.rank::self.nranks]
        w = self.text[starts[:, None] + torch.arange(self.seq + 1)]
        return w[:, :-1], w[:, 1:], self.weight()
