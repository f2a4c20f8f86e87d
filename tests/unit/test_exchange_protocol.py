"""``transport.ExchangeProtocol`` lists every exchange member the package uses, the host ``Exchange``
satisfies it, and its ``ByteCounter`` counts by the ring model. (The device exchange's side:
tests/cudasim/test_device_transport.py.)"""
import re
from pathlib import Path

import numpy as np
from mpi4py import MPI

from exdyna_mpi.transport import ByteCounter, Exchange, ExchangeProtocol

ROOT = Path(__file__).resolve().parents[2]
#: how the package names an exchange it holds: a sparsifier's ``exchange``, an adapter's ``_exchange``,
#: the group transport's ``xch``
USE = re.compile(r"\b(?:exchange|_exchange|xch)\.([A-Za-z_]\w*)")


def _protocol_members():
    names = set(ExchangeProtocol.__annotations__)
    names |= {k for k in vars(ExchangeProtocol) if not k.startswith("_")}
    return names


def test_the_protocol_lists_every_member_the_package_uses():
    used = {}
    for path in sorted((ROOT / "exdyna_mpi").rglob("*.py")):
        for name in USE.findall(path.read_text()):
            if name != "py":   # the module exchange.py named in docstrings
                used.setdefault(name, path.relative_to(ROOT).as_posix())
    assert {"agree", "sum_words", "allgatherv", "bytes"} <= set(used), "the scan found no uses: it is broken"
    missing = {n: where for n, where in used.items() if n not in _protocol_members()}
    assert not missing, f"exchange members used but not in transport.ExchangeProtocol: {missing}"


def test_the_host_exchange_satisfies_the_protocol():
    x = Exchange(MPI.COMM_SELF)
    assert isinstance(x, ExchangeProtocol) and isinstance(x.bytes, ByteCounter)
    assert not isinstance(object(), ExchangeProtocol)
    for name in _protocol_members():
        assert hasattr(x, name), name


def test_the_byte_counter_follows_the_ring_model():
    c = ByteCounter(rank=1, size=4)
    c.allgather(np.array([3, 5, 2, 7]), 8)          # all but its own (5) in, all but its successor's (2) out
    assert (c.sent, c.received) == ((17 - 2) * 8, (17 - 5) * 8)
    c.reset()
    c.reduce(100, 4)                                # 2 (P - 1) / P of 400 bytes each way
    assert (c.sent, c.received) == (600, 600)
    c.add(3, 9)
    assert (c.sent, c.received) == (603, 609)
    one = ByteCounter(rank=0, size=1)
    one.allgather([4], 8)
    one.reduce(10, 8)
    assert (one.sent, one.received) == (0, 0)       # nothing crosses a link with one rank


def test_the_exchanges_counters_read_its_byte_counter():
    x = Exchange(MPI.COMM_SELF)
    x.bytes.add(5, 7)
    assert (x.bytes_sent, x.bytes_received) == (5, 7)
    x.reset_counters()
    assert (x.bytes_sent, x.bytes_received) == (0, 0)
