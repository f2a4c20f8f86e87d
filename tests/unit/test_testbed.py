"""jobs/testbed.py: namespaces behind shaped links, MPI and gloo across them, and clean-up.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2; skipped, saying which, where either is
missing. Everything these tests make carries the prefix ``xdyt`` (not the default ``xdyna``, so a
benchmark's testbed is never touched) and is removed at the end, also when a test fails.
"""
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.launch import MPIEXEC, ROOT, child_env

SCRIPT = os.path.join(ROOT, "jobs", "testbed.py")
PROBE = os.path.join(ROOT, "tests", "testbed_probe.py")
PREFIX = "xdyt"

_spec = importlib.util.spec_from_file_location("exdyna_jobs_testbed", SCRIPT)
testbed = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(testbed)


def _why_not():
    try:
        testbed.require_privilege()
    except testbed.TestbedError as e:
        return str(e)
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=f"testbed unavailable: {_why_not()}")


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, SCRIPT, "--prefix", PREFIX, *args], capture_output=True, text=True,
                          timeout=timeout, env=child_env())


def leftovers():
    spaces, links = testbed.existing(PREFIX)
    return spaces + links


@pytest.fixture
def clean():
    testbed.down(PREFIX)
    yield
    testbed.down(PREFIX)
    assert leftovers() == []


def test_up_check_down_at_two_ranks(clean):
    p = cli("up", "--ranks", "2", "--rate", "100")
    assert p.returncode == 0, p.stderr
    rec = json.loads(p.stdout)
    assert rec["rate_mbit"] == 100
    assert [(r["rank"], r["netns"], r["addr"]) for r in rec["ranks"]] == \
        [(0, "xdyt-r0", "198.18.0.1"), (1, "xdyt-r1", "198.18.0.2")]
    assert sorted(leftovers()) == ["xdyt-r0", "xdyt-r1", "xdytbr", "xdytv0", "xdytv1"]
    # no route out of a namespace: only the testbed's own /24
    routes = subprocess.run(["ip", "-n", "xdyt-r0", "-4", "route", "show"], capture_output=True, text=True).stdout
    assert "default" not in routes and routes.split()[0] == "198.18.0.0/24", routes
    # the bridge holds the testbed's veths and nothing else
    ports = subprocess.run(["ip", "-o", "link", "show", "master", "xdytbr"], capture_output=True, text=True).stdout
    assert sorted(line.split(":")[1].strip().split("@")[0] for line in ports.splitlines()) == ["xdytv0", "xdytv1"]

    p = cli("check", "--seconds", "1.5")
    assert p.returncode == 0, p.stderr
    rec = json.loads(p.stdout)
    assert rec["set_mbit"] == 100 and len(rec["measured_mbit"]) == 2
    for m in rec["measured_mbit"]:
        assert 90 <= m <= 110, rec          # within 10 % of the set rate, both ways

    p = cli("down")
    assert p.returncode == 0, p.stderr
    assert sorted(json.loads(p.stdout)["removed"]) == ["xdyt-r0", "xdyt-r1", "xdytbr", "xdytv0", "xdytv1"]
    assert leftovers() == []
    assert cli("check").returncode == 2      # nothing up: a clear error, not a traceback


def test_rate_of_one_rank_is_slower(clean):
    tb = testbed.up(2, 200, rate_of={1: 50}, prefix=PREFIX)
    assert [r.rate_mbit for r in tb.ranks] == [200, 50]
    fast, slow = testbed.measure_link(tb, 0, 1, seconds=1.0), testbed.measure_link(tb, 1, 0, seconds=1.0)
    assert 45 <= slow <= 55, slow
    assert 45 <= fast <= 55, fast            # rank 1 also receives at its own rate


def test_a_message_after_idle_crosses_at_the_link_s_rate(clean):
    # A real link sends nothing faster than its rate. tbf lets its bucket through at the veth's speed
    # after idle, so the bucket must be small beside the messages a benchmark sends: with the
    # 256 KiB bucket of old, 300 kB took a sixth of its time at 20 Mbit/s; with 16 KiB, a 15 kB
    # exchange (ExDyna's on the CNN) took a fifteenth.
    tb = testbed.up(2, 20, prefix=PREFIX)
    assert [r.burst_bytes for r in tb.ranks] == [2 * 1024] * 2
    assert testbed.check(tb, seconds=1.0)["burst_bytes"] == [2 * 1024] * 2
    for nbytes in (15_000, 300_000):
        ideal = nbytes * 8 / 20e6
        took = testbed.measure_message(tb, 0, 1, nbytes, reps=2, idle_s=0.3)
        assert len(took) == 2
        for t in took:
            assert 0.85 * ideal <= t <= 2.0 * ideal + 0.005, (nbytes, took, ideal)
    assert testbed.burst_bytes(20) == 2048 and testbed.burst_bytes(200) == 6250
    assert testbed.burst_bytes(1000) == 31250 and testbed.burst_bytes(10_000) == 312500


