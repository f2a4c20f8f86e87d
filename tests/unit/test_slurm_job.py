"""jobs/slurm_train.sbatch with stub ``srun``, ``squeue`` and ``scontrol`` on PATH: the checkpoint
gets the time between Slurm's warning signal and the stop, a checkpoint exit (75) and a stopped step
(124) are requeued, the requeues are bounded, and srun kills the whole step when one rank dies."""
import os
import re
import stat
import subprocess

import pytest

from tests.launch import ROOT

SCRIPT = os.path.join(ROOT, "jobs", "slurm_train.sbatch")

STUB = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "{log}"
{body}
"""


def _stub(folder, name, body, log):
    path = folder / name
    path.write_text(STUB.format(log=log, body=body))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _run(tmp_path, srun_body, time_left="10:00", restarts=0, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "calls.log"
    log.write_text("")
    _stub(bin_dir, "srun", srun_body, log)
    _stub(bin_dir, "squeue", f'echo "{time_left}"', log)
    _stub(bin_dir, "scontrol", "exit 0", log)
    full = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
            "SLURM_SUBMIT_DIR": ROOT, "SLURM_RESTART_COUNT": str(restarts), "EXDYNA_SETUP": "0",
            "OUT": str(tmp_path / "out"), **env}
    p = subprocess.run(["bash", SCRIPT], env=full, capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    return p, log.read_text().splitlines()


def test_signal_margin_matches_the_directive_and_the_checkpoint_gets_the_gap(tmp_path):
    text = open(SCRIPT).read()
    directive = int(re.search(r"^#SBATCH --signal=USR1@(\d+)$", text, re.M).group(1))
    default = int(re.search(r'signal_margin="\$\{SIGNAL_MARGIN:-(\d+)\}"', text).group(1))
    assert directive == default, f"--signal=USR1@{directive} but the script assumes {default} s"
    p, calls = _run(tmp_path, "exit 0", time_left="1-00:10:00")
    assert p.returncode == 0, p.stderr
    # one day and ten minutes left, stopped 30 s before the limit: 90 s after the signal
    assert f"srun stops after {24 * 3600 + 600 - 30} s" in p.stdout, p.stdout
    srun = [c for c in calls if c.startswith("srun ")]
    assert len(srun) == 1 and "--kill-on-bad-exit=1" in srun[0], calls
    assert not any(c.startswith("scontrol") for c in calls), calls


def test_checkpoint_exit_is_requeued(tmp_path):
    p, calls = _run(tmp_path, "exit 75")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "scontrol requeue 4242" in calls, calls


def test_a_stopped_step_is_requeued_a_bounded_number_of_times(tmp_path):
    # srun stops after TRAIN_TIMEOUT s (the time left less EXIT_MARGIN when unset)
    p, calls = _run(tmp_path, "exec sleep 30", TRAIN_TIMEOUT="1")
    assert p.returncode == 0 and "scontrol requeue 4242" in calls, p.stdout + p.stderr
    assert "resumes from the last complete checkpoint" in p.stdout
    p, calls = _run(tmp_path, "exec sleep 30", TRAIN_TIMEOUT="1", restarts=3)
    assert p.returncode == 124 and not any(c.startswith("scontrol") for c in calls), (p.returncode, calls)
    assert "giving up" in p.stderr


@pytest.mark.parametrize("rc", [1, 2])
def test_a_failed_step_is_not_requeued(tmp_path, rc):
    p, calls = _run(tmp_path, f"exit {rc}")
    assert p.returncode == rc and not any(c.startswith("scontrol") for c in calls), (p.returncode, calls)


def test_margins_that_leave_the_checkpoint_no_time_are_refused(tmp_path):
    p, calls = _run(tmp_path, "exit 0", EXIT_MARGIN="120")
    assert p.returncode == 2 and "must be below SIGNAL_MARGIN" in p.stderr, p.stderr
    assert not any(c.startswith("srun") for c in calls)


def test_time_left_falls_back_to_the_limit_when_squeue_cannot_say(tmp_path):
    p, _ = _run(tmp_path, "exit 0", time_left="UNLIMITED", TIME_LIMIT_S="600")
    assert "srun stops after 570 s" in p.stdout, p.stdout
