"""Sparsifier layer: ``Sparsifier``, the one step template every sparsifier runs.

``Sparsifier.step`` is the template (the same sequence for every method):

1. view the input (DLPack), check it locally, bind device and dtype on the first good step; a half
   gradient (float16, bfloat16) is widened to float32 here, the one place (``Ops.widen_half``):
   every selector then sees float32, the residual is float32, and step 6 rounds the output back;
   values travel in 16 bits where ``wire_dtype`` (or a half gradient) says so
   (``average_at``; dense's ``combine``), and only their signs where ``output="sign"`` says so.
   The binding is provisional until the step is agreed: a refused or skipped step undoes it, so the
   sparsifier is then exactly as it was (a fresh one stays unbound);
2. ``select`` (the selector role, the subclass) fills ``acc = residual + grad`` from the memory
   role and chooses what this rank sends;
3. the first collective (``step_words.py``: the ``StepWords`` Allgather, or the summed path of a
   selector with ``sum_size``): count, error word, dtype, and the sparsifier's ``ident`` and
   iteration, plus the selector's ``report_size`` words, through the exchange role; every rank
   raises the same ``StepError`` or skips (``nonfinite="skip"``) together, with the state untouched
   (``step_guard.py``); ranks that step different sparsifiers or iterations raise it too;
4. ``combine`` (the subclass) gets every rank's count and report words as one ``RankWords``
   (whichever first collective ran), exchanges, commits, and returns the output and its stats.
   Values summed over ranks are the same on every rank, so each rank checks them before it commits
   (``check_sums``): a sum that is not finite (finite gradients whose sum overflows) raises
   ``SumNotFinite`` on every rank at once, and the step is refused or skipped like a non-finite one;
5. the template completes the stats (iteration, bytes, timings, imbalance) and the iteration count;
6. the output goes back in the gradient's kind and dtype (a half one rounded to nearest even).

The roles are in ``roles.py``, the arguments in ``config.py``, the state dict in ``checkpoint.py``,
``Stats`` in ``stats.py``; the controller protocol in ``algorithm/controllers.py``.
"""
from __future__ import annotations

import math
import time
from typing import Any, Literal, Mapping, Sequence

import numpy as np

from ..arrays import (ACCEPTED_DTYPES, HALF_DTYPES, as_input, check_vector, compute_dtype, dtype_code,
                      host_threads, ops_for)
from ..arrays.half import WireFormat
from .._errors import InputCode
from ..transport import Exchange, ExchangeProtocol, device_exchange, node_ranks, world
from . import checkpoint, reshard as resharding
from .capabilities import Capabilities
from .config import DEVICES, NARROW_WIRE, NONFINITE_POLICIES, OUTPUTS, WIRE_DTYPES, Option, SparsifierConfig, configure
from .roles import SERIALS, ErrorFeedback, Selection, Selector, Step, SumNotFinite, agree_arguments, ident_of, imbalance
from .stats import Stats
from .step_guard import StepGuard, snapshot
from .step_words import first_collective
from .timing import timed

#: the float32 magnitude from which rounding to each half dtype (to nearest even) gives inf
_HALF_LIMIT = {"float16": 65520.0, "bfloat16": float(np.float32(2.0 - 2.0**-8) * np.float32(2.0**127))}

__all__ = ["DEVICES", "NONFINITE_POLICIES", "OUTPUTS", "WIRE_DTYPES", "Option", "Selection", "Sparsifier",
           "SparsifierConfig", "Stats"]


