"""A testbed's links: what they are (``Testbed``, ``RankLink``), tbf's bucket on each (``burst_bytes``),
and the bounded TCP transfers between two of the testbed's namespaces that measure them
(``measure_link``, ``measure_message``, ``check``); ``TestbedError``, which every testbed operation raises.

jobs/testbed.py makes, loads and removes a testbed and launches on it; it re-exports these names,
so ``testbed.check(tb)`` is this module's ``check``.

Example::

    import testbed
    tb = testbed.load()
    print(testbed.check(tb))                                   # each rank's link, Mbit/s
    print(testbed.measure_message(tb, 0, 1, nbytes=45_000))    # seconds after an idle moment
"""
import dataclasses
import subprocess
import sys


class TestbedError(RuntimeError):
    """A testbed operation that cannot go on (no privilege, a command that failed, no testbed)."""


@dataclasses.dataclass(frozen=True)
class RankLink:
    rank: int
    netns: str
    addr: str
    rate_mbit: float
    burst_bytes: int = 0       # tbf's bucket on both ends of the link (0: not recorded)


@dataclasses.dataclass(frozen=True)
class Testbed:
    prefix: str
    iface: str                 # the interface's name inside every namespace
    bridge: str
    rate_mbit: float           # the rate asked for with --rate
    ranks: tuple               # RankLink per rank

    def record(self):
        """The JSON line ``up`` prints."""
        return {"ranks": [{"rank": r.rank, "netns": r.netns, "addr": r.addr, "rate_mbit": r.rate_mbit,
                           "burst_bytes": r.burst_bytes} for r in self.ranks],
                "rate_mbit": self.rate_mbit, "iface": self.iface, "prefix": self.prefix}


def burst_bytes(rate_mbit):
    """tbf's bucket for a link of ``rate_mbit``: 2 KiB (an MTU-sized frame fits), or a quarter
    millisecond of the rate where that is more.

    Whatever the bucket holds after an idle moment crosses at the veth's speed, not at the rate, so
    a message no larger than the bucket goes for free. A large bucket flatters every method whose
    exchange is small. With the 256 KiB bucket used until 2026-11-28, 300 kB after idle took 21 ms at
    20 Mbit/s instead of 120 ms; with the 16 KiB bucket that replaced it, a 15 kB exchange (ExDyna's
    on the CNN) took 0.4 ms instead of 6 ms, and 45 kB 12.6 ms instead of 18. With 2 KiB they take
    5.7 and 18.3 ms, and a stream keeps 19.1 Mbit/s of payload at 20 Mbit/s, 188 at 200 (the rest is
    TCP/IP headers, which the link carries too). At 1 Gbit/s a quarter millisecond is 31 kB; a
    32 KiB bucket kept a stream at 936–941 Mbit/s, a 16 KiB one at 899–933: below that the timer
    cannot refill the bucket in time (2-core Intel Xeon VM, 2026-11-28).
    """
    return max(2 * 1024, int(rate_mbit * 1e6 / 8 * 0.00025))


_SINK = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(float(sys.argv[3]))
print("ready", flush=True)
c, _ = s.accept(); c.settimeout(float(sys.argv[3]))
buf = bytearray(1 << 20); n = 0; t0 = t1 = None
while True:
    k = c.recv_into(buf)
    if not k:
        break
    t1 = time.perf_counter()
    if t0 is None:
        t0, k = t1, 0          # time from the first byte: the count below starts after it
    n += k
print(n, (t1 - t0) if t0 is not None else 0.0, flush=True)
"""

_SOURCE = r"""
import socket, sys, time
n, limit = int(sys.argv[3]), float(sys.argv[4])
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=limit)
chunk = b"\0" * (1 << 20); sent = 0; t_end = time.monotonic() + limit
while sent < n and time.monotonic() < t_end:
    sent += c.send(chunk[: min(len(chunk), n - sent)])
