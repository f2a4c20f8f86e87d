"""ExDyna and MiCRO: exclusive partitions, one owner per partition per step, a global threshold."""
import math
import time

import numpy as np

from ._arrays import threshold_for
from . import _controller_ops as _ctl_ops
from ._base import Sparsifier, Stats
from ._controllers import CONTROLLERS, make_controller
from ._errors import InputCode
from ._layout import BlockLayout, EqualLayout, owners, partition_of


def _positive_int(v):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v <= 0:
        return "must be a positive integer"
    return None


def _is_bool(v):
    return None if isinstance(v, (bool, np.bool_)) else "must be True or False"


def _balance(v):
    ok = isinstance(v, (bool, np.bool_)) or v in ("faithful", "adaptive")
    return None if ok else "must be True, False, 'faithful' or 'adaptive'"


def _controller_name(v):
    return None if v in CONTROLLERS else f"must be one of {sorted(CONTROLLERS)}"


class ExDyna(Sparsifier):
    """ExDyna sparsification with exact ``Allgatherv`` exchange.

    One step on rank r: ``acc = residual + grad``; select ``|acc| >= threshold`` inside the
    partition rank r owns this step; all-gather the selected indices (disjoint across ranks); sum
    every rank's ``acc`` at the union; ``out`` is that sum / P at the union and 0 elsewhere;
    ``residual = acc`` with the union zeroed. Then the partition boundaries move (``balance``) and
    the controller sets the next threshold, from the gathered counts, identically on every rank.

    Example::

        >>> sp = exdyna_mpi.ExDyna(numel, density=0.001)        # collective over COMM_WORLD
        >>> avg = sp.step(flat_grad)                           # same kind and device as flat_grad
        >>> sp.stats.density, sp.stats.counts
    """

    name = "exdyna"
    OPTIONS = {
        "controller": ("histogram", _controller_name),
        "balance": (True, _balance),
        "n_blocks": (1024, _positive_int),
        "block_align": (32, _positive_int),
    }

    def __init__(self, numel, density, comm=None, *, controller="histogram", balance=True,
                 n_blocks=1024, block_align=32, device="auto", nonfinite="raise", **unknown):
        super().__init__(numel, density, comm, device=device, nonfinite=nonfinite, controller=controller,
                         balance=balance, n_blocks=n_blocks, block_align=block_align, **unknown)
        self.layout = self._make_layout()
        self.controller = make_controller(self.options["controller"], self.numel, self.density)
        self._index_dtype = np.dtype(np.int32) if self.numel < 2**31 else np.dtype(np.int64)
        self._idx = None

    def _make_layout(self):
        o = self.options
        return BlockLayout(self.numel, self.nranks, o["n_blocks"], o["block_align"])

    @property
    def threshold(self):
        """The threshold the next step will use."""
        return self.controller.threshold

    def _forecast_range(self, t):
        """The element range this rank will own at step ``t + 1`` (with today's bounds)."""
        return self.layout.range_of(partition_of(self.rank, t + 1, self.nranks))

    def _idx_buffer(self, n):
        if self._idx is None or self._idx.shape[0] < n:
            self._idx = self._ops.empty(max(n, 1), self._index_dtype)
        return self._idx

    def _step(self, inp, err, out):
        sec = {}
        t = self.iteration
        part = partition_of(self.rank, t, self.nranks)
        lo, hi = self.layout.range_of(part)
        thr = self.controller.threshold
        count, acc = 0, None
        spec = fspec = hist = None
        if hasattr(self.controller, "hist_spec"):
            dt = self._dtype if self._dtype is not None else (inp.array.dtype if err is None else np.float32)
            spec = self.controller.hist_spec(dt, t)
            fspec = self.controller.fine_spec(dt, t)
            hist = np.zeros(spec[0] + (fspec[0] if fspec else 0), dtype=np.int64)
        if err is None:
            self._bind(inp)
            ops = self._ops
            acc = self._acc_buffer()
            idx = self._idx_buffer(hi - lo)
            t0 = time.perf_counter()
            if spec is None:
                count, bad = ops.accumulate_select(self._residual, inp.array, acc, lo, hi,
                                                   threshold_for(thr, self._dtype), idx)
            else:   # histogram controller: the same pass also histograms |acc| in [lo, hi)
                count, bad = _ctl_ops.accumulate_select_hist(
                    ops, self._residual, inp.array, acc, lo, hi,
                    threshold_for(thr if t else math.inf, self._dtype), idx, spec[1], spec[2], hist[: spec[0]],
                    predict=t > 0, fine=(fspec[1], fspec[2], hist[spec[0]:]) if fspec else None,
                    forecast=self._forecast_range(t) if t > 0 else None,
                    stride=self.controller.COARSE_STRIDE if t > 0 else 1)
            sec["select"] = time.perf_counter() - t0
            if bad:
                err = (InputCode.NONFINITE, bad)
        t0 = time.perf_counter()
        words = self._words(count if err is None else 0, err)
        if spec is not None:   # the histogram rides in the first collective (zeros on a refusing rank)
            words = words + (hist.tolist() if err is None else [0] * hist.shape[0])
        words = self.xch.agree(words)
        sec["counts"] = time.perf_counter() - t0
        if self._verdict(words, err, acc):
            return self._skip(inp, out)

        if spec is not None and t == 0:   # step 0: refine the first threshold, then select (§ docs/controller.md)
            thr, count, spec, fspec, hist = _ctl_ops.first_step(self, inp.array, acc, lo, hi, words[:, 4:], sec)
            words = self.xch.agree([count, 0, 0, 0] + hist.tolist())
        counts = words[:, 0].copy()
        t0 = time.perf_counter()
        union = self.xch.allgatherv(self._idx[:count], counts)
        sec["indices"] = time.perf_counter() - t0
        res = self._average_at(acc, union, out, sec)

        selected = int(counts.sum())
        self.stats = Stats(
            iteration=t, counts=counts, selected=selected, density=selected / self.numel,
            threshold=thr, bounds=self.layout.bounds(), owned=np.array(owners(t, self.nranks)),
            bytes_sent=self.xch.bytes_sent, bytes_received=self.xch.bytes_received,
            seconds=sec, skipped=False, imbalance=_imbalance(counts),
        )
        if spec is None:
            self.controller.update(counts)
        else:
            nb = 4 + spec[0]
            self.controller.update(counts, words[:, 4:nb], self._dtype, spec, words[:, nb:], fspec)
        bal = self.options.get("balance", False)
        if bal is True:   # True: the controller's own partner rule; the authors' for theirs
            bal = "adaptive" if spec is not None else "faithful"
        if bal == "faithful":
            self.layout.rebalance_faithful(counts, t + 1)
        elif bal == "adaptive":
            self.layout.rebalance_adaptive(counts, t + 1)
        self.iteration = t + 1
        return inp.wrap(res)

    def _extra_state(self):
        return {"controller_state": self.controller.state(), "layout": self.layout.state()}

    def _load_extra_state(self, d):
        self.controller.load_state(d["controller_state"])
        self.layout.load_state(d["layout"])


def _imbalance(counts):
    """max count x P / total - 1: 0 when every rank selected the same number."""
    total = int(np.sum(counts))
    if total == 0:
        return 0.0
    return float(np.max(counts)) * len(counts) / total - 1.0


class MiCRO(ExDyna):
    """MiCRO: ExDyna without blocks or rebalancing (P fixed, equal element partitions)."""

    name = "micro"
    OPTIONS = {"controller": ("faithful", _controller_name)}

    def __init__(self, numel, density, comm=None, *, controller="faithful", device="auto",
                 nonfinite="raise", **unknown):
        Sparsifier.__init__(self, numel, density, comm, device=device, nonfinite=nonfinite,
                            controller=controller, **unknown)
        self.layout = self._make_layout()
        self.controller = make_controller(self.options["controller"], self.numel, self.density)
        self._index_dtype = np.dtype(np.int32) if self.numel < 2**31 else np.dtype(np.int64)
        self._idx = None

    def _make_layout(self):
        return EqualLayout(self.numel, self.nranks)