def test_bad_arguments_are_refused_and_leave_nothing(clean):
    p = cli("up", "--ranks", "2", "--rate", "100", "--rate-of", "5=10")
    assert p.returncode == 2 and "rank 5" in p.stderr
    p = cli("up", "--ranks", "2", "--rate", "-1")
    assert p.returncode == 2 and "positive" in p.stderr
    assert leftovers() == []


def test_without_privilege_the_message_names_the_capability(monkeypatch):
    monkeypatch.setattr(testbed, "_capabilities", lambda: 0)
    with pytest.raises(testbed.TestbedError, match="CAP_NET_ADMIN"):
        testbed.up(2, 100, prefix=PREFIX)
    assert leftovers() == []


def test_up_replaces_a_stale_testbed(clean):
    testbed.up(3, 100, prefix=PREFIX)
    tb = testbed.up(2, 100, prefix=PREFIX)
    assert len(tb.ranks) == 2
    assert sorted(leftovers()) == ["xdyt-r0", "xdyt-r1", "xdytbr", "xdytv0", "xdytv1"]


def test_down_leaves_names_it_did_not_make(clean):
    """Only the exact names the testbed gives are removed: namespaces and links that merely share
    the prefix (another tool's, a rank number the testbed never writes) survive ``down``."""
    others = ["xdyt-rx", "xdyt-r01", "xdyt-r9999"]
    made = []
    try:
        for ns in others:
            subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
            made.append(ns)
        subprocess.run(["ip", "link", "add", "xdytvx", "type", "veth", "peer", "name", "xdytvy"], check=True,
                       capture_output=True)
        made.append("link:xdytvx")
        testbed.up(2, 100, prefix=PREFIX)
        p = cli("down")
        assert p.returncode == 0, p.stderr
        spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        assert all(ns in spaces for ns in others), f"down removed another tool's namespace: {spaces}"
        assert "xdytvx" in links, "down removed another tool's link"
        assert leftovers() == [], f"down left its own: {leftovers()}"
    finally:
        for m in made:
            if m.startswith("link:"):
                subprocess.run(["ip", "link", "del", m[5:]], capture_output=True)
            else:
                subprocess.run(["ip", "netns", "del", m], capture_output=True)


def test_state_file_lives_in_a_private_directory(clean, tmp_path, monkeypatch):
    testbed.up(1, 100, prefix=PREFIX)
    d = os.path.dirname(testbed.state_path(PREFIX))
    st = os.stat(d)
    assert os.path.exists(testbed.state_path(PREFIX)) and st.st_uid == os.geteuid() and not st.st_mode & 0o077, \
        f"{d}: mode {oct(st.st_mode)}"
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("EXDYNA_TESTBED_STATE_DIR", str(shared))
    with pytest.raises(testbed.TestbedError, match="writable by no one else"):
        testbed.state_path(PREFIX)


def test_down_after_a_killed_run_removes_everything(clean):
    """A job killed mid-run (SIGKILL to the launcher) leaves ranks running in the namespaces; down
    kills them and removes every namespace and link."""
    if MPIEXEC is None:
        pytest.skip("no mpiexec on PATH")
    tb = testbed.up(2, 100, prefix=PREFIX)
    argv, env = testbed.mpiexec_command(tb, [sys.executable, "-c", "import time; time.sleep(60)"],
                                        mpiexec=MPIEXEC)
    job = subprocess.Popen(argv, env={**child_env(), **{k: v for k, v in env.items() if k not in os.environ}},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not all(subprocess.run(["ip", "netns", "pids", r.netns], capture_output=True, text=True).stdout.strip()
                      for r in tb.ranks):
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.1)
        os.kill(job.pid, signal.SIGKILL)
        job.wait(timeout=10)
        assert leftovers(), "the killed run should have left its testbed"
        p = cli("down")
        assert p.returncode == 0, p.stderr
        assert leftovers() == []
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)


