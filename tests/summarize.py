"""Add up the lanes' JUnit files into one closing line: 'total: N passed, N failed, N skipped'.

Rank 0's file counts for a multi-rank lane; a failure on any other rank counts too.
"""
import glob
import os
import sys
import xml.etree.ElementTree as ET


def counts(path):
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:   # a rank aborted while writing its report: count it as a failure
        print(f"  {os.path.basename(path)}: unreadable ({e})")
        return 0, 1, 0
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    tests = fail = skip = 0
    for s in suites:
        tests += int(s.get("tests", 0))
        fail += int(s.get("failures", 0)) + int(s.get("errors", 0))
        skip += int(s.get("skipped", 0))
    return tests - fail - skip, fail, skip


def main(folder):
    """Print the totals; 1 if a test failed or lanes with tests ran and none passed (a lane that
    skipped everything fails), 0 otherwise, also when only lanes without tests (lint) ran."""
    passed = failed = skipped = 0
    reports = sorted(glob.glob(os.path.join(folder, "*.xml")))
    for path in reports:
        p, f, s = counts(path)
        for other in sorted(glob.glob(path + ".rank*")):
            f = max(f, counts(other)[1])
        print(f"  {os.path.basename(path)}: {p} passed, {f} failed, {s} skipped")
        passed, failed, skipped = passed + p, failed + f, skipped + s
    print(f"total: {passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed or (reports and passed == 0) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
