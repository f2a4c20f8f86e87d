"""jobs/bit_hashes.py --compare: a setting present in several files with different hashes is reported
and makes the exit status 1; settings in one file only are not compared."""
import json
import os
import subprocess
import sys

from tests.launch import ROOT, child_env


def _rec(sparsifier, options, sha, device="cpu", steps=20):
    return json.dumps({"stream": "cnn16", "ranks": 2, "device": device, "sparsifier": sparsifier,
                       "options": options, "density": 0.01, "steps": steps, "sha256": sha})


def _compare(*paths):
    cmd = [sys.executable, os.path.join(ROOT, "jobs", "bit_hashes.py"), "--compare", *map(str, paths)]
    return subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)


def test_compare_reports_the_differing_setting_only(tmp_path):
    cpu, gpu = tmp_path / "cpu.jsonl", tmp_path / "cuda.jsonl"
    cpu.write_text("\n".join([_rec("exdyna", {}, "a" * 64), _rec("exdyna", {"balance": "faithful"}, "b" * 64),
                              _rec("micro", {}, "c" * 64, steps=6)]) + "\n")
    gpu.write_text("\n".join([_rec("exdyna", {}, "a" * 64, "cuda"),
                              _rec("exdyna", {"balance": "faithful"}, "d" * 64, "cuda")]) + "\n")
    proc = _compare(cpu, gpu)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    differs = [line for line in proc.stdout.splitlines() if line.startswith("DIFFERS")]
    assert len(differs) == 1 and '"balance": "faithful"' in differs[0] and "dddd" in differs[0]
    assert "2 settings compared across 2 files, 1 differ" in proc.stdout


def test_compare_passes_when_every_shared_setting_agrees(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(_rec("exdyna", {}, "a" * 64) + "\n")
    b.write_text(_rec("exdyna", {}, "a" * 64, "cuda") + "\n" + _rec("micro", {}, "e" * 64) + "\n")
    proc = _compare(a, b)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 settings compared across 2 files, 0 differ" in proc.stdout
