"""The bucket probe of 2026-11-28: how long one message takes over a 2-rank testbed link after 1 s
of idle, against its bytes over the rate, for three tbf buckets (run as root from the repository
root: python results/e2e/2026-11-28-bucket/probe.py > probe.jsonl)."""
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


if __name__ == "__main__":
    for rate, nbytes in [(20, 300_000), (200, 300_000), (20, 5_000_000), (1000, 3_000_000)]:
        for burst in (256 * 1024, 32 * 1024, 16 * 1024):
            run(rate, burst, nbytes)
