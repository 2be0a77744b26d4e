#!/usr/bin/env bash
# The model families table (bench/families.py), one device call:
#   bash bench/families.sh [MODEL ...]      (default: llama3-8b mistral-7b gemma-2-9b glm-4-9b baichuan2-13b)
# carry=[".whl", ".cache/gpu"] (bash bench/prepare_gpu_suite.sh here first). Each model, in a process of its
# own: offline LLM.generate on llama3-8b's ShareGPT 1000 (dummy weights, max_model_len 4096 for all), results
# bench/results/families-MODEL.json; then the table over every families-*.json present; the JSONs and the table in $OUT.
set -u
cd "$(dirname "$0")/.." || exit 1
MODELS=${*:-llama3-8b mistral-7b gemma-2-9b glm-4-9b baichuan2-13b}
source bench/gpu_env.sh
echo "families: rev $JAXPAGED_GIT_REV, $($PY -c 'import jax; print(jax.__version__, jax.devices()[0].device_kind)' 2>&1 | tail -1)"
for m in $MODELS; do
  echo "== $m"
  t0=$(date +%s)
  # One line a preemption would push the pool's size and the throughput out of the tail: counted instead.
  $PY "$REPO/bench/throughput.py" --no-tqdm --dataset sharegpt --model "$m" --max-model-len 4096 \
      --result-name "families-$m" > "/tmp/families-$m.log" 2>&1
  grep -E "Throughput|Run config|KV cache:|startup|Error|error|WARNING" "/tmp/families-$m.log" | grep -v "preempted by" | tail -9
  echo "   preemptions logged: $(grep -c "preempted by" "/tmp/families-$m.log")"
  echo "   ($(( $(date +%s) - t0 )) s)"
done
$PY "$REPO/bench/families.py" --models "$(echo $MODELS | tr ' ' ',')" --results "$REPO/bench/results" 2>&1 | tail -15 || true
# $OUT brings back 8 files: each model's JSON (the table and plots are remade from them with bench/families.py),
# then the table; the caller's tee'd log is the eighth with five models.
if [ -n "${OUT:-}" ]; then
  cp "$REPO"/bench/results/families-*.json "$REPO"/bench/results/families.md "$OUT"/ 2>/dev/null || true
fi
