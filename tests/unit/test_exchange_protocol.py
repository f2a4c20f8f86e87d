"""The exchange roles: ``transport.ExchangeProtocol`` lists every collective the package asks of an
exchange, ``transport.PointToPointProtocol`` Ok-Topk's rounds (used by oktopk.py alone); the host
``Exchange`` and the device exchange satisfy both, with the protocols' parameters. Every transport
owns one ``ByteCounter``, which counts by the ring model and is the only source of its byte figures.
(More of the device exchange: tests/cudasim/test_device_transport.py.)"""
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from exdyna_mpi.transport import (ByteCounter, DeadlineTransport, Exchange, ExchangeProtocol, PointToPointProtocol,
                                  point_to_point)
from exdyna_mpi.transport.group import GroupTransport
from tests.launch import child_env

ROOT = Path(__file__).resolve().parents[2]
#: how the package names an exchange it holds: a sparsifier's ``exchange``, an adapter's ``_exchange``,
#: the group transport's ``xch``
USE = re.compile(r"\b(?:exchange|_exchange|xch)\.([A-Za-z_]\w*)")
#: how oktopk.py names its exchange in the point-to-point role (``point_to_point(self.exchange)``)
P2P_USE = re.compile(r"\bp2p\.([A-Za-z_]\w*)")
OKTOPK = "exdyna_mpi/sparsifiers/baselines/oktopk.py"


def members(proto):
    names = set(getattr(proto, "__annotations__", {}))
    names |= {k for k in vars(proto) if not k.startswith("_")}
    return names


def signature_problems(impl, proto):
    """The methods of ``proto`` that ``impl`` lacks or declares with other parameters (names, kinds,
    defaults; the annotations are the protocol's to state)."""
    bad = []
    for name, want in vars(proto).items():
        if name.startswith("_") or not inspect.isfunction(want):
            continue
        got = getattr(impl, name, None)
        if got is None:
            bad.append(f"{name}: missing")
            continue
        shape = [(p.name, p.kind, p.default) for p in list(inspect.signature(want).parameters.values())[1:]]
        if [(p.name, p.kind, p.default) for p in inspect.signature(got).parameters.values()] != shape:
            bad.append(f"{name}: {inspect.signature(got)} != {inspect.signature(want)}")
    return bad


def _uses(pattern):
    """{member: first file that uses it} for the uses ``pattern`` finds in the package."""
    used = {}
    for path in sorted((ROOT / "exdyna_mpi").rglob("*.py")):
        for name in pattern.findall(path.read_text()):
            if name != "py":   # the module exchange.py named in docstrings
                used.setdefault(name, path.relative_to(ROOT).as_posix())
    return used


def test_the_core_protocol_lists_every_member_the_package_uses():
    used = _uses(USE)
    assert {"agree", "sum_words", "allgatherv", "bytes"} <= set(used), "the scan found no uses: it is broken"
    missing = {n: where for n, where in used.items() if n not in members(ExchangeProtocol)}
    assert not missing, f"exchange members used but not in transport.ExchangeProtocol: {missing}"


