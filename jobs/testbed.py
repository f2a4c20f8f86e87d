#!/usr/bin/env python
"""A cluster in a box: one Linux network namespace per rank behind a rate-limited link.

    python jobs/testbed.py up --ranks 4 --rate 1000             # 4 namespaces, 1 Gbit/s each way per rank
    python jobs/testbed.py up --ranks 4 --rate 1000 --rate-of 3=100   # rank 3 on a tenth of the rate
    python jobs/testbed.py check                                 # a bounded TCP transfer over each link
    python jobs/testbed.py mpiexec -- python -m mpi4py jobs/e2e.py --steps 100
    python jobs/testbed.py down                                  # removes everything `up` made

Layout (needs root, or CAP_NET_ADMIN and CAP_SYS_ADMIN): rank r lives in namespace ``<prefix>-r<r>``
with one interface ``<prefix>0`` at 198.18.0.<r+1>/24 (198.18.0.0/15 is the range set aside for
network benchmarks, RFC 2544). Its peer end ``<prefix>v<r>`` is enslaved to the bridge ``<prefix>br``,
which joins these veths and nothing else: no host interface, no default route in any namespace,
and IPv6 off on every link the testbed makes (in each namespace, on the bridge and on the host's
veth ends, set before any of them goes up, so not even a link-local address appears). The host
thus has no address on the bridge or its ports, IPv4 or IPv6, and no route into the namespaces:
over the network a rank reaches the other ranks and nothing else, and no packet can leave the
box. ``up`` checks this once the links are up and, where an address or route shows, removes what
it made and fails. The host's own settings (``net.ipv6.conf.all``, ``default``) stay as they are.
``tc tbf`` shapes both directions of each rank's link (the rank's egress on its interface, its
ingress on the bridge port), like a full-duplex NIC of that rate into a non-blocking switch. The
kernel here has no ``netem``: links have a rate, not a delay. tbf's bucket is kept small
(``burst_bytes``): what it holds crosses at the veth's speed after an idle moment, which a real
link of that rate never does.

``mpiexec`` launches one rank per namespace, MPMD (``mpiexec -n 1 ip netns exec NS0 CMD : -n 1 ip
netns exec NS1 CMD ...``). The process manager stays in the host namespace; ranks reach it through
inherited descriptors (MPICH's hydra) and then talk over TCP on the shaped links: MPICH with
``MPIR_CVAR_NOLOCAL=1`` (no shared memory between ranks) and libfabric's tcp provider on the
namespace's interface, Open MPI with the ``tcp`` BTL on it. torch.distributed finds its rendezvous
through ``MASTER_ADDR`` (rank 0's address) and ``GLOO_SOCKET_IFNAME``. ``EXDYNA_TESTBED_IFACE`` and
``EXDYNA_TESTBED_RATE_MBIT`` tell a job where its bytes go and at what rate.

Every transfer ``check`` makes is bounded in bytes and in seconds, and only between the testbed's
own namespaces. ``down`` finds what to remove by the exact names the testbed gives (``<prefix>-r<r>``,
``<prefix>v<r>``, ``<prefix>br``; a namespace ``<prefix>-rx`` is left alone), so it also cleans up
after a crashed run; ``up`` does the same first. The state file lives in a directory only this user
can write (``state_dir()``), not in the shared /tmp. The links' records, tbf's bucket and the
transfers that measure a link are in jobs/testbed_links.py (re-exported here).

As a module::

    import testbed
    tb = testbed.up(ranks=2, rate_mbit=100)
    try:
        print(testbed.check(tb))
        argv, env = testbed.mpiexec_command(tb, ["python", "-m", "mpi4py", "x.py"])
    finally:
        testbed.down(tb.prefix)
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys

from testbed_links import RankLink, Testbed, TestbedError, burst_bytes, check, measure_link, measure_message

PREFIX = "xdyna"
SUBNET = "198.18.0"          # /24 inside 198.18.0.0/15; rank r at .r+1
MAX_RANKS = 250
MASTER_PORT = 29500
CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21

__all__ = ["MASTER_PORT", "PREFIX", "RankLink", "Testbed", "TestbedError", "burst_bytes", "check", "down", "existing",
           "isolation_faults", "load", "main", "measure_link", "measure_message", "mpi_flavor", "mpiexec_command",
           "rank_env", "require_privilege", "state_dir", "state_path", "up"]


def _names(prefix):
    if not prefix.isalnum() or not 1 <= len(prefix) <= 8:
        raise TestbedError(f"testbed prefix {prefix!r}: 1 to 8 letters or digits (interface names have 15 characters)")
    return {"iface": f"{prefix}0", "bridge": f"{prefix}br", "netns": lambda r: f"{prefix}-r{r}",
            "veth": lambda r: f"{prefix}v{r}"}


def state_dir():
    """A directory only this user can write (``EXDYNA_TESTBED_STATE_DIR``, else /run/exdyna-testbed
    for root, else ~/.cache/exdyna-testbed): a state file in a shared /tmp could be planted by
    anyone, and ``down`` would act on it."""
    d = os.environ.get("EXDYNA_TESTBED_STATE_DIR") or (
        "/run/exdyna-testbed" if os.geteuid() == 0 and os.path.isdir("/run")
        else os.path.join(os.path.expanduser("~"), ".cache", "exdyna-testbed"))
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.stat(d)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise TestbedError(f"testbed state directory {d} must belong to this user and be writable by no one "
                           "else (set EXDYNA_TESTBED_STATE_DIR)")
    return d


def state_path(prefix=PREFIX):
    return os.path.join(state_dir(), f"{prefix}-testbed.json")


def _rank_of(name, stem):
    """The rank in ``name`` if it is exactly ``stem`` + a rank the testbed makes (0..MAX_RANKS-1,
    written as the testbed writes it), else None."""
    tail = name[len(stem):] if name.startswith(stem) else ""
    if tail.isdigit() and tail == str(int(tail)) and int(tail) < MAX_RANKS:
        return int(tail)
    return None


def _capabilities():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def require_privilege():
    """Raise ``TestbedError`` with a clear message unless this process may make namespaces and links."""
    missing = [n for bit, n in ((CAP_NET_ADMIN, "CAP_NET_ADMIN"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"))
               if not _capabilities() >> bit & 1]
    if missing:
        raise TestbedError(f"the testbed needs {' and '.join(missing)} (run as root): it makes network "
                           "namespaces, veth links, a bridge and tc qdiscs")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise TestbedError(f"the testbed needs '{tool}' (Debian/Ubuntu: apt-get install iproute2)")


def _run(*argv, check=True):
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise TestbedError(f"'{' '.join(argv)}' failed (rc {p.returncode}): {p.stderr.strip()}")
    return p


def _ns(netns, *argv, check=True):
    return _run("ip", "netns", "exec", netns, *argv, check=check)


def _shape(netns, dev, rate_mbit):
    """A tbf of ``rate_mbit`` on ``dev``'s egress (``netns`` None: the host namespace)."""
    argv = ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
            "burst", str(burst_bytes(rate_mbit)), "latency", "50ms"]
    return _ns(netns, *argv) if netns else _run(*argv)


