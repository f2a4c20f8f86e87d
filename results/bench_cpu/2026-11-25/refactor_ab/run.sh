#!/usr/bin/env bash
# Side by side, alternating: bench_select.py in a clone at the commit before the step-state refactor
# and the CUDA split (8faa747, its own .venv) and in this tree, P=2 and 4, two rounds.
#   BEFORE=/path/to/clone-at-8faa747 OUT=results/bench_cpu/2026-11-25/refactor_ab bash run.sh
export MPIR_CVAR_CH4_PROGRESS_THROTTLE=1 MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT=16 NUMBA_NUM_THREADS=1 OMP_NUM_THREADS=1
for r in 1 2; do
  for np in 2 4; do
    for which in before after; do
      if [ $which = before ]; then d="$BEFORE"; else d="$PWD"; fi
      ( cd $d && source .venv/bin/activate && timeout 600 mpiexec -n $np python -m mpi4py jobs/bench_select.py --numel 10000000 --density 0.001 --steps 12 --methods floor,topk,exdyna,exdyna-out > "$OUT"/${which}_p${np}_$r.log 2>&1 )
      echo "== $which P=$np round $r rc $?"
    done
  done
done
echo AB_DONE
