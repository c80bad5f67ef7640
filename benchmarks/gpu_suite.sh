#!/usr/bin/env bash
# One lent-GPU session's measurements; every result lands under $OUT (default ./bench_out).
# Usage: bash benchmarks/gpu_suite.sh [step ...]   steps: env attention gpt_1b golf ckpt
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/bench_out}
mkdir -p "$OUT"
steps=${*:-env attention gpt_1b golf ckpt}
log() { echo "=== $* ($(date +%T))"; }
for step in $steps; do
  case $step in
    env)
      log env
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
      python3 -c "import jax, inspect; print('jax', jax.__version__, jax.devices()); print(inspect.signature(jax.nn.dot_product_attention))"
      ;;
    attention)
      log attention
      python3 benchmarks/attention_check.py --json_out "$OUT/attention.json" 2>&1 | grep -v Warning
      ;;
    gpt_1b)
      log gpt_1b
      python3 -m axlearn.bench --config=gpt_1b --mesh_selector=gpu-h100-1 --steps=10 --warmup_steps=3 \
        --config_override=input.global_batch_size=4 --json_out "$OUT/gpt_1b.json" ${GPT1B_ARGS:-} 2>&1 | grep -v mup
      ;;
    golf)
      log golf
      python3 -m axlearn.bench --config=golf_baseline --mesh_selector=gpu-h100-1 --steps=10 --warmup_steps=3 \
        --json_out "$OUT/golf.json" ${GOLF_ARGS:-} 2>&1 | grep -v mup
      ;;
    ckpt)
      log ckpt
      python3 -m axlearn.common.checkpointer_benchmark --size 1.2e9 --dir /tmp/ckpt_bench 2>&1 | tail -15
      ;;
  esac
done