def existing(prefix=PREFIX):
    """``(namespaces, host links)`` whose names carry ``prefix`` as the testbed names them."""
    n = _names(prefix)
    out = _run("ip", "netns", "list", check=False).stdout.split()
    # exact names only: another tool's namespace that shares the prefix is not ours to remove
    spaces = sorted({w for w in out if _rank_of(w, f"{prefix}-r") is not None})
    links = []
    for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name == n["bridge"] or _rank_of(name, f"{prefix}v") is not None:
            links.append(name)
    return spaces, links


def down(prefix=PREFIX):
    """Remove the namespaces, veths and bridge named with ``prefix`` (the processes still inside a
    namespace are killed first, so a crashed run's leftovers go too). Returns what was removed."""
    spaces, links = existing(prefix)
    for ns in spaces:
        pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _run("ip", "netns", "del", ns, check=False)
    for name in links:          # deleting a namespace removes its veth end and so the pair
        _run("ip", "link", "del", name, check=False)
    try:
        os.unlink(state_path(prefix))
    except FileNotFoundError:
        pass
    left = existing(prefix)
    if left[0] or left[1]:
        raise TestbedError(f"testbed '{prefix}': could not remove {left[0] + left[1]}")
    return spaces + links


def _rates(ranks, rate_mbit, rate_of):
    rates = [float(rate_mbit)] * ranks
    for rank, rate in (rate_of or {}).items():
        if not 0 <= rank < ranks:
            raise TestbedError(f"--rate-of names rank {rank}, but there are {ranks} ranks")
        rates[rank] = float(rate)
    if any(r <= 0 for r in rates):
        raise TestbedError(f"rates must be positive Mbit/s, got {rates}")
    return rates


