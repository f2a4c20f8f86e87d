"""The GPU lane script parses and the GPU benchmark's host-side code runs (no GPU needed)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_gpu_lane_script_parses():
    p = subprocess.run(["bash", "-n", os.path.join(ROOT, "jobs", "gpu_lane.sh")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_bench_gpu_check_mode(tmp_path):
    out = tmp_path / "b.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "jobs", "bench_gpu.py"), "--check",
                        "--numel", "1e7,4e8", "--density", "0.01", "--json", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert [r["numel"] for r in doc["rows"]] == [10_000_000, 400_000_000]
    assert doc["bytes_per_element_floor"] == 16 and "step ms" in p.stdout
    r = doc["rows"][0]
    assert 0 < r["kernels"]["acc_measure"]["fraction_of_peak"] < 1 and r["step_of_floor"] > 0


def test_peak_bandwidth_formula():
    import bench_gpu   # jobs/bench_gpu.py: pytest.ini puts jobs/ on the path

    # H100 SXM: 2619 MHz HBM3 clock, 5120-bit bus -> about 3352 GB/s
    assert abs(bench_gpu.peak_bandwidth_gbs({"memoryClockRate": 2_619_000, "memoryBusWidth": 5120})
               - 3352.3) < 1
