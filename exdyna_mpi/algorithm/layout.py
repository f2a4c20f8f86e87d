"""Algorithm layer: the block layout of ExDyna and its rotation and rebalancing.

Pure host logic on small integer lists. Every rank runs it on the same inputs (the gathered
counts), so every rank computes the same bounds with no communication. Faithful to the authors'
code (kljp/exdyna, cnn-lstm/gradient_reducers.py) except where their code crashes (P = 1, a zero mean count).
"""
import enum
from typing import Any, NamedTuple

import numpy as np


class Balance(enum.Enum):
    """How ExDyna's partition boundaries move after a step (``ExDyna(balance=...)``).

    ``ExDyna`` accepts a member or today's spellings, normalised by ``Balance.of``: ``True``
    (``AUTO``), ``False`` (``OFF``) and the names ``"faithful"``, ``"adaptive"``, ``"blocks"``.
    ``AUTO`` is resolved once, at construction, to the controller's ``balance_rule``
    (``resolve``); the rule then moves the boundaries every step (``rebalance``):

    - ``OFF``: the boundaries stay.
    - ``FAITHFUL``: the authors' one-block neighbour moves from the gathered counts
      (``BlockLayout.rebalance_faithful``).
    - ``ADAPTIVE``: moves sized by the imbalance (``rebalance_adaptive``).
    - ``BLOCKS``: boundaries set from exact per-block counts of the step's union
      (``rebalance_blocks``, given ``BlockLoad``); the measured controller's rule.
    """
    AUTO = "auto"
    OFF = "off"
    FAITHFUL = "faithful"
    ADAPTIVE = "adaptive"
    BLOCKS = "blocks"

    @classmethod
    def of(cls, value: "Balance | bool | str", rule: "Balance | None" = None) -> "Balance":
        """``value`` as a member: a member as is, ``True`` as ``AUTO``, ``False`` as ``OFF``, a name
        of ``FAITHFUL``, ``ADAPTIVE`` or ``BLOCKS`` as that member; ``AUTO`` resolved to ``rule``
        when one is given. Raises ``ValueError`` ("must be ...", an ``Option`` check's text) for
        anything else."""
        if isinstance(value, (bool, np.bool_)):
            value = bool(value)
        member = value if isinstance(value, cls) else (
            _SPELLINGS.get(value) if isinstance(value, (bool, str)) else None)
        if member is None:
            raise ValueError("must be True, False, " + ", ".join(repr(n) for n in _NAMES))
        return member.resolve(rule) if rule is not None else member

    def resolve(self, rule: "Balance") -> "Balance":
        """The rule this member means with a controller whose ``balance_rule`` is ``rule``."""
        return rule if self is Balance.AUTO else self

    @property
    def needs_load(self) -> bool:
        """The rule moves from the step's per-block load (a ``BlockLoad``, counted before the
        average from the union), not from the gathered counts alone."""
        return self is Balance.BLOCKS

    def rebalance(self, layout, counts, t, load: "BlockLoad | None" = None) -> None:
        """Move ``layout``'s boundaries for step ``t`` after step ``t - 1``, whose gathered counts
        are ``counts`` (``BLOCKS``: whose per-block ``load``; None: nothing to move)."""
        _MOVES[self](layout, counts, t, load)


class BlockLoad(NamedTuple):
    """A step's selections per block (``BlockLayout.block_counts``) and the per-partition ``scale``
    ``(num, den)`` that weighs them (``rebalance_blocks``; None: as counted)."""

    counts: Any
    scale: Any = None


#: the names ``Balance.of`` accepts, besides True and False
_NAMES = ("faithful", "adaptive", "blocks")


#: ``Balance.of``'s table of the spellings ``ExDyna(balance=...)`` accepts
_SPELLINGS: dict[bool | str, Balance] = {True: Balance.AUTO, False: Balance.OFF, **{n: Balance(n) for n in _NAMES}}

#: what each rule does to the layout at the end of a step
_MOVES = {
    Balance.AUTO: lambda layout, counts, t, load: None,   # resolved at construction, never stepped
    Balance.OFF: lambda layout, counts, t, load: None,
    Balance.FAITHFUL: lambda layout, counts, t, load: layout.rebalance_faithful(counts, t),
    Balance.ADAPTIVE: lambda layout, counts, t, load: layout.rebalance_adaptive(counts, t),
    Balance.BLOCKS: lambda layout, counts, t, load: (
        None if load is None else layout.rebalance_blocks(None, t, counts=load.counts, scale=load.scale)),
}


def block_size(numel, n_blocks, block_align):
    """Block size and block count for ``numel`` elements.

    The authors' rule: ``a = numel // n_blocks`` rounded down to a multiple of ``block_align``. When
    that is 0 (a small vector) the blocks shrink to ``block_align`` elements, then to 1, so that a
    small vector still has blocks to move; the remainder always goes to the last partition.
    """
    a = numel // n_blocks
    size = a - a % block_align
    if size > 0:
        return size, n_blocks
    for size in (block_align, 1):
        if numel // size >= 1:
            return size, numel // size
    raise ValueError("numel must be positive")


