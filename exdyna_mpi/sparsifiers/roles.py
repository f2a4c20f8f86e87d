"""Sparsifier layer: the small role objects the step template (``base.Sparsifier.step``) composes.

A sparsifier is four roles around one template, after GRACE's compressor / memory / communicator
split and the state object of PyTorch's PowerSGD hook:

- **memory** (``ErrorFeedback``): the residual and one spare buffer. ``take()`` a buffer for
  ``acc``; after a good step ``commit(acc, out)`` makes ``acc`` the residual and hands back the
  output buffer; a refused or skipped step ``keep``s ``acc`` for reuse and changes nothing.
- **selector** (the subclass; protocol ``Selector``): what a rank selects and what it reports.
  ``report_size(step)`` words ride in the step's first collective after the four ``StepWords``;
  ``select(step, grad, acc)`` fills ``acc = residual + grad`` and chooses (a ``Selection``, or a
  subclass holding whatever else the selector's later calls need: the step's state on this rank);
  ``combine(step, sel, words)`` runs the exchange and returns the output and the stats; ``words``
  is a ``RankWords`` (every rank's count and report words), the same whichever first collective
  the step ran.
- **exchange** (``transport.ExchangeProtocol``: ``transport.Exchange``, or its subclass
  ``DeviceExchange`` on a CUDA device): every MPI call and the ``ByteCounter``.
- **controller** (``algorithm.controllers.Controller``, ExDyna and MiCRO): the threshold.

The memory and the exchange can be given to ``Sparsifier(..., memory=, exchange=)``; the words of
the first collective (``StepWords``, ``RankWords``) are in ``step_words.py``. Here besides:
``agree_arguments``, the collective check of constructor arguments, which also agrees the
sparsifier's ``serial``; ``SumNotFinite``, what a step whose sum over ranks is not finite raises
before anything is committed.
"""
from __future__ import annotations

import dataclasses
import threading
import zlib
from typing import Any

import numpy as np

from .._errors import CollectiveError, InputCode
from ..transport import agree_problems
from .step_words import RankWords


