#!/usr/bin/env bash
# Time to accuracy over shaped links: sets up the venv (jobs/env.sh), brings up the network testbed
# (jobs/testbed.py: one namespace per rank behind a tbf-shaped veth), measures the links, runs
# jobs/e2e.py with one rank per namespace, and takes the testbed down on exit, failure or Ctrl-C.
#
#   bash jobs/run_e2e.sh                                          # LM, 4 ranks, 1 Gbit/s, every method
#   bash jobs/run_e2e.sh --rate 100,1000,10000 --methods ddp,ddp-powersgd,exdyna
#   bash jobs/run_e2e.sh --workload cnn --rate 1000 --rate-of 3=100 --out out/e2e_slow
#   bash jobs/run_e2e.sh --no-testbed --steps 20                  # plain mpiexec, no shaping (any machine)
#   bash jobs/run_e2e.sh --job jobs/bench_imbalance.py --rate 100,1000 --out out/imbalance
#
# Flags read here (the rest go to jobs/e2e.py; see `python jobs/e2e.py --help`):
#   --ranks P          ranks, one namespace each (default 4; NP also works)
#   --rate R[,R2...]   Mbit/s each way per rank; several rates run one after another (default 1000)
#   --rate-of RANK=R   another rate for one rank (repeatable)
#   --out DIR          output folder (default out/e2e): DIR/e2e.jsonl, e2e.md, e2e_loss.png, e2e_ttt.png
#   --no-testbed       run under plain mpiexec on this machine (no root needed, no shaping)
#   --job SCRIPT       another MPI job on the same links (default jobs/e2e.py; no e2e report then)
# Environment: E2E_TIMEOUT (seconds per rate, default 7200), EXDYNA_TESTBED_PREFIX (default xdyna).
# On a cluster, skip this script: `srun python -m mpi4py jobs/e2e.py ...` runs over the real network.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source jobs/env.sh

ranks="${NP:-4}" rates=1000 out=out/e2e testbed=1 job=jobs/e2e.py
rate_of=() pass=()
while [ $# -gt 0 ]; do
    case "$1" in
        --ranks) ranks=$2; shift 2 ;;
        --rate) rates=$2; shift 2 ;;
        --rate-of) rate_of+=(--rate-of "$2"); shift 2 ;;
        --out) out=$2; shift 2 ;;
        --no-testbed) testbed=0; shift ;;
        --job) job=$2; shift 2 ;;
        *) pass+=("$1"); shift ;;
    esac
done
mkdir -p "$out"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
prefix="${EXDYNA_TESTBED_PREFIX:-xdyna}"
tb() { python jobs/testbed.py --prefix "$prefix" "$@"; }

if [ "$testbed" = 0 ]; then
    exec timeout -k 30 "${E2E_TIMEOUT:-7200}" mpiexec -n "$ranks" python -m mpi4py "$job" \
        --out "$out" "${pass[@]}"
fi

cleanup() { tb down >/dev/null 2>&1 || echo "[e2e] could not remove the testbed; run: python jobs/testbed.py down" >&2; }
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

IFS=, read -r -a rate_list <<<"$rates"
for rate in "${rate_list[@]}"; do
    echo "[e2e] testbed: $ranks ranks at $rate Mbit/s ${rate_of[*]:-}" >&2
    tb up --ranks "$ranks" --rate "$rate" "${rate_of[@]}" >"$out/testbed.json"
    tb check --record | tee -a "$out/e2e.jsonl" >&2
    timeout -k 30 "${E2E_TIMEOUT:-7200}" python jobs/testbed.py --prefix "$prefix" mpiexec -- \
        python -m mpi4py "$job" --ranks "$ranks" --rate "$rate" --out "$out" "${pass[@]}"
    tb down >/dev/null
done
if [ "$job" = jobs/e2e.py ]; then
    python jobs/e2e.py --report "$out/e2e.jsonl" --out "$out"
fi
