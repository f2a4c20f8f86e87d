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