class ErrorFeedback:
    """The error-feedback memory of one rank: ``residual`` (length ``numel``) and a spare buffer.

    Buffers live on the bound ``ops``' device; two of them rotate (``acc`` becomes the residual, the
    old residual the next step's ``acc``); the output is a fresh zero buffer (or the caller's ``out``).

    ``Sparsifier(..., memory=)`` takes one (or a subclass: one that counts or observes its calls);
    a step that is refused or skipped restores its attributes as they were before the step.

    Example::

        >>> mem = ErrorFeedback(numel); mem.bind(HostOps, np.dtype(np.float32))
        >>> acc = mem.take()                 # fill with residual + grad
        >>> out = mem.commit(acc, None)      # acc is the residual now; out is a fresh zero buffer
    """

    def __init__(self, numel):
        self.numel = numel
        self.ops = None
        self.dtype = None
        self.residual = None
        self._spare = None
        self._out = None      # this step's zeroed output, when made early (``output``)
        self._pending = None  # a loaded residual (host) waiting for the first step's device

    @property
    def bound(self):
        return self.residual is not None

    @property
    def held(self):
        """A residual exists: bound, or loaded and waiting for ``bind``."""
        return self.residual is not None or self._pending is not None

    def bind(self, ops, dtype):
        """Allocate the residual of ``dtype`` with ``ops`` (the first good step): zeros, or the one
        ``load`` kept on the host."""
        self.ops, self.dtype = ops, np.dtype(dtype)
        if self._pending is not None:
            self.residual, self._pending = ops.from_host(self._pending), None
        else:
            self.residual = ops.zeros(self.numel, self.dtype)

    def take(self):
        """A buffer for ``acc`` (the spare, or a fresh one)."""
        acc, self._spare = self._spare, None
        self._out = None
        return acc if acc is not None else self.ops.empty(self.numel, self.dtype)

    def keep(self, acc):
        """Keep an unused ``acc`` for the next ``take`` (a refused or skipped step)."""
        if acc is not None:
            self._spare = acc

    def output(self, out, zeroed=False):
        """This step's zeroed output buffer, made now (``out`` zeroed, or a fresh one; ``commit``
        returns it): a selector that knows the gradient is consumed may queue the zeroing where the
        device would otherwise wait for the host (an O(N) write on the critical path otherwise).
        ``zeroed``: ``out`` is zeroed already (by a kernel queued earlier)."""
        if self._out is None:
            self._out = self.ops.zeros(self.numel, self.dtype) if out is None else out
            if out is not None and not zeroed:
                self.ops.fill_zero(out)
        return self._out

    def commit(self, acc, out):
        """After a good step: ``acc`` becomes the residual; return the zeroed output buffer
        (``out`` when given, else a fresh one; the one ``output`` made, if it did); the old residual
        is kept for the next ``take``."""
        old = self.residual
        self.residual = acc
        self._spare = old     # the next step's acc: no allocation, its pages already mapped
        made, self._out = self._out, None
        if made is not None:
            return made
        if out is None:
            # a fresh zero buffer (the caller owns it): on the host its pages are zero-filled by the
            # OS when first written, so no pass over the vector here
            return self.ops.zeros(self.numel, self.dtype)
        self.ops.fill_zero(out)
        return out

    def host_copy(self, default_dtype):
        """The residual on the host (zeros before the first step)."""
        if self.residual is None:
            if self._pending is not None:
                return self._pending.copy()
            return np.zeros(self.numel, dtype=default_dtype)
        return np.array(self.ops.to_host(self.residual), copy=True)

    def scale(self, factor):
        """Multiply the residual by ``factor`` in place (bound or waiting for ``bind``), elementwise
        in its own dtype: the same bits on every backend."""
        if self.residual is not None:
            self.residual *= self.dtype.type(factor)
        elif self._pending is not None:
            self._pending *= self.dtype.type(factor)

    def load(self, ops, dtype, host):
        """Restore from a state dict: ``host`` None means unbound (no step seen). With ``ops`` None
        (no device chosen yet: ``device="auto"`` before its first step) the residual waits on the
        host and ``bind`` puts it on the device of the first gradient, as a fresh one would be."""
        self._spare, self._pending = None, None
        if host is None:
            self.dtype, self.residual = None, None
            return
        self.dtype = np.dtype(dtype)
        host = np.array(host, dtype=self.dtype, copy=True)
        if ops is None:
            self.ops, self.residual, self._pending = None, None, host
        else:
            self.ops, self.residual = ops, ops.from_host(host)


@dataclasses.dataclass(eq=False)
class Selection:
    """What ``select`` chose on this rank, passed by the template to ``choose`` and ``combine``.

    ``acc`` (``residual + grad``, this step's buffer); ``count`` (the first word); ``words`` (the
    ``report_size`` words it adds to the first collective); ``nonfinite`` (a refusal when > 0);
    ``sums`` (with ``sum_size`` > 0: this rank's words of the summed first collective); ``done``
    (the device already wrote the output and the residual: ``Sparsifier.average_at``);
    ``overflow`` (> 0: that many sums of this rank's own finite values overflowed, e.g. a transform's
    bins; a non-finite step, under the ``nonfinite`` policy). A selector whose later calls need more
    subclasses it (a dataclass with typed fields)."""

    acc: Any
    count: int = 0
    words: Any = ()
    nonfinite: int = 0
    sums: np.ndarray | None = None
    done: bool = False
    overflow: int = 0

    def problem(self) -> tuple[InputCode, int] | None:
        """This rank's refusal of the step, as the first collective carries it: non-finite values
        (``nonfinite``), else sums of finite values that overflowed (``overflow``), else None."""
        if self.nonfinite:
            return InputCode.NONFINITE, self.nonfinite
        if self.overflow:
            return InputCode.OVERFLOW, self.overflow
        return None


@dataclasses.dataclass(eq=False, slots=True)
class Step:
    """One step's context, made by the template: index ``t``, ``dtype`` (the residual's, or the
    input's on the first step), the caller's ``out`` buffer (or None) and ``sec`` (phase timings)."""

    t: int
    dtype: np.dtype
    out: Any = None
    sec: dict = dataclasses.field(default_factory=dict)


