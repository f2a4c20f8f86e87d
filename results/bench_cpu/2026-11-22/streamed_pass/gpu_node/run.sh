#!/usr/bin/env bash
# on the GPU node: CPU bench before (.old/pkg_head) / after, P ranks on P cores: bash .old/cpu_ab_node2.sh OUT ROUNDS "PS"
out=$1; rounds=$2; ps=$3
mkdir -p "$out"
. /tmp/exdyna-venv/bin/activate
export MPIR_CVAR_CH4_PROGRESS_THROTTLE=1 MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT=16 NUMBA_NUM_THREADS=1 OMP_NUM_THREADS=1
for r in $(seq 1 "$rounds"); do
  for np in $ps; do
    for which in before after; do
      pp=; [ $which = before ] && pp=$PWD/.old/pkg_head
      PYTHONPATH=$pp:$PWD/jobs timeout 280 taskset -c 0-$((np - 1)) mpiexec -n $np python -m mpi4py jobs/bench_select.py --numel 10000000 --density 0.001 --steps 30 --methods floor,topk,exdyna,exdyna-out > "$out/${which}_p${np}_$r.log" 2>&1
      echo "== $which P=$np round $r rc $?"; grep -E "^(floor|topk|exdyna-out)" "$out/${which}_p${np}_$r.log"
    done
  done
done
