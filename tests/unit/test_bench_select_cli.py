"""jobs/bench_select.py end to end under mpiexec (two ranks, a tiny vector): every method's row and
phases, and the span column (first rank's barrier exit to last rank's end) never shorter than the
slowest rank's own time, as it cannot be when it is computed right."""
import json
import os
import subprocess
import sys

import pytest

from tests.launch import MPIEXEC, ROOT, child_env


def test_bench_select_prints_and_writes_span(tmp_path):
    if MPIEXEC is None:
        pytest.skip("no mpiexec on PATH")
    out = tmp_path / "bench.jsonl"
    cmd = ["timeout", "-k", "5", "300", MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py",
           os.path.join(ROOT, "jobs", "bench_select.py"), "--numel", "200000", "--density", "0.01", "--steps", "4",
           "--warmup", "1", "--methods", "floor,topk,exdyna,exdyna-out", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=320)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "span" in proc.stdout.splitlines()[1]
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["nranks"] == 2 and rec["numel"] == 200000
    for m in ("floor", "topk", "exdyna", "exdyna-out"):
        assert 0 < rec[m]["total"] <= rec[m]["span"] < 60, (m, rec[m])
    for m in ("exdyna", "exdyna-out"):
        assert rec[m]["selected"] > 0 and rec[m]["bytes_sent"] > 0
        assert 0 < rec[m]["pass"] <= rec[m]["span"]
