"""The small-message bucket probe of 2026-11-28: one message of an ExDyna-sized exchange (15 and
45 kB) over a 2-rank testbed link after 1 s of idle, against its bytes over the rate, for the
16 KiB bucket and two smaller ones, with the sustained rate of each; the same measurement as
../2026-11-28-bucket/probe.py (run as root from the repository root:
python results/e2e/2026-11-28-rebucket/probe_small.py > probe_small.jsonl)."""
import sys

sys.path.insert(0, "results/e2e/2026-11-28-bucket")
from probe import run  # noqa: E402

for rate, nbytes in [(20, 15_000), (20, 45_000), (200, 45_000)]:
    for burst in (16 * 1024, 4 * 1024, 2 * 1024):
        run(rate, burst, nbytes)