@pytest.mark.parametrize("gloo", [False, True], ids=["mpi_only", "with_gloo"])
def test_allreduce_across_namespaces(clean, gloo):
    """Two ranks, each in its own namespace: MPI's Allreduce (and gloo's all_reduce) give the exact
    sums, and their bytes leave through the rank's shaped interface."""
    if MPIEXEC is None:
        pytest.skip("no mpiexec on PATH")
    if gloo:
        pytest.importorskip("torch", reason="PyTorch is not installed")
    tb = testbed.up(2, 1000, prefix=PREFIX)
    argv, env = testbed.mpiexec_command(tb, [sys.executable, "-m", "mpi4py", PROBE], mpiexec=MPIEXEC)
    env = {**child_env(), **{k: env[k] for k in testbed.rank_env(tb, testbed.mpi_flavor(MPIEXEC))},
           "PROBE_GLOO": "1" if gloo else "0"}
    p = subprocess.run(["timeout", "-k", "5", "120", *argv], env=env, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    recs = json.loads(next(line for line in p.stdout.splitlines() if line.startswith("[")))
    assert [r["rank"] for r in recs] == [0, 1]
    assert [r["addr"] for r in recs] == ["198.18.0.1", "198.18.0.2"]
    for r in recs:
        assert r["size"] == 2 and r["mpi_ok"], r
        assert r["mpi_tx_bytes"] >= r["payload_bytes"] // 2, r     # at least half the buffer crossed the link
        if gloo:
            assert r["gloo_ok"] and r["gloo_tx_bytes"] >= r["payload_bytes"] // 2, r


def test_rank_env_for_both_mpis(clean):
    tb = testbed.up(2, 100, prefix=PREFIX)
    mpich = testbed.rank_env(tb, "mpich")
    assert mpich["MPIR_CVAR_NOLOCAL"] == "1" and mpich["FI_TCP_IFACE"] == "xdyt0"
    ompi = testbed.rank_env(tb, "openmpi")
    assert ompi["OMPI_MCA_btl"] == "tcp,self" and ompi["OMPI_MCA_btl_tcp_if_include"] == "xdyt0"
    for env in (mpich, ompi):
        assert env["MASTER_ADDR"] == "198.18.0.1" and env["GLOO_SOCKET_IFNAME"] == "xdyt0"
    argv, _ = testbed.mpiexec_command(tb, ["python", "x.py"], ["-l"], mpiexec=MPIEXEC or "mpiexec", flavor="mpich")
    assert argv[1:] == ["-l", "-n", "1", "ip", "netns", "exec", "xdyt-r0", "python", "x.py", ":",
                        "-n", "1", "ip", "netns", "exec", "xdyt-r1", "python", "x.py"]
    assert shutil.which("ip")


# Run in a rank's namespace: argv is the seconds each phase may take, the namespace's interface,
# its own IPv4 address, the MACs of the host's links (the bridge, its ports), then ``ADDR|PORT``
# targets. Phase 1: every TCP connect at once, non-blocking, within one bound. A listener on the
# rank's own address is a target that must connect: it shows that an attempt which fails failed on
# the network, not in the probe. Phase 2: raw IPv6 frames written onto the interface past the
# namespace's own stack (which may refuse to send IPv6 at all): an echo request to all-nodes
# (ff02::1), and to each host link's EUI-64 link-local an echo request and a neighbour
# solicitation; every IPv6 frame that comes back is recorded. Prints one JSON line.
_REACH = r"""
import errno, json, select, socket, struct, sys, time
limit, iface, own = float(sys.argv[1]), sys.argv[2], sys.argv[3]
host_macs = [bytes.fromhex(m.replace(":", "")) for m in sys.argv[4].split(",")]
control = socket.socket(); control.bind((own, 0)); control.listen(8)
targets = [f"{own}|{control.getsockname()[1]}"] + sys.argv[5:]
out, pending = {}, {}
for t in targets:
    addr, port = t.rsplit("|", 1)
    try:
        fam, typ, proto, _, sa = socket.getaddrinfo(addr, int(port), type=socket.SOCK_STREAM)[0]
        s = socket.socket(fam, typ, proto); s.setblocking(False)
        rc = s.connect_ex(sa)
    except OSError as e:
        out[t] = f"error {errno.errorcode.get(e.errno, e.errno)}"
        continue
    if rc == 0:
        out[t] = "connected"
    elif rc == errno.EINPROGRESS:
        pending[s] = t
    else:
        out[t] = f"error {errno.errorcode.get(rc, rc)}"
deadline = time.monotonic() + limit
while pending and time.monotonic() < deadline:
    _, ready, _ = select.select([], list(pending), [], max(0.0, deadline - time.monotonic()))
    for s in ready:
        rc = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        out[pending.pop(s)] = "connected" if rc == 0 else f"error {errno.errorcode.get(rc, rc)}"
for t in pending.values():
    out[t] = "timeout"

def csum(b):
    b += b"\0" * (len(b) % 2)
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    while s >> 16:
        s = (s & 0xffff) + (s >> 16)
    return ~s & 0xffff

def link_local(mac):
    return b"\xfe\x80" + bytes(6) + bytes([mac[0] ^ 2, *mac[1:3], 0xff, 0xfe, *mac[3:]])

def frame(dst_mac, dst, icmp):
    pseudo = src + dst + struct.pack("!I3xB", len(icmp), 58)
    icmp = icmp[:2] + struct.pack("!H", csum(pseudo + icmp)) + icmp[4:]
    return dst_mac + own_mac + b"\x86\xdd" + struct.pack("!IHBB", 6 << 28, len(icmp), 58, 255) + src + dst + icmp

with open(f"/sys/class/net/{iface}/address") as f:
    own_mac = bytes.fromhex(f.read().strip().replace(":", ""))
src = link_local(own_mac)
raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x86dd)); raw.bind((iface, 0x86dd))
echo = struct.pack("!BBHHH", 128, 0, 0, 0x7e57, 1) + b"probe"
frames = [frame(b"\x33\x33\0\0\0\1", socket.inet_pton(socket.AF_INET6, "ff02::1"), echo)]
for mac in host_macs:
    target = link_local(mac)
    frames.append(frame(mac, target, echo))
    frames.append(frame(b"\x33\x33\xff" + target[13:], socket.inet_pton(socket.AF_INET6, "ff02::1:ff00:0")[:13]
                        + target[13:], struct.pack("!BBHI", 135, 0, 0, 0) + target + b"\1\1" + own_mac))
for fr in frames:
    raw.send(fr)
back = []
raw.settimeout(0.05)
deadline = time.monotonic() + limit
while time.monotonic() < deadline:
    try:
        data, where = raw.recvfrom(2048)
    except socket.timeout:
        continue
    if where[2] != socket.PACKET_OUTGOING and len(data) >= 55:
        back.append({"from": socket.inet_ntop(socket.AF_INET6, data[22:38]), "mac": data[6:12].hex(":"),
                     "icmpv6_type": data[54] if data[20] == 58 else None})
print(json.dumps({"connect": out, "sent_frames": len(frames), "ipv6_back": back}))
"""


def _host_addresses():
    """Every address of every interface of the host namespace: ``[(dev, family, addr)]``."""
    out = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, check=True).stdout
    return [(f[1], f[2], f[3].split("/")[0]) for f in (line.split() for line in out.splitlines())
            if len(f) > 3 and f[2] in ("inet", "inet6")]


