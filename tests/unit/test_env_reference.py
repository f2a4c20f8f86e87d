"""Every environment variable the package reads is in docs/architecture.md's table."""
import os
import re

from tests.launch import ROOT


def test_every_variable_the_package_reads_is_documented():
    read = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "exdyna_mpi")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    read |= set(re.findall(r"\bEXDYNA_[A-Z0-9_]+\b", f.read()))
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        table = set(re.findall(r"^\| `(EXDYNA_[A-Z0-9_]+)` \|", f.read(), re.M))
    assert read, "no EXDYNA_ variable found: the scan is broken"
    assert read <= table, f"read by the code, missing from docs/architecture.md: {sorted(read - table)}"
    assert table <= read, f"documented but no longer read: {sorted(table - read)}"
