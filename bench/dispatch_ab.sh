#!/usr/bin/env bash
# Engine configurations against each other on one machine, one device call: for each arm (a quoted list of
# engine flags; "" = the resolved defaults), in order:
#   1. offline LLM.generate, ShareGPT 1000 (bench/throughput.py with the arm's flags; its first run compiles)
#   2. the server with the same flags (bench/serve_vs_offline.sh --server-only --c1-only --server-args; warm from
#      step 1's executable cache): openqa at concurrency 1 (28 in / 300 out, 20 requests), median TPOT
# then, while --deadline-s allows, the offline runs again in the same order (warm: engine start-up from the
# cache), so each arm has a second figure on the same machine.
#   bash bench/dispatch_ab.sh MODEL [--deadline-s S] [--no-c1] ARGS_A ARGS_B ...
#   e.g. bash bench/dispatch_ab.sh llama3-8b "" "--num-scheduler-steps 16"   (several steps a program: unrolled)
# carry=[".whl", ".cache/gpu"] (bash bench/prepare_gpu_suite.sh here first). Results (JSON with device, JAX
# version, revision) in bench/results/, named by arm number (...-armN[-rK]), and with the full logs in
# $OUT/dispatch_ab-MODEL.tgz.
set -u
cd "$(dirname "$0")/.." || exit 1
MODEL=${1:?model}; shift
DEADLINE=560; C1=1; ARMS=()
while [ $# -gt 0 ]; do
  case $1 in --deadline-s) DEADLINE=$2; shift ;; --no-c1) C1=0 ;; *) ARMS+=("$1") ;; esac
  shift
done
source bench/gpu_env.sh
echo "dispatch_ab $MODEL: rev $JAXPAGED_GIT_REV, $($PY -c 'import jax; print(jax.__version__, jax.devices()[0].device_kind)' 2>&1 | tail -1)"
BENCH=$REPO/bench
ms() { echo $(( $(date +%s%N) / 1000000 )); }
secs() { local d=$(( $(ms) - $1 )); printf "%d.%03d" $((d / 1000)) $((d % 1000)); }
offline() {   # arm index, result suffix, flags
  local t0; t0=$(ms)
  echo "== offline ShareGPT 1000, arm $1 [${3:-defaults}]"
  # shellcheck disable=SC2086  # the arm's flags are a list
  $PY "$BENCH/throughput.py" --no-tqdm --dataset sharegpt --model "$MODEL" --result-name "throughput-$MODEL-sharegpt-arm$1$2" $3 2>&1 \
    | tee "/tmp/offline-arm$1$2.log" | grep -E "Throughput|Run config|Compiled|startup|Error|error" | tail -8 | sed 's/^/   /'
  echo "   ($(secs "$t0") s)"
}
c1() {        # arm index, flags: a fresh server with them, as xla_flags_c1.sh runs one (serve_vs_offline.sh)
  echo "== server c1, arm $1 [${2:-defaults}]"
  bash "$REPO/bench/serve_vs_offline.sh" "$MODEL" --server-only --c1-only --server-args "$2" 2>&1 \
    | tee "/tmp/server-arm$1.log" | grep -E "/health|Run config|Median TPOT|Mean TPOT|P99 TPOT|exit status" | sed 's/^ */   /'
  cp "$REPO/bench/results/serve-$MODEL-openqa-c1.json" "$REPO/bench/results/serve-$MODEL-openqa-c1-arm$1.json"
  [ -n "${OUT:-}" ] && for f in "$OUT/serve_vs_offline-$MODEL.tgz" "$OUT/server-$MODEL.log"; do
    [ -e "$f" ] && mv "$f" "${f%.*}-arm$1.${f##*.}"
  done
}
for i in "${!ARMS[@]}"; do
  offline "$i" "" "${ARMS[$i]}"
  [ $C1 = 1 ] && [ $SECONDS -lt "$DEADLINE" ] && c1 "$i" "${ARMS[$i]}"
done
round=2
while true; do
  for i in "${!ARMS[@]}"; do
    # a warm offline run takes about its engine start-up plus the workload: stop before the deadline
    [ $SECONDS -lt $(( DEADLINE - 60 )) ] || { echo "== deadline: stopped before round $round, arm $i"; break 2; }
    offline "$i" "-r$round" "${ARMS[$i]}"
  done
  round=$((round + 1))
done
# one archive: the device returns a bounded number of files
[ -n "${OUT:-}" ] && (cd "$REPO/bench/results" && tar czf "$OUT/dispatch_ab-$MODEL.tgz" \
  throughput-"$MODEL"-sharegpt-arm*.json serve-"$MODEL"-openqa-c1-arm*.json /tmp/server-arm*.log /tmp/offline-arm*.log 2>/dev/null)
echo "== done after $SECONDS s"
