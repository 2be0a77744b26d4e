#!/usr/bin/env bash
# What XLA's command buffers (CUDA graphs) cost a decode step, and what makes them cheaper: bench/step_probe.py
# (blocking, back-to-back and launch time per step) under several XLA_FLAGS arms, one device call, then one
# step under XLA's command-buffer logging to see which allocations moved between calls and how many commands
# each call updated.
#   bash bench/cmdbuf_probe.sh MODEL BATCHES "FLAGS" ["FLAGS" ...]       ("" = the engine's defaults)
# e.g. bash bench/cmdbuf_probe.sh llama3-8b 1,16,64 "" "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
# carry=[".whl", ".cache/gpu"] (bash bench/prepare_gpu_suite.sh here first). Arm k's log is step_probe-armK.log
# in $OUT; PROBE lines and the summary go to stdout. An XLA flag this jaxlib lacks aborts its arm at start-up
# (XLA's flag parser), which the arm's log shows.
set -u
cd "$(dirname "$0")/.." || exit 1
MODEL=${1:?model}; BATCHES=${2:?batches}; shift 2
[ $# -gt 0 ] || set -- ""
source bench/gpu_env.sh
k=0
for flags in "$@"; do
  k=$((k + 1))
  echo "== arm $k: XLA_FLAGS=\"$flags\""
  XLA_FLAGS="$flags" timeout 180 $PY "$REPO/bench/step_probe.py" --model "$MODEL" --batches "$BATCHES" --ctx 384 \
    --label "arm$k $flags" > "/tmp/step_probe-arm$k.log" 2>&1
  echo "rc $?"
  grep -E "^PROBE|Error|error:|Unknown|unknown" "/tmp/step_probe-arm$k.log" | head -5
  [ -n "${OUT:-}" ] && cp "/tmp/step_probe-arm$k.log" "$OUT/"
done
# The logging arm: one batch size, the defaults. command_buffer_thunk logs each call's moved allocations,
# command_executor how many commands an update touched and skipped.
echo "== logging arm (defaults, batch 1)"
TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1,traced_command_buffer=2 \
  timeout 180 $PY "$REPO/bench/step_probe.py" --model "$MODEL" --batches 1 --ctx 384 --label vlog \
  > /tmp/step_probe-vlog.log 2>&1
echo "rc $?"
grep -c "" /tmp/step_probe-vlog.log
grep -E "Updated [0-9]+ commands" /tmp/step_probe-vlog.log | tail -5
grep -oE "updated_allocs[^;]{0,200}" /tmp/step_probe-vlog.log | tail -5
grep -iE "command buffer|CommandBuffer" /tmp/step_probe-vlog.log | sed -E 's/^.{0,40}\] //' | cut -c1-220 \
  | sort | uniq -c | sort -rn | head -25
if [ -n "${OUT:-}" ]; then
  grep -iE "command|alloc|trace" /tmp/step_probe-vlog.log | tail -3000 | gzip > "$OUT/step_probe-vlog.log.gz"
fi
