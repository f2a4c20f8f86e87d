"""The configuration of a torch entry point: agreed by every rank at construction, recorded in its
state dicts, compared at every load.

Every option that changes the bits a rank computes (the sparsifier and its options, the training
recipe, the Adam path, the optimizer's hyperparameters, DiLoCo's period and outer optimizer, the
flat layout of the parameters and the model's buffers) is written as one text item. Construction
runs the entry point's checks on each rank (no communication, no side effect), then one agreement:
a problem on any rank, or ranks whose items differ, raise the same ``CollectiveError`` on every
rank, naming the ranks and the items, before any broadcast or other collective could meet
mismatched buffers. Only then does the entry point touch the model or the optimizer.

A state dict records the items that define the run (``EntryConfig.recorded``: not the learning
rate, which schedulers move, nor whether rank 0 broadcasts at construction); a load compares them
with the configuration built, so a checkpoint resumes only into the run that wrote it.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, TypeVar

from exdyna_mpi import transport
from exdyna_mpi._errors import CollectiveError
from exdyna_mpi.transport import watchdog

from ._torch_common import _torch

__all__ = ["CONFIG_KEY", "EntryConfig", "agree_entry", "layout_text", "optimizer_items", "text"]

#: where a state dict records the configuration that wrote it
CONFIG_KEY = "exdyna_config"
T = TypeVar("T")


def text(value: Any) -> str:
    """``value`` as a canonical text: floats exact (``repr``), tensors by their values and dtype."""
    torch = _torch()
    if isinstance(value, torch.Tensor):
        return f"tensor({value.detach().cpu().tolist()!r}, {value.dtype})"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(text(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {text(value[k])}" for k in sorted(value, key=str)) + "}"
    return repr(value)


def _crc(s: str) -> int:
    b = s.encode()
    return (zlib.crc32(b) | (zlib.adler32(b) << 32)) & 0x7FFFFFFFFFFFFFFF


def layout_text(tensors: Iterable[Any]) -> str:
    """The count, size, dtypes and a digest of the shapes of ``tensors`` (in order): equal texts,
    equal layouts; short enough for a message."""
    ts = list(tensors)
    shapes = ";".join(f"{tuple(t.shape)}:{t.dtype}" for t in ts)
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in ts})
    return (f"{len(ts)} tensors, {sum(t.numel() for t in ts)} elements, {'/'.join(dtypes) or '-'}, "
            f"shapes {_crc(shapes):016x}")


def optimizer_items(optimizer: Any, prefix: str = "optimizer") -> dict[str, str]:
    """The optimizer's class and every param group's hyperparameters and size, as items."""
    items = {prefix: f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"}
    for i, g in enumerate(optimizer.param_groups):
        items[f"{prefix}.group{i}.params"] = str(len(g["params"]))
        for k in sorted(g):
            if k != "params":
                items[f"{prefix}.group{i}.{k}"] = text(g[k])
    return items


@dataclass(frozen=True, eq=False)
class EntryConfig:
    """The items of one entry point's configuration.

    Attributes:
        who: the entry point's name, for messages.
        items: item name -> canonical text; agreed at construction.
        recorded: the names a state dict records and a load compares.
    """

    who: str
    items: Mapping[str, str]
    recorded: tuple[str, ...]

    @classmethod
    def of(cls, who: str, items: Mapping[str, str], unrecorded: Iterable[str] = ()) -> EntryConfig:
        """A configuration recording every item but ``unrecorded`` and the optimizers' param groups
        (agreed at construction; a load takes the groups from the optimizer's own dict, and
        schedulers move ``lr``, ``momentum`` and ``betas`` during a run)."""
        skip = set(unrecorded)
        recorded = tuple(k for k in sorted(items) if k not in skip and ".group" not in k)
        return cls(who, dict(items), recorded)

    def fingerprint(self) -> int:
        return _crc("\n".join(f"{k}={self.items[k]}" for k in sorted(self.items)))

    def record(self) -> dict[str, str]:
        """What a state dict holds under ``CONFIG_KEY`` (plain strings: ``weights_only`` safe)."""
        return {k: self.items[k] for k in self.recorded}

    def mismatch(self, saved: Any) -> str | None:
        """This rank's problem with a dict's recorded configuration (None: it is this one's)."""
        if not isinstance(saved, Mapping) or not all(isinstance(v, str) for v in saved.values()):
            return (f"the dict records no configuration (no {CONFIG_KEY!r}): it was not written by this "
                    f"version's {self.who}.state_dict(), so it cannot be checked against this run")
        mine = self.record()
        keys = [k for k in sorted(set(saved) | set(mine)) if saved.get(k) != mine.get(k)]
        if not keys:
            return None
        parts = [f"{k}={saved.get(k, '<none>')} (this run: {mine.get(k, '<none>')})" for k in keys[:4]]
        more = f" and {len(keys) - 4} more" if len(keys) > 4 else ""
        return "the dict was saved by another configuration: " + ", ".join(parts) + more


def _differences(configs: list[Mapping[str, str]]) -> str:
    """The items on which the ranks' configurations differ, each with every rank's value."""
    keys = sorted({k for c in configs for k in c})
    diff = [k for k in keys if any(c.get(k) != configs[0].get(k) for c in configs)]
    parts = []
    for k in diff[:4]:
        vals = ", ".join(f"rank {r}: {c.get(k, '<none>')}" for r, c in enumerate(configs))
        parts.append(f"{k} ({vals})")
    more = f"; and {len(diff) - 4} more items" if len(diff) > 4 else ""
    return "; ".join(parts) + more


def agree_entry(comm: Any, who: str, plan: Callable[[], tuple[T, EntryConfig]]) -> tuple[T, EntryConfig]:
    """Run ``plan()`` on this rank (checks only: no communication, nothing changed), then agree.
    Collective over ``comm``.

    Args:
        comm: the entry point's communicator.
        who: the entry point's name, for messages.
        plan: returns ``(what the entry point builds from, its configuration)``; raises
            ``ValueError``/``TypeError``/``RuntimeError`` for a problem on this rank.

    Returns:
        ``plan()``'s result, the same configuration on every rank.

    Raises:
        CollectiveError: on every rank, when any rank's ``plan`` raised (each named with its
            problem) or the ranks' configurations differ (each differing item named with every
            rank's value).
    """
    problem: str | None = None
    config: EntryConfig | None = None
    try:
        value, config = plan()
    except (ValueError, TypeError, RuntimeError) as e:
        problem = str(e) or type(e).__name__
    # the bound on every later wait: a bad EXDYNA_TIMEOUT_S on one rank is refused here, on every rank
    problem = problem or watchdog.timeout_problem()
    exchange = transport.Exchange(comm)
    got = transport.agree_problems(exchange, problem, f"{who}: refused on every rank",
                                   [0 if config is None else config.fingerprint()])
    assert config is not None   # agree_problems raised on every rank otherwise
    if (got[:, 0] != got[0, 0]).any():
        every = exchange.gather_objects(dict(config.items))
        raise CollectiveError(f"{who}: the ranks disagree on the configuration (every rank must build the "
                              f"same): {_differences(every)}")
    return value, config