# Run in a namespace (``ip netns exec``): /proc/sys/net shows the net namespace of the process that
# opens it, so these writes stay inside that namespace.
_NO_IPV6 = r"""
import sys
for key in sys.argv[1:]:
    with open(f"/proc/sys/net/ipv6/conf/{key}/disable_ipv6", "w") as f:
        f.write("1")
"""


def _ipv6_in_kernel():
    return os.path.isdir("/proc/sys/net/ipv6")


def _ns_without_ipv6(netns, iface):
    """IPv6 off in ``netns`` while its links are still down, so they never get an address: on
    ``default`` (a link made there later), ``all``, and ``lo`` and ``iface`` by name."""
    if _ipv6_in_kernel():
        _ns(netns, sys.executable, "-c", _NO_IPV6, "default", "all", "lo", iface)


def _host_link_without_ipv6(dev):
    """IPv6 off on the host's ``dev`` alone (not on ``all`` or ``default``: those are the host's),
    while it is still down, so it never gets a link-local address."""
    if not _ipv6_in_kernel():
        return
    try:
        with open(f"/proc/sys/net/ipv6/conf/{dev}/disable_ipv6", "w") as f:
            f.write("1")
    except OSError as e:
        raise TestbedError(f"cannot turn IPv6 off on {dev}: {e}") from None


def isolation_faults(tb):
    """What would let a rank reach the host: each address or route on the bridge or a host veth
    end (any family), each IPv6 address in a namespace, a default route in one. Empty when sealed."""
    faults = []
    for dev in [tb.bridge] + [_names(tb.prefix)["veth"](r.rank) for r in tb.ranks]:
        faults += [f"host {dev}: {' '.join(line.split()[2:4])}"
                   for line in _run("ip", "-o", "addr", "show", "dev", dev).stdout.splitlines()]
        for fam in ("-4", "-6"):
            faults += [f"host route via {dev}: {line.strip()}"
                       for line in _run("ip", fam, "route", "show", "table", "all", "dev", dev).stdout.splitlines()]
    for r in tb.ranks:
        faults += [f"{r.netns} {line.split()[1]}: {' '.join(line.split()[2:4])}"
                   for line in _run("ip", "-n", r.netns, "-o", "-6", "addr", "show").stdout.splitlines()]
        for fam in ("-4", "-6"):
            faults += [f"{r.netns} route: {line.strip()}"
                       for line in _run("ip", "-n", r.netns, fam, "route", "show").stdout.splitlines()
                       if line.split()[:1] == ["default"]]
    return faults


def up(ranks, rate_mbit, rate_of=None, prefix=PREFIX):
    """Make a testbed of ``ranks`` namespaces, each link shaped to ``rate_mbit`` Mbit/s each way
    (``rate_of={rank: mbit}`` for exceptions). A stale testbed of the same prefix goes first.
    On any failure, what was made is removed again before the error propagates."""
    require_privilege()
    if not 1 <= ranks <= MAX_RANKS:
        raise TestbedError(f"--ranks must be 1..{MAX_RANKS}, got {ranks}")
    rates = _rates(ranks, rate_mbit, rate_of)
    n = _names(prefix)
    down(prefix)
    links = []
    try:
        _run("ip", "link", "add", n["bridge"], "type", "bridge")
        _host_link_without_ipv6(n["bridge"])
        _run("ip", "link", "set", n["bridge"], "up")
        for r in range(ranks):
            ns, veth, addr = n["netns"](r), n["veth"](r), f"{SUBNET}.{r + 1}"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", n["iface"], "netns", ns)
            _ns_without_ipv6(ns, n["iface"])
            _host_link_without_ipv6(veth)
            _run("ip", "link", "set", veth, "master", n["bridge"])
            _run("ip", "link", "set", veth, "up")
            _ns(ns, "ip", "link", "set", "lo", "up")
            _ns(ns, "ip", "addr", "add", f"{addr}/24", "dev", n["iface"])
            _ns(ns, "ip", "link", "set", n["iface"], "up")
            _shape(ns, n["iface"], rates[r])     # the rank's sending side
            _shape(None, veth, rates[r])         # the bridge's side towards the rank: its receiving side
            links.append(RankLink(r, ns, addr, rates[r], burst_bytes(rates[r])))
        tb = Testbed(prefix, n["iface"], n["bridge"], float(rate_mbit), tuple(links))
        _wait_ready(tb)
        faults = isolation_faults(tb)
        if faults:
            raise TestbedError(f"testbed '{prefix}' is not sealed off from the host: {'; '.join(faults)}")
    except BaseException:
        down(prefix)
        raise
    with open(state_path(prefix), "w") as f:
        json.dump(tb.record(), f)
    return tb


