"""tests/summarize.py, the closing line of the test command: which folders of JUnit reports fail."""
from tests.summarize import main

REPORT = '<testsuite tests="{t}" failures="{f}" errors="0" skipped="{s}"></testsuite>'


def _write(folder, name, t, f=0, s=0):
    (folder / name).write_text(REPORT.format(t=t, f=f, s=s))


def test_lanes_without_tests_pass(tmp_path, capsys):
    assert main(str(tmp_path)) == 0                       # only lint ran: no reports
    assert "total: 0 passed, 0 failed, 0 skipped" in capsys.readouterr().out


def test_a_failure_or_nothing_passing_fails(tmp_path):
    _write(tmp_path, "a.xml", t=3, s=3)
    assert main(str(tmp_path)) == 1                       # every test skipped: not a pass
    _write(tmp_path, "b.xml", t=2)
    assert main(str(tmp_path)) == 0
    _write(tmp_path, "c.xml", t=2, f=1)
    assert main(str(tmp_path)) == 1


def test_a_failure_on_another_rank_counts(tmp_path):
    _write(tmp_path, "mpi.xml", t=2)
    _write(tmp_path, "mpi.xml.rank1", t=2, f=1)
    assert main(str(tmp_path)) == 1
