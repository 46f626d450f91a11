#!/usr/bin/env bash
# Everything a lent GPU should run, in one call that fits a short lease: the
# CUDA tests, the world-size-1 benchmark against PyTorch's fully_shard with its
# profiler traces, and the planner's peak against torch.cuda.max_memory_allocated.
# Uses the machine's own python and torch (no network there): the source tree
# goes on PYTHONPATH. Logs, the JSON and gzipped traces land in $OUT.
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
export PYTHONPATH=src PYTHONUNBUFFERED=1
start=$SECONDS
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"

echo "== tests/gpu"
timeout "${TESTS_S:-150}" $PY -m pytest -q -rs -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log"

echo "== bench_gpu ($SECONDS s)"
trace_dir=$(mktemp -d)
timeout "${BENCH_S:-330}" $PY benchmarks/bench_gpu.py --json "$OUT/bench_gpu.json" --trace "$trace_dir" ${BENCH_ARGS:-} \
  2>&1 | tee "$OUT/bench_gpu.log"
for f in shardwise_nccl torch_fsdp; do
  [ -f "$trace_dir/$f.json" ] && gzip -c "$trace_dir/$f.json" > "$OUT/trace_$f.json.gz"
done

echo "== planner on CUDA ($SECONDS s)"
timeout "${PLAN_S:-90}" $PY -c "
import json, sys
sys.path.insert(0, 'benchmarks')
import bench_plan
print(json.dumps(bench_plan.cuda_accuracy()))" 2>&1 | tee "$OUT/plan_cuda.log"
echo "== done in $((SECONDS - start)) s"