_PING = r"""
import os, socket, struct, sys, time
def csum(b):
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    s = (s >> 16) + (s & 0xffff); s += s >> 16
    return ~s & 0xffff
deadline = time.monotonic() + float(sys.argv[1])
for addr in sys.argv[2:]:
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP); s.settimeout(0.2)
    while True:
        hdr = struct.pack("!BBHHH", 8, 0, 0, os.getpid() & 0xffff, 1)
        s.sendto(struct.pack("!BBHHH", 8, 0, csum(hdr), os.getpid() & 0xffff, 1), (addr, 0))
        try:
            data, peer = s.recvfrom(1024)
            if peer[0] == addr and data[20] == 0:
                break
        except socket.timeout:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"no echo reply from {addr}")
"""


def _wait_ready(tb, seconds=10.0):
    """Rank 0 pings every other rank (ICMP echo, bounded by ``seconds`` in all): the links are up,
    addressed and bridged before anything runs over them."""
    if len(tb.ranks) > 1:
        p = subprocess.run(["ip", "netns", "exec", tb.ranks[0].netns, sys.executable, "-c", _PING, str(seconds),
                            *(r.addr for r in tb.ranks[1:])], capture_output=True, text=True, timeout=seconds + 10)
        if p.returncode != 0:
            raise TestbedError(f"rank 0 cannot reach the others: {p.stderr.strip()[-300:]}")


def load(prefix=PREFIX):
    """The testbed that ``up`` made (``TestbedError`` if there is none)."""
    try:
        with open(state_path(prefix)) as f:
            rec = json.load(f)
    except FileNotFoundError:
        raise TestbedError(f"no testbed '{prefix}' is up (run: python jobs/testbed.py up --ranks P --rate R)") from None
    spaces, _ = existing(prefix)
    links = tuple(RankLink(r["rank"], r["netns"], r["addr"], r["rate_mbit"], r.get("burst_bytes", 0))
                  for r in rec["ranks"])
    gone = [r.netns for r in links if r.netns not in spaces]
    if gone:
        raise TestbedError(f"testbed '{prefix}' is incomplete ({', '.join(gone)} missing): run down, then up")
    n = _names(prefix)
    return Testbed(prefix, n["iface"], n["bridge"], rec["rate_mbit"], links)


# --- launching: one rank per namespace ---------------------------------------------------------------

def mpi_flavor(mpiexec="mpiexec"):
    """``"mpich"`` or ``"openmpi"``, from ``mpiexec --version``."""
    exe = shutil.which(mpiexec)
    if exe is None:
        raise TestbedError(f"'{mpiexec}' is not on PATH")
    text = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    low = text.lower()
    if "open mpi" in low or "open-rte" in low or "openrte" in low or "prte" in low:
        return "openmpi"
    if "hydra" in low or "mpich" in low:
        return "mpich"
    raise TestbedError(f"cannot tell which MPI '{exe}' is from its --version: {text[:200]!r}")