class Selector:
    """The selector protocol (implemented by every sparsifier class)."""

    def report_size(self, step: Step) -> int:
        """Words this rank adds to the first collective (a refusing rank sends that many zeros)."""
        return 0

    def sum_size(self, step: Step) -> int:
        """Words this rank adds to a *summed* first collective (an Allreduce whose size does not
        grow with P). 0 (the default): the first collective is the ``StepWords`` Allgather after
        ``select``. > 0: ``select`` only measures (``Selection.sums``), the template sums the words
        of every rank with the error flags, then ``choose`` selects and the counts are gathered."""
        return 0

    def select(self, step: Step, grad: Any, acc: Any) -> Selection:
        """``acc = residual + grad`` (via ``ops``), and this rank's choice: a ``Selection``.
        Must not change state: the step may still be refused."""
        raise NotImplementedError

    def choose(self, step: Step, sel: Selection, sums: np.ndarray) -> Selection:
        """Only with ``sum_size`` > 0, after every rank agreed: select with ``sums`` (the summed
        words, the same on every rank); set ``sel.count`` (and ``sel.words``); return ``sel``. May
        run further collectives (every rank does, with the same arguments)."""
        raise NotImplementedError

    def combine(self, step: Step, sel: Selection, words: RankWords) -> tuple[Any, dict[str, Any]]:
        """After every rank agreed: exchange, commit the memory and the selector's own state, return
        ``(output buffer, stats dict)``. ``words`` (``RankWords``): ``words.counts`` (P,) every
        rank's count, ``words.report`` (P, R) every rank's report words (``Selection.words``) in
        rank order, whether the first collective was the ``StepWords`` Allgather or a summed one
        (the error words are the template's, never in it). The dict holds ``counts`` and the fields
        the template does not fill (``loads``: the per-rank counts whose imbalance
        ``stats.imbalance`` reports, default ``counts``)."""
        raise NotImplementedError


class SumNotFinite(Exception):
    """Raised inside ``combine`` (before anything is committed) when values summed over ranks, the
    same on every rank, are not finite: every rank raises it at the same point, and the template
    turns it into the ``nonfinite`` policy's refusal or skip. ``str()``: the cause, the same text on
    every rank."""


def _fingerprint(text):
    return zlib.crc32(text.encode()) | (zlib.adler32(text.encode()) << 32)


class _Serials:
    """This process's next sparsifier serial. Construction takes one (``take``), agrees the largest
    taken on any rank and moves every rank past it (``passed``), so the sparsifiers built on one
    communicator get increasing serials, the same on every rank."""

    def __init__(self):
        self._next = 0
        self._lock = threading.Lock()

    def take(self):
        with self._lock:
            s, self._next = self._next, self._next + 1
            return s

    def passed(self, agreed):
        with self._lock:
            self._next = max(self._next, int(agreed) + 1)


SERIALS = _Serials()


def ident_of(serial, config):
    """A sparsifier's identity on its communicator: its serial (low 24 bits) and a 31-bit
    fingerprint of its agreed configuration above them (< 2**55: it fits above a dtype code)."""
    return ((_fingerprint(config) & 0x7FFFFFFF) << 24) | (int(serial) & 0xFFFFFF)


def agree_arguments(exchange, name, errors, config, serial=0):
    """Collective: raise the same ``ValueError`` on every rank when any rank has ``errors`` or the
    ranks' ``config`` texts differ. Returns the largest of the ranks' ``serial``."""
    got = agree_problems(exchange, "; ".join(errors), f"{name}: bad arguments",
                         [_fingerprint(config) & 0x7FFFFFFFFFFFFFFF, int(serial)])
    if (got[:, 0] != got[0, 0]).any():
        configs = exchange.gather_objects(config)
        parts = [f"rank {r}: {c}" for r, c in enumerate(configs)]
        raise CollectiveError(f"{name}: ranks disagree on the arguments: " + "; ".join(parts))
    return int(got[:, 1].max())


def imbalance(counts):
    """max count x P / total - 1: 0 when every rank selected the same number (ExDyna's ``load_inc``).
    The one definition behind ``stats.imbalance``."""
    total = int(np.sum(counts))
    if total == 0:
        return 0.0
    return float(np.max(counts)) * len(counts) / total - 1.0