def _link_local_of(dev):
    """The EUI-64 link-local address ``dev`` gets from its MAC where IPv6 is on: tried even where
    no such address shows, so an address the listing misses is still probed."""
    with open(f"/sys/class/net/{dev}/address") as f:
        mac = [int(b, 16) for b in f.read().strip().split(":")]
    eui = [mac[0] ^ 2, *mac[1:3], 0xff, 0xfe, *mac[3:]]
    return "fe80::" + ":".join(f"{eui[i] << 8 | eui[i + 1]:x}" for i in range(0, 8, 2))


def _host_wide_ipv6_settings():
    out = {}
    for key in ("all", "default"):
        path = f"/proc/sys/net/ipv6/conf/{key}/disable_ipv6"
        if os.path.exists(path):
            with open(path) as f:
                out[key] = f.read().strip()
    return out


def _testbed_addresses(tb):
    """``{where: [address lines]}`` on every link the testbed made: the bridge and the host's veth
    ends (any family), and everything in each namespace's IPv6 table."""
    found = {}
    for dev in [tb.bridge] + [f"{tb.prefix}v{r.rank}" for r in tb.ranks]:
        found[f"host {dev}"] = subprocess.run(["ip", "-o", "addr", "show", "dev", dev], capture_output=True,
                                              text=True, check=True).stdout.splitlines()
        found[f"host routes via {dev}"] = [line for fam in ("-4", "-6") for line in subprocess.run(
            ["ip", fam, "route", "show", "table", "all", "dev", dev], capture_output=True, text=True,
            check=True).stdout.splitlines()]
    for r in tb.ranks:
        found[f"{r.netns} inet6"] = subprocess.run(["ip", "-n", r.netns, "-o", "-6", "addr", "show"],
                                                   capture_output=True, text=True, check=True).stdout.splitlines()
    return found


