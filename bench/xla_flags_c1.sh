#!/usr/bin/env bash
# A model's concurrency-1 TPOT over HTTP under several XLA_FLAGS, one device call (issue 24's c1 target):
#   bash bench/xla_flags_c1.sh MODEL "FLAGS" ["FLAGS" ...]      ("" = the engine's defaults)
# e.g. bash bench/xla_flags_c1.sh llama3-8b "" "--xla_gpu_enable_pdl=false" "--xla_gpu_enable_triton_gemm=true"
# carry=[".whl", ".cache/gpu"] (bash bench/prepare_gpu_suite.sh here first). Each arm in turn on one machine: a fresh
# server (bench/serve_vs_offline.sh --server-only --c1-only; the user's XLA_FLAGS win over jaxpaged/envs.py's
# defaults flag by flag, and name their own executable cache entries, so each arm compiles), openqa at
# concurrency 1, its median TPOT. Arm k's files in $OUT are named ...-armK; the summary lists every arm.
set -u
cd "$(dirname "$0")/.." || exit 1
MODEL=${1:?model}; shift
[ $# -gt 0 ] || set -- ""
k=0
SUMMARY=()
for flags in "$@"; do
  k=$((k + 1))
  echo "== arm $k: XLA_FLAGS=\"$flags\""
  line=$(XLA_FLAGS="$flags" timeout 300 bash bench/serve_vs_offline.sh "$MODEL" --server-only --c1-only 2>&1 \
         | tee /tmp/xla_flags_arm$k.log | grep -E "health|Median TPOT|Error|error" | head -6)
  echo "$line"
  if [ -n "${OUT:-}" ]; then
    for f in "$OUT/serve_vs_offline-$MODEL.tgz" "$OUT/server-$MODEL.log"; do
      [ -e "$f" ] && mv "$f" "${f%.*}-arm$k.${f##*.}"
    done
    cp /tmp/xla_flags_arm$k.log "$OUT/"
  fi
  SUMMARY+=("arm $k [$flags]: $(echo "$line" | grep -o 'Median TPOT (ms): *[0-9.]*' | tr -s ' ')")
done
echo "== summary ($MODEL)"
printf '   %s\n' "${SUMMARY[@]}"
