"""Sparsifier layer: ``Sparsifier``, the one step template every sparsifier runs, and ``Stats``.

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
3. the first collective: ``StepWords`` (count, error word, dtype, and the sparsifier's ``ident``
   and iteration) plus the selector's ``report_size`` words, through the exchange role; every rank
   raises the same ``StepError`` or skips (``nonfinite="skip"``) together, with the state
   untouched; ranks that step different sparsifiers or iterations raise it too;
4. ``combine`` (the subclass) gets every rank's count and report words as one ``RankWords``
   (whichever first collective ran), exchanges, commits, and returns the output and its stats.
   Values summed over ranks are the same on every rank, so each rank checks them before it commits
   (``check_sums``): a sum that is not finite (finite gradients whose sum overflows) raises
   ``SumNotFinite`` on every rank at once, and the step is refused or skipped like a non-finite one;
5. the template completes the stats (iteration, bytes, timings, imbalance) and the iteration count;
6. the output goes back in the gradient's kind and dtype (a half one rounded to nearest even).

The roles are in ``roles.py``; the controller protocol in ``algorithm/controllers.py``.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Literal, Mapping

import numpy as np

from ..arrays import (ACCEPTED_DTYPES, HALF_DTYPES, as_input, check_vector, compute_dtype, dtype_code,
                      host_threads, ops_for)
from ..arrays.half import WireFormat
from ..arrays.ops import cuda_available, cuda_simulated
from .._errors import CollectiveError, InputCode, StepError
from ..transport import Exchange, ExchangeProtocol, agree_problems, device_exchange, node_ranks, world
from .capabilities import Capabilities
from .roles import (SERIALS, ErrorFeedback, RankWords, Selection, Selector, Step, StepWords, SumNotFinite,
                    agree_arguments, ident_of, imbalance)
from .timing import timed

NONFINITE_POLICIES = ("raise", "skip")
#: the float32 magnitude from which rounding to each half dtype (to nearest even) gives inf
_HALF_LIMIT = {"float16": 65520.0, "bfloat16": float(np.float32(2.0 - 2.0**-8) * np.float32(2.0**127))}
DEVICES = ("auto", "cpu", "cuda")
#: ``wire_dtype``: None (the gradient's: 16-bit values for a half gradient where the sparsifier can
#: send them, else the computing dtype), or one of these
WIRE_DTYPES = ("float32", "bfloat16", "float16")
#: ``output``: what a step returns at the union, the average (``"mean"``) or its sign (``"sign"``: 1,
#: -1 or 0, the values' signs gathered as 2-bit codes; for updates that use the sign alone)
OUTPUTS = ("mean", "sign")

__all__ = ["DEVICES", "NONFINITE_POLICIES", "OUTPUTS", "WIRE_DTYPES", "Selection", "Sparsifier", "Stats"]


class Stats:
    """What the last step did. Attributes, also readable as ``stats["name"]``; a sparsifier may add
    its own (ExDyna: ``quota_moved``, ``deadline``; FFT: ``rel_error``, ...)."""

    FIELDS = ("iteration", "counts", "selected", "density", "threshold", "bounds", "owned",
              "bytes_sent", "bytes_received", "seconds", "skipped", "imbalance")

    iteration: int                 # the step's index
    counts: np.ndarray             # (P,) what each rank selected (its load)
    selected: int                  # the total selection
    density: float                 # selected / numel
    threshold: float | None        # the global threshold, where there is one
    bounds: np.ndarray | None      # partition boundaries of the step (ExDyna, MiCRO)
    owned: np.ndarray | None       # the partition each rank owned
    bytes_sent: int                # this rank's bytes of the step, sent and received
    bytes_received: int
    seconds: dict[str, float]      # phase timings ({} for a skipped step)
    skipped: bool                  # skipped on every rank (non-finite values, ``nonfinite="skip"``)
    imbalance: float | None        # max count x P / total - 1

    def __init__(self, **kw: Any) -> None:
        for f in self.FIELDS:
            setattr(self, f, kw.pop(f, None))
        for k, v in kw.items():
            setattr(self, k, v)

    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def keys(self) -> list[str]:
        return [k for k in vars(self)]

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if k != "seconds")
        return f"Stats({body})"


class Sparsifier(Selector):
    """One rank's end of a sparse gradient exchange. Subclasses implement the selector protocol
    (``report_size``, ``select``, ``combine``; see ``roles.Selector``).

    Construction and every step are collective over ``comm``: all ranks must call them, and a bad
    argument on any rank raises the same ``ValueError`` on every rank.

    Public roles: ``memory`` (``ErrorFeedback``), ``exchange`` (a ``transport.ExchangeProtocol``:
    ``transport.Exchange``, or on a CUDA device its subclass ``DeviceExchange``), ``ops`` (the
    ``arrays.Ops`` of the bound device, None until bound).

    ``serial``: this sparsifier's number, the same on every rank and larger than that of any
    sparsifier built before it on the same ranks; with a fingerprint of the configuration it makes
    ``ident``, which every step's first collective carries with the iteration, so a rank stepping
    another sparsifier or iteration than the others is refused on every rank (``StepError``).

    Args:
        numel: the flat gradient's length, the same on every rank.
        density: the fraction of elements sent per step, in (0, 1].
        comm: the communicator (``MPI.COMM_WORLD`` when None).
        device: ``"auto"`` (where the first gradient lives), ``"cpu"`` or ``"cuda"``.
        nonfinite: ``"raise"`` or ``"skip"``: what a step with NaN/inf on any rank does.
        **options: ``wire_dtype``, ``output`` and the subclass's ``OPTIONS`` (docs/reference.md).

    Raises:
        CollectiveError: bad or disagreeing arguments on any rank (a ``ValueError``, on every rank).
    """

    name = "base"
    #: option name -> (default, validator returning an error text or None)
    OPTIONS: dict[str, tuple[Any, Callable[[Any], str | None]]] = {}
    #: what this class can do (16-bit values, a CUDA step, sign output, the tuned defaults)
    CAPABILITIES = Capabilities()
    #: indices in compact form on the wire (host); False sends int32/int64 indices (benchmarks)
    COMPACT_INDICES = True

    iteration: int               # the next step's index
    stats: Stats | None          # what the last step did (None before the first)
    ops: Any                     # the per-element ops of the device (None until it is bound)
    exchange: ExchangeProtocol   # every MPI call and the byte counter (a device one once bound to CUDA)

    def __init__(self, numel: int, density: float, comm: Any = None, *, device: str = "auto",
                 nonfinite: str = "raise", **options: Any) -> None:
        self.comm = world() if comm is None else comm
        self.exchange = Exchange(self.comm)
        self.rank, self.nranks = self.exchange.rank, self.exchange.size
        from ..transport.watchdog import timeout_problem
        errors = [p for p in [timeout_problem()] if p]   # a bad EXDYNA_TIMEOUT_S on any rank refuses on all
        if isinstance(numel, (bool, np.bool_)) or not isinstance(numel, (int, np.integer)) or numel <= 0:
            errors.append(f"numel must be a positive integer, got {numel!r}")
        try:
            density = float(density)
            if not 0.0 < density <= 1.0:
                raise ValueError
        except (TypeError, ValueError):
            errors.append(f"density must be in (0, 1], got {density!r}")
        if nonfinite not in NONFINITE_POLICIES:
            errors.append(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        if device not in DEVICES:
            errors.append(f"device must be one of {DEVICES}, got {device!r}")
        elif device == "cuda" and not cuda_available():
            errors.append("device='cuda' but no CUDA device is available to CuPy")
        elif device == "cuda" and not self.CAPABILITIES.device_step and not cuda_simulated():
            errors.append(f"device='cuda': {self.name}'s step is host NumPy code (no CUDA step); give it host "
                          f"gradients with device='cpu', or use one of {', '.join(_device_step_names())}")
        wire_dtype = options.pop("wire_dtype", None)
        if wire_dtype is not None and wire_dtype not in WIRE_DTYPES:
            errors.append(f"wire_dtype must be None or one of {WIRE_DTYPES}, got {wire_dtype!r}")
        elif wire_dtype in HALF_DTYPES and not self.CAPABILITIES.wire_half:
            errors.append(f"{self.name} cannot send its values in {wire_dtype} (wire_dtype); the sparsifiers "
                          f"that can: {', '.join(_wire_half_names())}")
        output = options.pop("output", "mean")
        if output not in OUTPUTS:
            errors.append(f"output must be one of {OUTPUTS}, got {output!r}")
        elif output == "sign" and not self.CAPABILITIES.sign_output:
            errors.append(f"{self.name} cannot return the sign of its average (output='sign'); the sparsifiers "
                          f"that can: {', '.join(_names_where('sign_output'))}")
        opts = {}
        for key, (default, check) in self.OPTIONS.items():
            val = options.pop(key, default)
            problem = check(val)
            if problem:
                errors.append(f"{key} {problem}, got {val!r}")
            opts[key] = val
        for key in sorted(options):
            errors.append(f"unknown option {key!r} for {self.name}")
        config = (f"{self.name} numel={numel!r} density={density!r} nonfinite={nonfinite!r} device={device!r} "
                  f"wire_dtype={wire_dtype!r} output={output!r} "
                  + " ".join(f"{k}={v!r}" for k, v in sorted(opts.items())))
        self.serial = agree_arguments(self.exchange, self.name, errors, config, SERIALS.take())
        SERIALS.passed(self.serial)
        self.ident = ident_of(self.serial, config)
        self.exchange.reset_counters()
        # host threads of the per-element pass: this rank's share of its node's cores (1 when the
        # node's ranks fill them); the same result with any number
        self.threads = host_threads(node_ranks(self.comm))
        self.numel = int(numel)
        self.density = density
        self.nonfinite = nonfinite
        self.options = opts
        self.wire_dtype = wire_dtype
        self.output = output
        self._wire: WireFormat | None = None   # the WireFormat of a step whose values travel in 16 bits
        self.memory = ErrorFeedback(self.numel)
        self._grad_dtype: str | None = None    # the gradients' dtype name, fixed by the first good step
        self._wide = None           # float32 buffers of a half gradient: its values, the output
        self._device, self.ops, self._input_device = None, None, None
        if device != "auto":
            self._use_device(device)
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
        """Bind the per-element ops and the exchange to ``device`` ("cpu" or "cuda")."""
        self._device = device
        self.ops = ops_for(device)
        # where the ops' buffers live: CUDA buffers are NumPy arrays under the simulator
        self._input_device = "cpu" if self.ops.xp is np else device
        if device == "cuda":
            self.exchange = device_exchange(self.comm)

    #: attributes a step that is refused or skipped does not take back with its binding (``_unbind``):
    #: what the template sets after the verdict, and a deadline exchange built collectively in it
    _UNBIND_KEEPS = frozenset({"stats", "deadline"})

    def _bind(self, inp):
        """Fix device and dtype from the first good gradient; allocate the residual there (float32
        for a half gradient). Returns what ``_unbind`` needs to take the binding back if the step is
        not agreed (None when this step binds nothing new)."""
        undo = None
        if self._grad_dtype is None or not self.memory.bound:
            # provisional: buffers the step allocates on the new device go back with it
            undo = (dict(vars(self)), dict(vars(self.memory)))
        self._grad_dtype = inp.dtype
        if not self.memory.bound:
            if self._device is None:
                self._use_device(inp.device)
            self.memory.bind(self.ops, compute_dtype(inp.dtype))
        self._wire = self._wire_format(inp.dtype)
        return undo

    def _unbind(self, undo):
        """Take back the binding of a step that was refused or skipped (``_bind``'s ``undo``):
        every attribute of the sparsifier and of its memory as it was before the step."""
        if undo is None:
            return
        attrs, memory = undo
        _restore(vars(self), attrs, self._UNBIND_KEEPS)
        _restore(vars(self.memory), memory, frozenset())

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
        if err is None and self.wire_dtype in HALF_DTYPES and compute_dtype(inp.dtype) != np.float32:
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
        tag = (self.ident, step.t)
        sel: Any = None   # the Selection, whenever err is None
        undo = None       # what takes back a binding this step made, if it is not agreed
        if err is None:
            undo = self._bind(inp)
            with timed(sec, "select"):
                if half:
                    g, step.out = self._widen(inp)
                sel = self.select(step, g, self.memory.take())
            if sel.nonfinite:
                err = (InputCode.NONFINITE, sel.nonfinite)
            elif sel.overflow:
                err = (InputCode.OVERFLOW, sel.overflow)
        acc = sel.acc if sel is not None else None
        n_sum = self.sum_size(step)
        if n_sum:   # a summed first collective: measure, agree, then choose (roles.Selector.sum_size)
            with timed(sec, "sum_words"):
                sums = sel.sums if err is None else np.zeros(n_sum, np.int64)
                wd = self._word_dtype()
                tag_word = StepWords.tag_word(self.ident, step.t, StepWords.tag_modulus(self.nranks, wd))
                summed = self.exchange.sum_words(np.concatenate((StepWords.flags(err, code, tag_word), sums)), wd)
            if not StepWords.flags_ok(summed, self.nranks):
                words = self.exchange.agree(StepWords.make(0, err, code, tag))   # the error path: details
                if self._refused(words, acc, undo):
                    return self._skip(inp, out, undo)
                raise AssertionError("summed flags and gathered words disagree")  # pragma: no cover
            with timed(sec, "choose"):
                sel = self.choose(step, sel, summed[3:])
            with timed(sec, "counts"):   # the sum agreed the flags: count and report words only
                gathered = RankWords.gathered(self.exchange.agree([sel.count] + list(sel.words)), 1)
        else:
            with timed(sec, "counts"):
                report = list(sel.words) if err is None else [0] * self.report_size(step)
                words = self.exchange.agree(StepWords.make(sel.count if err is None else 0, err, code, tag)
                                            + report)
            if self._refused(words, acc, undo):
                return self._skip(inp, out, undo)
            gathered = RankWords.gathered(words, StepWords.N)
        try:
            res, st = self.combine(step, sel, gathered)
        except SumNotFinite as e:   # raised on every rank alike, before any commit
            return self._not_finite(str(e), inp, out, acc, undo)
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

    def _refused(self, words, acc, undo=None):
        """Raise the same StepError on every rank, or return True for a step skipped everywhere,
        with the state untouched (``acc`` kept for reuse, the binding taken back); False: the step
        goes on."""
        try:
            if StepWords.mismatch(words):
                self._order_error()
            skip = StepWords.check(words, self.name, self.numel, self.nonfinite)
        except Exception:
            self.memory.keep(acc)
            self._unbind(undo)
            raise
        if skip:
            self.memory.keep(acc)
        return skip

    def _order_error(self):
        """The ranks' first words name different sparsifiers or iterations: every rank has seen the
        same words, so each gathers the others' descriptions and raises the same ``StepError``."""
        mine = f"{self.name} #{self.serial} at iteration {self.iteration}"
        parts = "; ".join(f"rank {r}: {d}" for r, d in enumerate(self.exchange.gather_objects(mine)))
        raise StepError(f"step refused on all ranks, state unchanged: the ranks step different sparsifiers or "
                        f"iterations ({parts}); every rank must step the same sparsifiers in the same order")

    def _not_finite(self, cause, inp, out, acc, undo):
        """A step whose sum over ranks is not finite (``SumNotFinite``, on every rank alike): refused
        (``nonfinite="raise"``) or skipped, as a non-finite gradient is; nothing was committed."""
        self._undo_exchange()
        self.memory.keep(acc)
        if self.nonfinite == "skip":
            return self._skip(inp, out, undo)
        self._unbind(undo)
        raise StepError(f"{self.name}: step refused on all ranks, state unchanged: {cause}")

    def _undo_exchange(self):
        """Take back what this step's exchange recorded for later steps (a deadline exchange's
        history) when the step is refused after it ran; nothing here."""

    def _word_dtype(self):
        """int32 for summed words while any sum of per-element counts fits (numel < 2**31)."""
        return np.int32 if self.numel < 2**31 else np.int64

    def _skip(self, inp, out, undo=None):
        """A step skipped on every rank: zero update, nothing else changes (a binding it made is
        taken back, after its output and stats are made where the step ran)."""
        if self.ops is None:
            res = np.zeros(self.numel, dtype=inp.array.dtype) if inp.array is not None else None
        else:
            res = out if out is not None else self.ops.zeros(self.numel, inp.array.dtype)
            self.ops.fill_zero(res)
        self.stats = Stats(iteration=self.iteration, counts=np.zeros(self.nranks, np.int64), selected=0,
                           density=0.0, threshold=None, bounds=None, owned=None,
                           bytes_sent=self.exchange.bytes_sent, bytes_received=self.exchange.bytes_received,
                           seconds={}, skipped=True)
        self._unbind(undo)
        return inp.wrap(res)

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
        """The end of a union step: sum every rank's ``acc[union]`` (bit-identical everywhere),
        ``acc`` becomes the residual with ``union`` zeroed, and the returned buffer holds the sum / P
        at ``union`` (``output="sign"``: its sign), 0 elsewhere. Phase times go into ``sec``.
        ``done``: the device already wrote both (a one-rank step finished behind its pass); only the
        buffers change hands.
        """
        if done:
            return self.memory.commit(acc, out)
        ops, dtype = self.ops, self._dtype
        signs = self.output == "sign"
        with timed(sec, "gather"):
            vals = self._vals_buffer(union.shape[0], dtype)
            ops.gather(acc, union, vals)
        if self._wire is not None:
            # 16-bit values: vals becomes what this rank keeps (the rounding it did), means are shared
            with timed(sec, "reduce"):
                means = self.exchange.mean_wire(vals, self._wire, signs=signs)
                self.check_wire(means)
            with timed(sec, "scatter"):
                res = self.memory.commit(acc, out)
                ops.scatter_wire(res, self.memory.residual, union, means, vals, self._wire)
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
    def _extra_state(self):
        return {}

    def _load_extra_state(self, d):
        pass

    def _check_extra_state(self, d):
        """Raise ``KeyError``/``TypeError``/``ValueError`` if ``_load_extra_state(d)`` could not
        load ``d``; changes nothing (``load_state_dict`` checks every rank before any rank loads)."""

    def _check_residual(self, d):
        """The residual of ``d`` checked against this sparsifier: its dtype, length and finiteness."""
        res = d["residual"]
        if res is None:
            return
        if d["dtype"] is None:
            raise ValueError("a residual without a dtype")
        dtype = np.dtype(d["dtype"])
        if dtype not in (np.float32, np.float64):
            raise ValueError(f"residual dtype {dtype} is not float32 or float64")
        arr = np.asarray(res)
        if arr.shape != (self.numel,):
            raise ValueError(f"residual has shape {arr.shape}, this sparsifier has {self.numel} elements")
        if arr.dtype != dtype:
            raise ValueError(f"residual is {arr.dtype}, the dict says {dtype}")
        if not np.isfinite(arr).all():
            raise ValueError("residual holds non-finite values")

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
        return {
            "name": self.name, "numel": self.numel, "density": self.density, "nranks": self.nranks,
            "rank": self.rank, "options": dict(self.options), "iteration": self.iteration,
            "dtype": None if self._dtype is None else self._dtype.str,
            "grad_dtype": self._grad_dtype,
            "residual": None if not self.memory.held else self.residual,
            **self._extra_state(),
        }

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore ``state_dict()`` output. Collective: every rank loads its own rank's dict.

        All or nothing: every rank checks its whole dict (header, residual, controller, layout,
        extra state) before one agreement; if any rank's dict is wrong, every rank raises the same
        ``ValueError`` naming the ranks and causes, and no rank's state changes.
        """
        problem = None
        try:
            for key, mine in (("name", self.name), ("numel", self.numel), ("nranks", self.nranks),
                              ("rank", self.rank), ("density", self.density)):
                if d[key] != mine:
                    problem = f"state_dict has {key}={d[key]!r}, this sparsifier has {mine!r}"
                    break
            it = int(d["iteration"])
            if problem is None:
                self._check_residual(d)
                self._check_extra_state(d)
        except (KeyError, TypeError, ValueError) as e:
            problem, it = f"state_dict is malformed ({e})", -1
        got = agree_problems(self.exchange, problem, f"{self.name}: load_state_dict refused", [it])
        if (got[:, 0] != got[0, 0]).any():
            raise CollectiveError(f"{self.name}: load_state_dict refused: ranks hold different iterations "
                                  f"{got[:, 0].tolist()}")
        self.exchange.reset_counters()
        self.iteration = it
        # an unbound sparsifier (device="auto", no step yet) keeps the residual on the host until
        # its first gradient names the device (binding it to the CPU here would refuse CUDA input)
        self.memory.load(self.ops, d["dtype"], d["residual"])
        # older dicts lack "grad_dtype": the residual's dtype then fixes what a gradient computes in
        self._grad_dtype = d.get("grad_dtype") if d["residual"] is not None else None
        self._load_extra_state(d)


def _restore(now, then, keeps):
    """Make the attribute dict ``now`` what ``then`` was, but for the names in ``keeps``; no name that
    both hold is ever missing on the way (another thread may read one)."""
    for k in [k for k in now if k not in then and k not in keeps]:
        del now[k]
    for k, v in then.items():
        if k not in keeps:
            now[k] = v


def _names_where(capability):
    """The names of the sparsifier classes whose ``CAPABILITIES`` has ``capability`` true."""
    names, todo = set(), [Sparsifier]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if getattr(cls.CAPABILITIES, capability) and cls.name != "base":
            names.add(cls.name)
    return sorted(names)


def _wire_half_names():
    """The names of the sparsifier classes whose values can travel in 16 bits."""
    return _names_where("wire_half")


def _device_step_names():
    """The names of the sparsifier classes with a CUDA step."""
    return _names_where("device_step")
