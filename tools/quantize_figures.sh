#!/usr/bin/env bash
# The figures of docs/quantization.md on one GPU, in one command:
#
#     bash tools/quantize_figures.sh [golf|generate|all]   # OUT=/tmp/quantize_figures STEPS=150
#
# `golf` is steps 1-2 below, `generate` step 3; `all` (the default) both, one after the other.
# 1. golf_baseline and golf_baseline_qat, STEPS steps each on the built-in corpus, then
#    their int8 and int6 artifacts: bytes and the round-trip loss / bits per byte.
# 2. int8 against bf16 decoding of the trained golf_baseline (greedy agreement, largest
#    logit error).
# 3. gpt_1b's shape (random weights, through a Hugging Face directory): generate_bench in
#    bf16 at batch 1 and 32, and in int8 at batch 1; then the `generate` command itself at
#    batch 1 in bf16 and in int8 (its speed line, on stderr, ends its log). SHAPE and EOS
#    (the shape's vocabulary size) pick another shape.
set -euo pipefail
OUT=${OUT:-/tmp/quantize_figures}
STEPS=${STEPS:-150}
PART=${1:-all}
PY=${PY:-python3}
export PYTHONPATH=$PWD
mkdir -p "$OUT"

step() {  # name, command...: runs it, its output in $OUT/name.log; the tail if it fails.
  local name=$1; shift
  local began=$SECONDS
  if ! "$@" >"$OUT/$name.log" 2>&1; then
    echo "FAILED: $name"; tail -20 "$OUT/$name.log"; exit 1
  fi
  echo "== $name ($((SECONDS - began)) s)"
}

if [[ $PART == golf || $PART == all ]]; then
for config in golf_baseline golf_baseline_qat; do
  step "train_$config" $PY -m axlearn.common.launch_trainer_main --config=$config \
    --data_dir=BUILTIN --trainer_dir="$OUT/$config" --config_override=max_step=$STEPS
  grep -h "eval validation" "$OUT/train_$config.log" | tail -1 | sed 's/.*\] //'
  step "export_$config" $PY -m axlearn.common.quantize export --trainer_dir="$OUT/$config" \
    --quantize=int8,int6 --output="$OUT/$config.{quantize}.axq"
  grep -h '^{' "$OUT/export_$config.log"
done

step quantize_check $PY tools/quantize_check.py --trainer_dir="$OUT/golf_baseline" \
  --prompt="def " --prompt="import os" --prompt="class Parser" --prompt="    return " \
  --new_tokens=64
grep -h '^{' "$OUT/quantize_check.log" | tail -1
fi
if [[ $PART == generate || $PART == all ]]; then
SHAPE=${SHAPE:-gpt_1b}
EOS=${EOS:-32768}
BENCH=(--shapes=$SHAPE --prompt_len=128 --new_tokens=128 --repeats=2)
step bench_bf16 $PY tools/generate_bench.py "${BENCH[@]}" --batch_sizes=1,32 --via_hf_dir \
  --keep_hf_dir="$OUT/${SHAPE}_hf"
grep -h '^{' "$OUT/bench_bf16.log"
step bench_int8 $PY tools/generate_bench.py "${BENCH[@]}" --batch_sizes=1 --quantize=int8
grep -h '^{' "$OUT/bench_int8.log"

PROMPT=$(printf 'x%.0s' $(seq 127))  # 127 bytes after bos: a 128-token prompt.
for quantize in "" int8; do
  name="command_${quantize:-bf16}"
  step "$name" $PY -m axlearn.common.generate --hf_dir="$OUT/${SHAPE}_hf" --tokenizer=bytes \
    --prompt="$PROMPT" --max_new_tokens=128 --batch_size=1 --eos_id=$EOS \
    ${quantize:+--quantize=$quantize}
  tail -1 "$OUT/$name.log"
done
fi