def rank_env(tb, flavor, master_port=MASTER_PORT):
    """The environment every rank gets: its MPI and gloo on the namespace's interface, the
    rendezvous at rank 0, and what the job may read about the link."""
    env = {"MASTER_ADDR": tb.ranks[0].addr, "MASTER_PORT": str(master_port), "GLOO_SOCKET_IFNAME": tb.iface,
           "EXDYNA_TESTBED_IFACE": tb.iface, "EXDYNA_TESTBED_RATE_MBIT": f"{tb.rate_mbit:g}"}
    if flavor == "mpich":
        env.update({"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp",
                    "FI_TCP_IFACE": tb.iface})
    elif flavor == "openmpi":
        env.update({"OMPI_MCA_btl": "tcp,self", "OMPI_MCA_btl_tcp_if_include": tb.iface,
                    "OMPI_MCA_oob_tcp_if_include": tb.iface, "OMPI_MCA_pml": "ob1"})
    else:
        raise TestbedError(f"unknown MPI flavor {flavor!r}")
    return env


def mpiexec_command(tb, command, mpiexec_args=(), mpiexec="mpiexec", flavor=None, master_port=MASTER_PORT):
    """``(argv, env)`` to launch ``command`` once per namespace, rank r in namespace r (MPMD)."""
    if not command:
        raise TestbedError("mpiexec: nothing to run (put the command after --)")
    flavor = flavor or mpi_flavor(mpiexec)
    env = dict(os.environ)
    env.update(rank_env(tb, flavor, master_port))
    argv = [shutil.which(mpiexec) or mpiexec, *mpiexec_args]
    for i, r in enumerate(tb.ranks):
        if i:
            argv.append(":")
        argv += ["-n", "1", "ip", "netns", "exec", r.netns, *command]
    return argv, env


def _parse_rate_of(items):
    out = {}
    for item in items or ():
        rank, sep, rate = item.partition("=")
        if not sep:
            raise TestbedError(f"--rate-of takes RANK=MBIT, got {item!r}")
        out[int(rank)] = float(rate)
    return out


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.strip().split("\n")[0])
    ap.add_argument("--prefix", default=os.environ.get("EXDYNA_TESTBED_PREFIX", PREFIX),
                    help=f"name prefix of everything made (default {PREFIX}; 1-8 letters or digits)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="make the namespaces, links and bridge; prints one JSON line")
    p_up.add_argument("--ranks", type=int, required=True)
    p_up.add_argument("--rate", type=float, required=True, help="Mbit/s each way on every rank's link")
    p_up.add_argument("--rate-of", action="append", metavar="RANK=MBIT", help="another rate for one rank")
    p_check = sub.add_parser("check", help="measure each link; prints one JSON line")
    p_check.add_argument("--seconds", type=float, default=2.0, help="bytes of this many seconds at the set rate")
    p_check.add_argument("--record", action="store_true", help='add "kind": "link" (for e2e.jsonl)')
    sub.add_parser("down", help="remove everything with the prefix, also after a crash")
    sub.add_parser("status", help="print the testbed that is up, or exit 1")
    p_mpi = sub.add_parser("mpiexec", help="mpiexec [ARGS] -- CMD...: rank r runs CMD in namespace r")
    p_mpi.add_argument("--mpiexec", default="mpiexec")
    p_mpi.add_argument("--master-port", type=int, default=MASTER_PORT)
    p_mpi.add_argument("--dry-run", action="store_true", help="print the command and environment, run nothing")

    command = []
    if "mpiexec" in argv and "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    args, extra = ap.parse_known_args(argv)
    if extra and args.cmd != "mpiexec":
        ap.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.cmd == "up":
            tb = up(args.ranks, args.rate, _parse_rate_of(args.rate_of), prefix=args.prefix)
            print(json.dumps(tb.record()), flush=True)
        elif args.cmd == "check":
            rec = check(load(args.prefix), args.seconds)
            print(json.dumps({"kind": "link", **rec} if args.record else rec), flush=True)
        elif args.cmd == "down":
            removed = down(args.prefix)
            print(json.dumps({"removed": removed}), flush=True)
        elif args.cmd == "status":
            print(json.dumps(load(args.prefix).record()), flush=True)
        elif args.cmd == "mpiexec":
            tb = load(args.prefix)
            run_argv, env = mpiexec_command(tb, command, extra, args.mpiexec, master_port=args.master_port)
            if args.dry_run:
                print(json.dumps({"argv": run_argv, "env": rank_env(tb, mpi_flavor(args.mpiexec), args.master_port)}))
                return 0
            return subprocess.call(run_argv, env=env)
    except TestbedError as e:
        print(f"testbed: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