@pytest.mark.parametrize("ranks", [2, 4])
def test_no_host_address_is_reachable_from_a_rank_s_namespace(clean, ranks):
    """Listeners on the host bound to every address (0.0.0.0 and [::]) cannot be reached from a
    rank's namespace on any address the host has, IPv4 or IPv6, link-local included (scoped to the
    namespace's interface); IPv6 frames written raw onto the rank's link (an all-nodes echo, an
    echo and a neighbour solicitation to each host link's link-local) get no answer; and no
    testbed link carries an IPv6 address, nor the host an address or route on them."""
    host_wide = _host_wide_ipv6_settings()
    tb = testbed.up(ranks, 100, prefix=PREFIX)
    assert _host_wide_ipv6_settings() == host_wide, "up changed the host's own IPv6 settings"
    listeners = {}
    try:
        s4 = socket.socket(socket.AF_INET)
        s4.bind(("0.0.0.0", 0))
        s4.listen(64)
        listeners["inet"] = s4
        if socket.has_ipv6 and os.path.isdir("/proc/sys/net/ipv6"):
            s6 = socket.socket(socket.AF_INET6)
            s6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s6.bind(("::", 0))
            s6.listen(64)
            listeners["inet6"] = s6
        port = {fam: s.getsockname()[1] for fam, s in listeners.items()}
        # the listeners work: from the host itself they accept
        for fam, addr in (("inet", "127.0.0.1"), ("inet6", "::1")):
            if fam in listeners and any(a == addr for _, _, a in _host_addresses()):
                socket.create_connection((addr, port[fam]), timeout=1).close()

        # a link-local address is usable only once duplicate detection has passed: wait for that
        # (bounded), so that one the testbed leaves on its links is really tried
        deadline = time.monotonic() + 10
        while any("tentative" in line for lines in _testbed_addresses(tb).values() for line in lines):
            assert time.monotonic() < deadline, _testbed_addresses(tb)
            time.sleep(0.1)

        addrs = {(fam, a) for _, fam, a in _host_addresses()}
        addrs |= {("inet6", _link_local_of(dev)) for dev in [tb.bridge] + [f"{tb.prefix}v{r.rank}" for r in tb.ranks]}
        addrs |= {("inet6", _link_local_of(dev)) for dev, _, _ in _host_addresses() if dev != "lo"}
        targets = sorted(f"{a}%{tb.iface}|{port['inet6']}" if a.startswith("fe80:") else
                         f"{a}|{port[fam]}" for fam, a in addrs if fam in port)
        host_ips = {a for _, a in addrs}
        host_macs = []
        for dev in [tb.bridge] + [f"{tb.prefix}v{r.rank}" for r in tb.ranks]:
            with open(f"/sys/class/net/{dev}/address") as f:
                host_macs.append(f.read().strip())
        for r in tb.ranks:      # one at a time: a probe would hear another's frames on the bridge
            p = subprocess.run(["ip", "netns", "exec", r.netns, sys.executable, "-c", _REACH, "1.0", tb.iface, r.addr,
                                ",".join(host_macs), *targets], capture_output=True, text=True, timeout=30)
            assert p.returncode == 0, p.stderr[-2000:]
            rec = json.loads(p.stdout)
            control = rec["connect"].pop(next(t for t in rec["connect"] if t.startswith(r.addr + "|")))
            assert control == "connected", f"{r.netns}: the probe cannot reach its own listener: {control}"
            reached = {t: v for t, v in rec["connect"].items() if v == "connected"}
            assert not reached, f"{r.netns} reaches the host at {sorted(reached)}"
            assert sorted(rec["connect"]) == targets, rec
            assert rec["sent_frames"] == 1 + 2 * len(host_macs), rec
            # nothing may answer: the host's links must not, and the other ranks have no IPv6 either
            assert rec["ipv6_back"] == [], \
                f"{r.netns}: IPv6 answers {rec['ipv6_back']} (host addresses: {sorted(host_ips)})"
        found = _testbed_addresses(tb)
        assert not any(found.values()), {k: v for k, v in found.items() if v}
    finally:
        for s in listeners.values():
            s.close()


@pytest.mark.skipif(not os.path.isdir("/proc/sys/net/ipv6"), reason="this kernel has no IPv6")
def test_up_fails_and_cleans_up_where_a_host_link_keeps_ipv6(clean, monkeypatch):
    """Where IPv6 stays on at the host's end of the links (a kernel or daemon that will not have it
    off), the bridge gets a link-local address: ``up`` names it, removes what it made and fails."""
    monkeypatch.setattr(testbed, "_host_link_without_ipv6", lambda dev: None, raising=False)
    with pytest.raises(testbed.TestbedError, match=r"not sealed off from the host: .*xdytbr: inet6 fe80::"):
        testbed.up(2, 100, prefix=PREFIX)
    assert leftovers() == []
    assert not os.path.exists(testbed.state_path(PREFIX))