def test_the_point_to_point_rounds_are_oktopks_alone():
    """Ok-Topk's rounds are a protocol of their own, apart from the collectives every sparsifier
    uses: only oktopk.py calls them (outside the transport layer), through ``point_to_point``."""
    p2p = members(PointToPointProtocol)
    assert p2p == {"alltoall_counts", "rotating_rounds"}
    assert not p2p & members(ExchangeProtocol)
    callers = {}
    for path in sorted((ROOT / "exdyna_mpi").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("exdyna_mpi/transport/"):
            continue
        for name in p2p:
            if re.search(rf"\.{name}\(", path.read_text()):
                callers.setdefault(name, set()).add(rel)
    assert callers == {name: {OKTOPK} for name in p2p}, callers
    used = _uses(P2P_USE)
    assert set(used) == p2p and set(used.values()) == {OKTOPK}, used


def test_the_host_exchange_satisfies_both_protocols():
    x = Exchange(MPI.COMM_SELF)
    assert isinstance(x, ExchangeProtocol) and isinstance(x, PointToPointProtocol)
    assert isinstance(x.bytes, ByteCounter)
    assert not isinstance(object(), ExchangeProtocol) and not isinstance(object(), PointToPointProtocol)
    for name in members(ExchangeProtocol) | members(PointToPointProtocol):
        assert hasattr(x, name), name
    assert not signature_problems(x, ExchangeProtocol), signature_problems(x, ExchangeProtocol)
    assert not signature_problems(x, PointToPointProtocol), signature_problems(x, PointToPointProtocol)
    assert point_to_point(x) is x
    with pytest.raises(TypeError, match="point-to-point"):
        point_to_point(object())


#: run in a child under the CUDA simulator, so this process's arrays backend stays the host's
_DEVICE_CHECK = """
import json
from mpi4py import MPI
from exdyna_mpi.transport import ExchangeProtocol, PointToPointProtocol, device
from tests.unit.test_exchange_protocol import signature_problems
x = device.DeviceExchange(MPI.COMM_SELF, cuda_aware=False)
print(json.dumps([isinstance(x, ExchangeProtocol), isinstance(x, PointToPointProtocol),
                  signature_problems(x, ExchangeProtocol) + signature_problems(x, PointToPointProtocol)]))
"""


def test_the_device_exchange_satisfies_both_protocols():
    p = subprocess.run([sys.executable, "-c", _DEVICE_CHECK], cwd=ROOT, env=child_env({"NUMBA_ENABLE_CUDASIM": "1"}),
                       capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    core, p2p, problems = json.loads(p.stdout.strip().splitlines()[-1])
    assert core and p2p and not problems, problems


def test_the_byte_counter_follows_the_ring_model():
    c = ByteCounter(rank=1, size=4)
    c.allgather(np.array([3, 5, 2, 7]), 8)          # all but its own (5) in, all but its successor's (2) out
    assert (c.sent, c.received) == ((17 - 2) * 8, (17 - 5) * 8)
    c.reset()
    c.reduce(100, 4)                                # 2 (P - 1) / P of 400 bytes each way
    assert (c.sent, c.received) == (600, 600)
    c.add(3, 9)
    assert (c.sent, c.received) == (603, 609)
    other = ByteCounter(rank=0, size=4)
    other.add(10, 20)
    c.add_from(other)
    assert (c.sent, c.received) == (613, 629) and (other.sent, other.received) == (10, 20)
    one = ByteCounter(rank=0, size=1)
    one.allgather([4], 8)
    one.reduce(10, 8)
    assert (one.sent, one.received) == (0, 0)       # nothing crosses a link with one rank


@pytest.mark.parametrize("make", [lambda: Exchange(MPI.COMM_SELF), lambda: GroupTransport(MPI.COMM_SELF),
                                  lambda: DeadlineTransport(MPI.COMM_SELF, 4)],
                         ids=["Exchange", "GroupTransport", "DeadlineTransport"])
def test_every_transport_reports_its_one_byte_counter(make):
    t = make()
    try:
        assert type(t.bytes) is ByteCounter
        t.bytes.add(5, 7)
        assert (t.bytes_sent, t.bytes_received) == (5, 7)
        for name in ("bytes_sent", "bytes_received"):
            with pytest.raises(AttributeError):
                setattr(t, name, 0)             # read-only: only the counter's methods change them
        assert (t.bytes_sent, t.bytes_received) == (5, 7)
        t.reset_counters()
        assert (t.bytes_sent, t.bytes_received) == (0, 0) == (t.bytes.sent, t.bytes.received)
    finally:
        if isinstance(t, DeadlineTransport):
            t.close()


def test_the_group_transport_counts_its_collectives_in_its_own_counter():
    t = GroupTransport(MPI.COMM_SELF)
    assert t.xch.bytes is t.bytes
    t.open(need_async=False)
    try:
        assert t.xch.bytes is t.bytes and t.xch.comm is t.private
        t.xch.bytes.add(4, 6)
        assert (t.bytes_sent, t.bytes_received) == (4, 6)
    finally:
        t.free()