c.close()
"""


def _between(tb, src, dst, what, port, sink, sink_args, source, source_args, limit):
    """Start ``sink`` in rank ``dst``'s namespace and, once it prints "ready", run ``source`` in rank
    ``src``'s; each script gets the receiver's address and ``port``, then its own arguments, and
    each is bounded by ``limit`` seconds (plus 5). Returns ``(sink_stdout, sink_stderr, source)``,
    ``source`` the finished ``subprocess.CompletedProcess``; the sink never outlives the call."""
    a, b = tb.ranks[src], tb.ranks[dst]
    receiver = subprocess.Popen(["ip", "netns", "exec", b.netns, sys.executable, "-c", sink, b.addr, str(port),
                                 *map(str, sink_args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if receiver.stdout.readline().strip() != "ready":
            raise TestbedError(f"{what}: the receiver in {b.netns} did not start: {receiver.stderr.read()}")
        sent = subprocess.run(["ip", "netns", "exec", a.netns, sys.executable, "-c", source, b.addr, str(port),
                               *map(str, source_args)], capture_output=True, text=True, timeout=limit + 5)
        out, err = receiver.communicate(timeout=limit + 5)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    return out, err, sent


def measure_link(tb, src, dst, seconds=2.0, port=5201):
    """Mbit/s of one TCP stream from rank ``src`` to rank ``dst``: at most ``seconds`` of the link's
    set rate in bytes (plus the bucket), sent within ``3 * seconds + 5`` seconds, timed at the
    receiver from its first byte to its last."""
    rate = min(tb.ranks[src].rate_mbit, tb.ranks[dst].rate_mbit)
    nbytes = int(rate * 1e6 / 8 * seconds) + 2 * burst_bytes(rate)
    limit = 3 * seconds + 5
    out, err, sent = _between(tb, src, dst, "link check", port, _SINK, [limit], _SOURCE, [nbytes, limit], limit)
    if sent.returncode != 0:
        raise TestbedError(f"link check {src}->{dst}: the sender failed (rc {sent.returncode}): "
                           f"{sent.stderr.strip()[-300:]}")
    try:
        got, secs = out.split()
        got, secs = int(got), float(secs)
    except ValueError:
        raise TestbedError(f"link check {src}->{dst}: the receiver said {out!r} {err!r}") from None
    return got * 8 / secs / 1e6 if secs > 0 else 0.0


_MSG_SINK = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(float(sys.argv[5]))
print("ready", flush=True)
c, _ = s.accept(); c.settimeout(float(sys.argv[5]))
buf = bytearray(1 << 20)
for _ in range(int(sys.argv[4])):
    n = 0
    while n < int(sys.argv[3]):
        k = c.recv_into(buf)
        if not k:
            sys.exit(1)
        n += k
    c.sendall(b"k")
"""

_MSG_SOURCE = r"""
import socket, sys, time
nbytes, reps, limit, idle = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6])
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=limit)
data = b"\0" * nbytes; took = []
for _ in range(reps):
    time.sleep(idle)
    t = time.perf_counter(); c.sendall(data); c.recv(1); took.append(time.perf_counter() - t)
print(" ".join(repr(v) for v in took))
"""


def measure_message(tb, src, dst, nbytes, reps=3, idle_s=0.5, port=5202):
    """Seconds one message of ``nbytes`` takes from rank ``src`` to rank ``dst`` after ``idle_s`` of
    silence (the bucket full), to the receiver's one-byte reply; ``reps`` times on one connection.
    A link of rate R needs at least ``nbytes * 8 / R``: a message much faster than that crossed in
    the bucket, and a benchmark on it would flatter small exchanges."""
    rate = min(tb.ranks[src].rate_mbit, tb.ranks[dst].rate_mbit)
    limit = reps * (idle_s + 2 * nbytes * 8 / (rate * 1e6)) + 10
    _, _, sent = _between(tb, src, dst, "message check", port, _MSG_SINK, [nbytes, reps, limit],
                       _MSG_SOURCE, [nbytes, reps, limit, idle_s], limit)
    try:
        took = [float(v) for v in sent.stdout.split()]
    except ValueError:
        took = []
    if sent.returncode != 0 or len(took) != reps:
        raise TestbedError(f"message check {src}->{dst}: the sender said {sent.stdout!r} "
                           f"{sent.stderr.strip()[-300:]!r}")
    return took


def check(tb, seconds=2.0):
    """Each rank's link measured by one stream to the next rank (rank P-1 to rank 0), one at a time:
    ``{"set_mbit": R, "measured_mbit": [...]}`` in rank order (the sender's link)."""
    if len(tb.ranks) < 2:
        raise TestbedError("check needs at least 2 ranks")
    P = len(tb.ranks)
    measured = [round(measure_link(tb, r, (r + 1) % P, seconds), 1) for r in range(P)]
    return {"set_mbit": tb.rate_mbit, "measured_mbit": measured,
            "rates_mbit": [r.rate_mbit for r in tb.ranks], "burst_bytes": [r.burst_bytes for r in tb.ranks]}
