#!/usr/bin/env bash
# Everything a lent GPU should run, in one call that fits a short lease: the
# CUDA tests, the world-size-1 benchmark against PyTorch's fully_shard with its
# profiler traces, and the planner's peak against torch.cuda.max_memory_allocated.
# SUITE_S=N also runs the whole suite (N seconds at most), CPU_BENCH_S=N the
# CPU benchmark at 4 ranks on the machine's real cores (N seconds a model;
# CPU_BENCH_ARGS overrides its steps and configs), PLAN_S=0 skips the separate
# planner check.
# Uses the machine's own python and torch (no network there): the source tree
# goes on PYTHONPATH. Logs, the JSON and gzipped traces land in $OUT.
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
start=$SECONDS
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"

if [ "${TESTS_S:-150}" -gt 0 ]; then  # 0 skips them
  echo "== tests/gpu"
  timeout "${TESTS_S:-150}" $PY -m pytest -q -rs -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log"
fi

echo "== bench_gpu ($SECONDS s)"
trace_dir=$(mktemp -d)
timeout "${BENCH_S:-330}" $PY benchmarks/bench_gpu.py --json "$OUT/bench_gpu.json" --trace "$trace_dir" ${BENCH_ARGS:-} \
  2>&1 | tee "$OUT/bench_gpu.log"
for f in shardwise_nccl torch_fsdp; do
  [ -f "$trace_dir/$f.json" ] && gzip -c "$trace_dir/$f.json" > "$OUT/trace_$f.json.gz"
done

if [ "${PLAN_S:-90}" -gt 0 ]; then  # 0 skips it (tests/gpu checks the default GPT's plan too)
  echo "== planner on CUDA ($SECONDS s)"
  timeout "${PLAN_S:-90}" $PY -c "
import json, sys
sys.path.insert(0, 'benchmarks')
import bench_plan
print(json.dumps(bench_plan.cuda_accuracy()))" 2>&1 | tee "$OUT/plan_cuda.log"
fi

if [ "${CPU_BENCH_S:-0}" -gt 0 ]; then  # issue 10's CPU table at 4 ranks on real cores (gloo, a thread a rank)
  # On the lent H200's Xeon one launch of the fp32 GPT took about 20 s (8 timed
  # steps; torch's import and start-up included): CPU_BENCH_S=200 fits the
  # default's 3 configs x 3 repeats; CPU_BENCH_ARGS adds FSDP1 and DDP.
  echo "== CPU bench, 4 ranks on $(nproc) cores ($SECONDS s)"
  for model in "gpt:--dim 384 --layers 6 --heads 4 --seq-len 256 --batch-size 4" \
               "blocks24:--dim 64 --layers 24 --heads 4 --seq-len 128 --vocab 256 --batch-size 4"; do
    # CUDA hidden: PyTorch's fully_shard would build its default mesh on the GPU
    CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout "$CPU_BENCH_S" $PY benchmarks/bench_step.py --nproc 4 \
      --repeats 3 ${CPU_BENCH_ARGS:---steps 8 --warmup 2 --configs shardwise,torch_fsdp,local} ${model#*:} \
      --json "$OUT/cpu_w4_${model%%:*}.json" 2>&1 | tail -n 12
  done
fi

if [ "${SUITE_S:-0}" -gt 0 ]; then  # the whole suite on this machine's torch, in parallel
  echo "== suite ($SECONDS s)"
  # The CPU suite (gloo): with a GPU visible, PyTorch's fully_shard, the
  # reference of many tests, would build its default mesh on CUDA.
  CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout "$SUITE_S" $PY -m pytest -v --tb=short -p no:cacheprovider \
    -n "${SUITE_WORKERS:-12}" --ignore=tests/gpu tests > "$OUT/suite.log" 2>&1
  echo "suite exit $?"; grep -E "(FAILED|ERROR) tests" "$OUT/suite.log" | sort -u | head -n 30; tail -n 3 "$OUT/suite.log"
fi
[ -f "$OUT/gpu_tests.log" ] && echo "== tests/gpu: $(tail -n 1 "$OUT/gpu_tests.log")"
echo "== done in $((SECONDS - start)) s"