class Sparsifier(Selector):
    """One rank's end of a sparse gradient exchange. Subclasses implement the selector protocol
    (``report_size``, ``select``, ``combine``; see ``roles.Selector``) and declare their options
    (``OPTIONS``: name -> ``Option``) and capabilities (``CAPABILITIES``).

    Construction and every step are collective over ``comm``: all ranks must call them, and a bad
    argument on any rank raises the same ``ValueError`` on every rank.

    Public roles: ``memory`` (``ErrorFeedback``), ``exchange`` (a ``transport.ExchangeProtocol``:
    ``transport.Exchange``, or on a CUDA device its subclass ``DeviceExchange``), ``ops`` (the
    ``arrays.Ops`` of the bound device, None until bound). ``config``: the ``SparsifierConfig`` the
    arguments resolved to (``numel``, ``density``, ``nonfinite``, ``wire_dtype``, ``output`` and
    ``options`` are its values, ``numel`` as an ``int``).

    ``serial``: this sparsifier's number, the same on every rank and larger than that of any
    sparsifier built before it on the same ranks; with a fingerprint of the configuration
    (``config.text``) it makes ``ident``, which every step's first collective carries with the
    iteration, so a rank stepping another sparsifier or iteration than the others is refused on
    every rank (``StepError``).

    Args:
        numel: the flat gradient's length, the same on every rank.
        density: the fraction of elements sent per step, in (0, 1].
        comm: the communicator (the ``exchange``'s when one is given, else ``MPI.COMM_WORLD``).
        device: ``"auto"`` (where the first gradient lives), ``"cpu"`` or ``"cuda"``.
        nonfinite: ``"raise"`` or ``"skip"``: what a step with NaN/inf on any rank does.
        memory: the error-feedback memory (``roles.ErrorFeedback`` of ``numel`` elements, or a
            subclass); None: a new ``ErrorFeedback(numel)``.
        exchange: the exchange role (a ``transport.ExchangeProtocol`` over ``comm``'s ranks), used on
            every device as given; None: ``transport.Exchange(comm)``, replaced by a
            ``DeviceExchange`` when the sparsifier binds to CUDA.
        **options: ``wire_dtype``, ``output`` and the subclass's ``OPTIONS`` (docs/reference.md).

    Raises:
        CollectiveError: bad or disagreeing arguments on any rank (a ``ValueError``, on every rank).

    Example::

        >>> sp = exdyna_mpi.make("topk", numel, 0.01, comm)   # a subclass, by name
        >>> avg = sp.step(flat_grad); sp.stats.density, sp.config.options
    """

    name = "base"
    #: option name -> ``Option`` (default, check, doc)
    OPTIONS: dict[str, Option] = {}
    #: what this class can do (16-bit values, a CUDA step, sign output, the tuned defaults)
    CAPABILITIES = Capabilities()
    #: indices in compact form on the wire (host); False sends int32/int64 indices (benchmarks)
    COMPACT_INDICES = True

    config: SparsifierConfig     # the arguments, resolved and agreed
    iteration: int               # the next step's index
    stats: Stats | None          # what the last step did (None before the first)
    ops: Any                     # the per-element ops of the device (None until it is bound)
    memory: ErrorFeedback        # the error-feedback residual
    exchange: ExchangeProtocol   # every MPI call and the byte counter (a device one once bound to CUDA)

    def __init__(self, numel: int, density: float, comm: Any = None, *, device: str = "auto",
                 nonfinite: str = "raise", memory: ErrorFeedback | None = None,
                 exchange: ExchangeProtocol | None = None, **options: Any) -> None:
        if comm is None:
            comm = world() if exchange is None else exchange.comm
        self.comm = comm
        self._own_exchange = exchange is None   # made here: a CUDA binding swaps in a device one
        self.exchange = Exchange(comm) if exchange is None else exchange
        self.rank, self.nranks = self.exchange.rank, self.exchange.size
        from ..transport.watchdog import timeout_problem
        errors = [p for p in [timeout_problem()] if p]   # a bad EXDYNA_TIMEOUT_S on any rank refuses on all
        config, problems = configure(type(self), Sparsifier, numel, density, nonfinite, device, options)
        errors += problems
        if memory is not None and not problems and memory.numel != config.numel:
            errors.append(f"memory holds {memory.numel!r} elements, numel is {config.numel!r}")
        self.serial = agree_arguments(self.exchange, self.name, errors, config.text, SERIALS.take())
        SERIALS.passed(self.serial)
        self.ident = ident_of(self.serial, config.text)
        self.exchange.reset_counters()
        # host threads of the per-element pass: this rank's share of its node's cores (1 when the
        # node's ranks fill them); the same result with any number
        self.threads = host_threads(node_ranks(self.comm))
        self.config = config
        self.numel = int(config.numel)
        self.density = config.density
        self.nonfinite = config.nonfinite
        self.options = config.options
        self.wire_dtype = config.wire_dtype
        self.output = config.output
        self._wire: WireFormat | None = None   # the WireFormat of a step whose values travel in 16 bits
        self.memory = ErrorFeedback(self.numel) if memory is None else memory
        self._grad_dtype: str | None = None    # the gradients' dtype name, fixed by the first good step
        self._wide = None           # float32 buffers of a half gradient: its values, the output
        self._idx = None            # ``index_buffer``'s buffer
        self._device, self.ops, self._input_device = None, None, None
        if config.device != "auto":
            self._use_device(config.device)
        self.iteration = 0
        self.stats = None

    # ------------------------------------------------------------------ device and buffers
    @property
    def device(self) -> str:
        """"cpu" or "cuda": where the buffers live ("cpu" until ``device="auto"`` sees a gradient)."""
        return self._device or "cpu"

    @property
    def dtype(self) -> np.dtype:
        """The residual's dtype (float32 before the first step)."""
        return self.memory.dtype or np.dtype(np.float32)

    @property
    def _dtype(self):
        return self.memory.dtype

    @property
    def residual(self) -> np.ndarray:
        """A copy of the error-feedback buffer (zeros before the first step), on the host."""
        return self.memory.host_copy(self.dtype)

    def scale_residual(self, factor: float) -> None:
        """Multiply the error-feedback residual by ``factor`` in place: a decayed accumulator
        (SparseLoCo's ``e <- beta * e + delta`` is this, then the next step). Not collective; call
        it alike on every rank, between steps, to keep their residuals' roles the same.

        Args:
            factor: a finite number (0 clears the residual, 1 changes nothing).

        Returns:
            None.

        Raises:
            ValueError: ``factor`` is not finite.

        Example::

            >>> sp.step(delta, out=delta)
            >>> sp.scale_residual(0.95)    # what the next step adds its gradient to
        """
        if not math.isfinite(float(factor)):
            raise ValueError(f"scale_residual: the factor must be finite, got {factor!r}")
        if float(factor) != 1.0:
            self.memory.scale(float(factor))

    def _use_device(self, device):
        """Bind the per-element ops (and, unless one was given, the exchange) to ``device``."""
        self._device = device
        self.ops = ops_for(device)
        # where the ops' buffers live: CUDA buffers are NumPy arrays under the simulator
        self._input_device = "cpu" if self.ops.xp is np else device
        if device == "cuda" and self._own_exchange:
            self.exchange = device_exchange(self.comm)

    def _bind(self, inp):
        """Fix device and dtype from the first good gradient; allocate the residual there (float32
        for a half gradient). Returns what ``StepGuard.unbind`` needs to take the binding back if the
        step is not agreed (None when this step binds nothing new)."""
        undo = None
        if self._grad_dtype is None or not self.memory.bound:
            # provisional: buffers the step allocates on the new device go back with it
            undo = snapshot(self)
        self._grad_dtype = inp.dtype
        if not self.memory.bound:
            if self._device is None:
                self._use_device(inp.device)
            self.memory.bind(self.ops, compute_dtype(inp.dtype))
        self._wire = self._wire_format(inp.dtype)
        return undo

    def _wire_format(self, grad_dtype):
        """The 16-bit format this sparsifier's values travel in for gradients of ``grad_dtype``, or
        None (the computing dtype): ``wire_dtype``, else the gradient's own where it is half."""
        name = self.wire_dtype
        if name is None and grad_dtype in HALF_DTYPES:
            name = grad_dtype
        if name not in HALF_DTYPES or not self.CAPABILITIES.wire_half:
            return None
        return WireFormat.of(name)

    def _take(self, grad, out=None):
        """View ``grad`` (and ``out``) as backend arrays; the local problem, if any, as (code, detail)."""
        inp = as_input(grad)
        err = check_vector(inp, self.numel, self._grad_dtype, self._input_device, ACCEPTED_DTYPES)
        if err is None and inp.device == "cuda" and not self.CAPABILITIES.device_step:
            err = (InputCode.HOST_STEP, 0)
        if err is None and self._grad_dtype is None and self._dtype is not None \
                and compute_dtype(inp.dtype) != self._dtype:
            # a loaded residual whose gradient dtype was not recorded: the residual's dtype decides
            err = (InputCode.DTYPE_MISMATCH, dtype_code(inp.dtype))
        if err is None and self.wire_dtype in NARROW_WIRE and compute_dtype(inp.dtype) != np.float32:
            err = (InputCode.WIRE, dtype_code(inp.dtype))
        if err is None and out is not None:
            o = as_input(out)
            err = check_vector(o, self.numel, inp.dtype, inp.device, ACCEPTED_DTYPES)
            if err is not None:
                err = (InputCode.BAD_OUT, 0)
            out = o.array if err is None else None
        return inp, err, out

    def _widen(self, inp):
        """A half gradient's float32 copy and a float32 output buffer (both kept across steps, on
        the sparsifier's device)."""
        if self._wide is None:
            self._wide = (self.ops.empty(self.numel, np.float32), self.ops.empty(self.numel, np.float32))
        grad, res = self._wide
        return self.ops.widen_half(inp.array, inp.dtype, grad), res

    def _narrow(self, res, name, out):
        """The float32 output ``res`` rounded to half dtype ``name`` (into ``out`` when given)."""
        if out is None:
            out = self.ops.empty(self.numel, np.uint16 if name == "bfloat16" else np.float16)
        return self.ops.narrow_half(res, name, out)

    # ------------------------------------------------------------------ the step template
    def step(self, grad: Any, out: Any = None) -> Any:
        """Sparsify ``grad``, exchange, and return the averaged sparse gradient (dense, same kind).

        ``out`` (optional): a buffer of the same kind, dtype and device to write the result into
        (it may be ``grad`` itself). Collective over ``comm``.

        Raises ``StepError`` on every rank (state unchanged) for bad input on any rank, for ranks
        that step different sparsifiers or iterations, and (``nonfinite="raise"``) for non-finite
        values or a sum over ranks that is not finite; ``nonfinite="skip"`` skips the last two.
        """
        t_start = time.perf_counter()
        self.exchange.reset_counters()
        inp, err, out = self._take(grad, out)
        code = dtype_code(inp.dtype) if err is None else 0
        dtype = self._dtype if self._dtype is not None else (
            compute_dtype(inp.dtype) if err is None else np.dtype(np.float32))
        half = err is None and inp.dtype in HALF_DTYPES
        g = inp.array
        step = Step(self.iteration, dtype, out)
        sec = step.sec
        guard = StepGuard(self, inp, out)
        sel: Any = None   # the Selection, whenever err is None
        if err is None:
            guard.undo = self._bind(inp)
            with timed(sec, "select"):
                if half:
                    g, step.out = self._widen(inp)
                sel = self.select(step, g, self.memory.take())
            guard.acc = sel.acc
            err = sel.problem()
        agreed = first_collective(self.sum_size(step)).agree(self, step, sel, err, code, guard)
        if agreed is None:
            return guard.skip()
        sel, words = agreed
        try:
            res, st = self.combine(step, sel, words)
        except SumNotFinite as e:   # raised on every rank alike, before any commit
            return guard.not_finite(str(e))
        loads = st.pop("loads", st["counts"])
        self.stats = Stats(iteration=step.t, bytes_sent=self.exchange.bytes_sent,
                           bytes_received=self.exchange.bytes_received, seconds=sec, skipped=False,
                           imbalance=imbalance(loads), **st)
        self.iteration = step.t + 1
        if half:
            with timed(sec, "narrow"):
                res = self._narrow(res, inp.dtype, out)
        sec["total"] = time.perf_counter() - t_start
        return inp.wrap(res)

    def _undo_exchange(self):
        """Take back what this step's exchange recorded for later steps (a deadline exchange's
        history) when the step is refused after it ran; nothing here."""

    def _word_dtype(self):
        """int32 for summed words while any sum of per-element counts fits (numel < 2**31)."""
        return np.int32 if self.numel < 2**31 else np.int64

    def check_sums(self, sums: Any, p: int | None = None) -> None:
        """Before anything is committed: raise ``SumNotFinite`` unless every value in ``sums`` (values
        summed over ranks, the same bits on every rank, on the device where they are) is finite, and,
        for a half gradient whose output is rounded from the computing dtype, unless every average
        ``sums / p`` rounds to a finite half value. Every rank reaches the same verdict with no
        further collective; an O(len(sums)) read."""
        xp = self.ops.xp
        n = int(sums.shape[0])
        if not bool(xp.isfinite(sums).all()):
            bad = n - int(xp.count_nonzero(xp.isfinite(sums)))
            raise SumNotFinite(f"the sum over ranks is not finite at {bad} of the {n} values exchanged "
                               f"(finite gradients whose sum overflows {self._dtype})")
        limit = None
        if p is not None and self._wire is None and self._grad_dtype is not None:
            limit = _HALF_LIMIT.get(self._grad_dtype)
        if limit is not None:
            over = int(xp.count_nonzero(xp.abs(sums / self._dtype.type(p)) >= self._dtype.type(limit)))
            if over:
                raise SumNotFinite(f"the average over ranks overflows {self._grad_dtype} at {over} of the "
                                   f"{n} values exchanged")

    def check_wire(self, means: Any) -> None:
        """``check_sums`` for averages that came back as 16-bit patterns (``Exchange.mean_wire``):
        saturating rounding keeps finite sums finite there, so only a sum that overflowed the
        computing dtype (inf or NaN) raises ``SumNotFinite``."""
        xp, wire = self.ops.xp, self._wire
        assert wire is not None   # (only a step whose values travel in 16 bits has such averages)
        mask = xp.uint16(0x7F80 if wire.name == "bfloat16" else 0x7C00)
        bad = int(xp.count_nonzero((means & mask) == mask))
        if bad:
            raise SumNotFinite(f"the sum over ranks is not finite at {bad} of the {int(means.shape[0])} values "
                               f"exchanged (finite gradients whose sum overflows float32)")

    # ------------------------------------------------------------------ shared by selectors
    def index_buffer(self, n: int) -> Any:
        """An index buffer of at least ``n`` elements on the bound device (int32 below 2**31
        elements, else int64), kept across steps and grown when short: for ``select`` to write
        this rank's selection into and ``combine`` to read it back.

        Args:
            n: the elements needed (the most a selection can hold, e.g. ``numel``).

        Returns:
            The buffer (its first ``n`` elements are this caller's; their values are undefined).
        """
        if self._idx is None or self._idx.shape[0] < n:
            self._idx = self.ops.empty(max(int(n), 1), np.int32 if self.numel < 2**31 else np.int64)
        return self._idx

    def gather_selection(self, idx: Any, counts: np.ndarray, spans: np.ndarray) -> Any:
        """Every rank's selection in rank order, in compact form on the wire
        (``Exchange.allgather_indices``, host and device alike): ``spans`` (P, 2) holds each rank's
        ``[lo, hi)``."""
        if self.COMPACT_INDICES and self.numel < 2**32:
            return self.exchange.allgather_indices(idx, counts, spans)
        return self.exchange.allgatherv(idx, counts)

    def accumulate(self, grad: Any, acc: Any) -> int:
        """``acc = residual + grad`` with no selection; returns the number of non-finite values."""
        no_idx = np.empty(1, dtype=np.int32)
        _, bad = self.ops.accumulate_select(self.memory.residual, grad, acc, 0, 0, self._dtype.type(np.inf), no_idx)
        return bad

    def _vals_buffer(self, n, dtype):
        """``n`` elements for the union's values, from one buffer kept across steps (grown by a
        quarter when short): no allocation per step on either backend."""
        buf = getattr(self, "_vals", None)
        if buf is None or buf.shape[0] < n or buf.dtype != dtype:
            buf = self._vals = self.ops.empty(max(n + n // 4, 1), dtype)
        return buf[:n]

    def average_at(self, acc: Any, union: Any, out: Any, sec: dict[str, float], done: bool = False) -> Any:
        """The end of a union step: sum every rank's ``acc[union]`` (bit-identical everywhere), ``acc``
        becomes the residual with ``union`` zeroed, and the returned buffer holds the sum / P at ``union``
        (``output="sign"``: its sign), 0 elsewhere; phase times into ``sec``. ``done``: the device already
        wrote both (a one-rank step finished behind its pass); only the buffers change hands."""
        if done:
            return self.memory.commit(acc, out)
        ops, dtype = self.ops, self._dtype
        signs = self.output == "sign"
        with timed(sec, "gather"):
            vals = self._vals_buffer(union.shape[0], dtype)
            ops.gather(acc, union, vals)
        if self._wire is not None or self.wire_dtype in NARROW_WIRE:   # (8-bit codes: no _wire)
            # 16- or 8-bit values: vals becomes what this rank keeps (the rounding it did), means are shared
            with timed(sec, "reduce"):
                if self._wire is not None:   # 16-bit
                    means = self.exchange.mean_wire(vals, self._wire, signs=signs)
                    self.check_wire(means)
                else:
                    means = self.exchange.mean_8bit(vals, str(self.wire_dtype), signs=signs)   # float32: checked
                    self.check_sums(means, 1)
            with timed(sec, "scatter"):
                res = self.memory.commit(acc, out)
                if self._wire is not None:
                    ops.scatter_wire(res, self.memory.residual, union, means, vals, self._wire)
                else:
                    ops.scatter(res, union, means)
                    ops.scatter(self.memory.residual, union, vals)
            return res
        with timed(sec, "reduce"):
            if signs:   # vals becomes sign(sum / P): the divisor below is then 1
                self.exchange.sum_signs(vals)
            else:
                self.exchange.sum_identical(vals)
            self.check_sums(vals, 1 if signs else self.nranks)
        with timed(sec, "scatter"):
            res = self.memory.commit(acc, out)
            ops.scatter_mean_zero(res, self.memory.residual, union, vals, dtype.type(1 if signs else self.nranks))
        return res

    # ------------------------------------------------------------------ state
    def extra_state(self) -> dict[str, Any]:
        """The subclass's own state-dict entries (host copies)."""
        return {}

    def load_extra_state(self, d: Mapping[str, Any]) -> None:
        """Load what ``extra_state`` made (after every rank's ``check_extra_state`` passed)."""

    def check_extra_state(self, d: Mapping[str, Any]) -> None:
        """Raise ``KeyError``/``TypeError``/``ValueError`` if ``load_extra_state(d)`` could not
        load ``d``; changes nothing (``load_state_dict`` checks every rank before any rank loads)."""

    def reshard_extra_state(self, dicts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """The entries of ``extra_state`` to load on THIS rank at this rank count from the old ranks'
        dicts (``load_state_dict(dicts, reshard=True)``); changes nothing, no communication.

        Args:
            dicts: the old ranks' state dicts in old-rank order (the elastic shrink: the one its
                shared state comes from).

        Returns:
            The entries (checked by ``check_extra_state``, then loaded by ``load_extra_state``); here
            ``{}`` for a class whose ``extra_state()`` is ``{}``.

        Raises:
            NotImplementedError: the class has its own entries and no rule for another rank count
                (the load is refused, on every rank, with this text).
            ValueError: the dicts' entries disagree where they must not.
        """
        if self.extra_state():
            raise NotImplementedError(f"{self.name}: cannot be resharded: its state dict has its own entries "
                                      f"{sorted(self.extra_state())} and the class has no reshard_extra_state")
        return {}

    def close(self) -> None:
        """Release what the sparsifier holds between steps: nothing for most; a deadline exchange
        completes its late messages and frees its communicator (collective then). It may step
        again afterwards. ``with make(...) as sp:`` closes it at the end of the block."""

    def __enter__(self) -> Sparsifier:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.close()
        return False

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-exactly on this rank (host copies; safe to pickle)."""
        return checkpoint.state_of(self)

    def load_state_dict(self, d: Any, reshard: bool = False) -> None:
        """Restore ``state_dict()`` output. Collective: every rank loads its own rank's dict; with
        ``reshard=True``, ``d`` is every old rank's dict (saved at another rank count), the same
        sequence on every rank, each new residual their mean (``sparsifiers/reshard.py``).

        All or nothing: every rank checks its whole dict (header, residual, controller, layout,
        extra state) before one agreement; if any rank's dict is wrong, every rank raises the same
        ``ValueError`` naming the ranks and causes, and no rank's state changes.
        """
        if reshard:
            resharding.reshard(self, d, complete=True)
        else:
            checkpoint.load(self, d)
