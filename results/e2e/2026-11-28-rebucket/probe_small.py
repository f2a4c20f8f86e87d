"""The small-message bucket probe of 2026-11-28: one message of an ExDyna-sized exchange (15 and
45 kB) over a 2-rank testbed link after 1 s of idle, against its bytes over the rate, for the
16 KiB bucket and two smaller ones, with the sustained rate of each (run as root from the
repository root: python results/e2e/2026-11-28-rebucket/probe_small.py > probe_small.jsonl)."""
import json
import sys

sys.path.insert(0, "jobs")
import testbed  # noqa: E402


def run(rate, burst, nbytes):
    testbed.burst_bytes = lambda r: burst          # the bucket under test, on both ends of each link
    tb = testbed.up(ranks=2, rate_mbit=rate, prefix="xprb")
    try:
        took = testbed.measure_message(tb, 0, 1, nbytes, reps=4, idle_s=1.0)
        sustained = testbed.measure_link(tb, 0, 1, 2.0)
        print(json.dumps({"rate": rate, "burst": burst, "bytes": nbytes, "ideal_s": round(nbytes * 8 / rate / 1e6, 4),
                          "took_s": [round(t, 4) for t in took], "sustained_mbit": round(sustained, 1)}), flush=True)
    finally:
        testbed.down(prefix="xprb")


for rate, nbytes in [(20, 15_000), (20, 45_000), (200, 45_000)]:
    for burst in (16 * 1024, 4 * 1024, 2 * 1024):
        run(rate, burst, nbytes)
