#!/usr/bin/env bash
# device check: the warp-uniform measuring pass (new) against HEAD's fix (fix1) and the pre-fix kernel
# measure_new.py, measure_fix1.py, measure_prefix.py: kernels/cuda/measure.py at 7d4757d, at 15e7b58
# and at 63b8050^ (git show REV:kernels/cuda/measure.py > measure_NAME.py), copied beside this script.
set -o pipefail
export PYTHONUNBUFFERED=1 EXDYNA_STREAMS=/tmp/streams
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/nvidia.txt
python3 jobs/streams.py record cnn16 mlp --ranks 2 --steps 20 >/dev/null 2>&1 || echo "record failed"
EXDYNA_WHEELS=.whl EXDYNA_GPU_OUT=$OUT/gpu EXDYNA_MPI_TIMEOUT=200 EXDYNA_GPU_LANES="gpu static hashes" \
  EXDYNA_HASH_STREAMS=cnn16,mlp EXDYNA_HASH_STEPS=20 timeout 300 bash jobs/gpu_lane.sh > $OUT/lane.log 2>&1
echo "lane rc=$?"
grep -E "passed|failed|error|rc=|differ|STATIC|_acc_measure" $OUT/lane.log | grep -v "^tests/" | head -40
. /tmp/exdyna-venv/bin/activate
mkdir -p $OUT/ab
for v in new fix1 prefix new fix1 prefix; do
  cp results/gpu/2026-11-27-h100-uniform/measure_$v.py kernels/cuda/measure.py
  n=$(ls $OUT/ab | grep -c "^${v}_")
  timeout 60 python jobs/bench_gpu.py --numel 1e8 --density 0.01,0.001 --reps 20 --no-topk --json $OUT/ab/${v}_$n.json > $OUT/ab/${v}_$n.log 2>&1
  python - "$v" "$OUT/ab/${v}_$n.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[2]))
for r in d["rows"]:
    k = r["kernels"]
    print(sys.argv[1], r["density"], "step %.3f" % r["step_ms"], " ".join("%s %.3f" % (n, v["ms"]) for n, v in k.items() if "acc" in n))
PY
done
cp results/gpu/2026-11-27-h100-uniform/measure_new.py kernels/cuda/measure.py
cd $OUT && tar czf gpu.tgz gpu ab && rm -rf gpu ab