def initial_blocks(n_blocks, nparts):
    q, r = divmod(n_blocks, nparts)
    return [q + 1 if p < r else q for p in range(nparts)]


def partition_of(rank, t, nparts):
    """Partition owned by ``rank`` at step ``t``: ``(t mod P + rank) mod P``."""
    return (t % nparts + rank) % nparts


def owners(t, nparts):
    """``owned[r]``: the partition rank r owns at step t."""
    return [(t % nparts + r) % nparts for r in range(nparts)]


class BlockLayout:
    """Partitions as runs of whole blocks; the remainder of ``numel`` sits in the last one."""

    def __init__(self, numel, nparts, n_blocks=1024, block_align=32):
        self.numel = numel
        self.nparts = nparts
        self.sz_blk, self.n_blocks = block_size(numel, n_blocks, block_align)
        self.rem = numel - self.sz_blk * self.n_blocks
        self.min_blk = self.n_blocks / (4 * nparts)
        self.blk_part = initial_blocks(self.n_blocks, nparts)
        self._bounds_key, self._bounds_val = None, None   # _bounds' last answer

    def bounds(self):
        """Element offsets of partitions 0..P-1 (length P+1; a copy the caller may keep)."""
        return self._bounds().copy()

    def _bounds(self):
        # the offsets of the current blk_part, remade only when it changed (the rebalancing rules
        # assign or edit it in place: the key is its contents)
        key = tuple(self.blk_part)
        if key != self._bounds_key:
            b = np.zeros(self.nparts + 1, dtype=np.int64)
            np.cumsum(key, out=b[1:])
            b *= self.sz_blk
            b[-1] += self.rem
            self._bounds_key, self._bounds_val = key, b
        return self._bounds_val

    def range_of(self, p):
        b = self._bounds()
        return int(b[p]), int(b[p + 1])

    def rebalance_faithful(self, counts_prev, t):
        """The authors' one-block neighbour move (§3), given last step's per-rank counts.

        ``counts_prev[r]`` was selected by rank r at step ``t - 1``, in partition
        ``partition_of(r, t - 1)``. One left-to-right sweep; each boundary moves at most one block.
        """
        n = self.nparts
        k_prev = int(sum(counts_prev))
        mean = k_prev // n
        if n < 2 or mean == 0:
            return
        load = [0] * n
        for r in range(n):
            load[partition_of(r, t - 1, n)] = int(counts_prev[r])
        dens = k_prev / self.numel
        m = int(self.sz_blk * dens)
        hi, lo = 1.05, 1 / 1.05
        part = self.blk_part
        for i in range(n - 1):
            a = load[i] / mean
            b = load[i + 1] / mean
            if a > hi and b < lo:
                if part[i] - 1 < self.min_blk:
                    continue
                part[i] -= 1
                part[i + 1] += 1
                load[i] -= m
                load[i + 1] += m
            if a < lo and b > hi:
                if part[i + 1] - 1 < self.min_blk:
                    continue
                part[i] += 1
                part[i + 1] -= 1
                load[i] += m
                load[i + 1] -= m

    # ------------------------------------------------------------------ adaptive rebalancing
    #: per-block load estimates are fixed-point integers (1/2**FIX of a count) so that every rank
    #: computes the same bits; the estimate moves 1/2**EMA_SHIFT of the way to each observation.
    FIX, EMA_SHIFT = 20, 3

    def min_blocks_adaptive(self):
        """Smallest partition the adaptive rule makes: 1/16 of the mean, at least one block."""
        return max(1, self.n_blocks // (16 * self.nparts))

    def rebalance_adaptive(self, counts_prev, t):
        """Move every boundary as far as needed to equalise the predicted load (integer logic).

        Last step's count of each partition is spread evenly over its blocks and folded into a
        per-block moving estimate; the new boundaries cut the cumulative estimate into P equal
        shares, each partition keeping at least ``min_blocks_adaptive()`` blocks. Unlike the
        one-block neighbour rule this passes load across any number of overloaded partitions.
        """
        n = self.nparts
        if n < 2:
            return
        load = np.zeros(n, dtype=np.int64)
        for r in range(n):
            load[partition_of(r, t - 1, n)] = int(counts_prev[r])
        part = np.asarray(self.blk_part, dtype=np.int64)
        obs = np.repeat((load << self.FIX) // np.maximum(part, 1), part)
        self._cut(obs, self.EMA_SHIFT)

    #: ``rebalance_blocks``: the per-block estimate moves 1/2**BLOCKS_EMA_SHIFT of the way per step
    BLOCKS_EMA_SHIFT = 2
    #: ``rebalance_blocks`` moves boundaries only with at least this many blocks per partition
    MIN_BLOCKS_PER_PART = 8

    def block_counts(self, union, xp=np):
        """Selections per block from the step's union of element indices (the remainder of
        ``numel`` counts in the last block, as it sits in the last partition), computed where
        ``union`` lives (``xp``: NumPy or CuPy; a device union stays there, only the counts move)."""
        b = union.astype(xp.int64) // self.sz_blk
        xp.minimum(b, self.n_blocks - 1, out=b)
        return xp.bincount(b, minlength=self.n_blocks)

    def moves_blocks(self):
        """Whether ``rebalance_blocks`` moves anything (enough partitions and blocks)."""
        return self.nparts >= 2 and self.n_blocks >= self.MIN_BLOCKS_PER_PART * self.nparts

    def rebalance_blocks(self, union, t, counts=None, scale=None):
        """Boundaries for step ``t`` from the exact per-block counts of step ``t - 1``.

        ``union``: the indices every rank selected at step ``t - 1`` (gathered anyway, identical on
        every rank: no extra words), or ``counts``: ``block_counts(union)`` already made. Where the
        selection sits inside a partition is known to the block, so on streams whose load stays put
        from one step to the next (real gradients: layers) one cut equalises it; a short moving
        average (``BLOCKS_EMA_SHIFT``) damps the count noise of a stationary stream. Same cut and
        limits as ``rebalance_adaptive``.

        ``scale`` (optional, per partition of step ``t - 1``): ``(num, den)`` integer arrays; partition
        ``p``'s block counts weigh ``num[p] / den[p]`` (``den[p] > 0``). Per-rank quotas make every
        partition's count the same by construction; scaling each back to the count its owner had at
        the threshold keeps the boundaries following where the load is, not where the quotas put it.
        """
        if not self.moves_blocks():
            return   # a few blocks per partition: a cut moves whole shares of the load; keep the layout
        if counts is None:
            counts = self.block_counts(np.asarray(union))
        obs = np.asarray(counts, dtype=np.int64) << self.FIX
        if scale is not None:
            num, den = (np.repeat(np.asarray(x, dtype=np.int64), self.blk_part) for x in scale)
            obs = (obs // den) * num + ((obs % den) * num) // den   # exact, no int64 overflow below 2**63 / N
        self._cut(obs, self.BLOCKS_EMA_SHIFT)

    def _cut(self, obs, ema_shift):
        """Fold ``obs`` (fixed-point load per block) into the moving estimate and cut it into P
        equal shares, each partition keeping at least ``min_blocks_adaptive()`` blocks."""
        n = self.nparts
        w = getattr(self, "_blk_load", None)
        w = obs if w is None else w + ((obs - w) >> ema_shift)
        self._blk_load = w
        total = int(w.sum())
        if total == 0:
            return
        cum = np.cumsum(w)
        targets = (np.arange(1, n, dtype=np.int64) * total) // n
        cuts = np.searchsorted(cum, targets, side="left").astype(np.int64) + 1
        m = self.min_blocks_adaptive()
        nb = self.n_blocks
        # clamp so that each partition keeps >= m blocks: forward for the lower limit, backward for the upper
        prev = 0
        for j in range(n - 1):
            cuts[j] = max(int(cuts[j]), prev + m)
            prev = int(cuts[j])
        nxt = nb
        for j in range(n - 2, -1, -1):
            cuts[j] = min(int(cuts[j]), nxt - m)
            nxt = int(cuts[j])
        self.blk_part = [int(x) for x in np.diff(np.concatenate(([0], cuts, [nb])))]

    def state(self):
        d = {"blk_part": list(self.blk_part)}
        if getattr(self, "_blk_load", None) is not None:
            d["blk_load"] = [int(x) for x in self._blk_load]
        return d

    def check_state(self, d):
        """Raise ``ValueError`` (or ``KeyError``/``TypeError``) if ``load_state(d)`` would not fit."""
        part = [int(x) for x in d["blk_part"]]
        if len(part) != self.nparts or sum(part) != self.n_blocks or min(part) < 0:
            raise ValueError(f"layout blk_part {part[:8]}{'...' if len(part) > 8 else ''} does not fit "
                             f"{self.nparts} partitions of {self.n_blocks} blocks")
        w = d.get("blk_load")
        if w is not None and np.asarray(w).shape != (self.n_blocks,):
            raise ValueError(f"layout blk_load has {np.asarray(w).size} entries, the layout {self.n_blocks} blocks")

    def load_state(self, d):
        self.check_state(d)
        self.blk_part = [int(x) for x in d["blk_part"]]
        w = d.get("blk_load")
        self._blk_load = None if w is None else np.asarray(w, dtype=np.int64)


class EqualLayout:
    """MiCRO's layout: P fixed element ranges, the first ``numel % P`` one element longer."""

    def __init__(self, numel, nparts):
        self.numel = numel
        self.nparts = nparts
        q, r = divmod(numel, nparts)
        sizes = [q + 1 if p < r else q for p in range(nparts)]
        self._bounds = np.zeros(nparts + 1, dtype=np.int64)
        np.cumsum(sizes, out=self._bounds[1:])

    def bounds(self):
        return self._bounds.copy()

    def range_of(self, p):
        return int(self._bounds[p]), int(self._bounds[p + 1])

    def rebalance_faithful(self, counts_prev, t):
        pass

    def state(self):
        return {}

    def check_state(self, d):
        pass

    def load_state(self, d):
        pass
