#!/usr/bin/env bash
# The small Mosaic matmul (pallas_kernels/small_matmul_mgpu.py: decode-sized linear layers) on the GPU, one call:
#   bash bench/small_matmul_gpu.sh [--no-tests] [--no-table] [--no-c1] [--table-args "FLAGS"] [--offline M,...]
# carry=[".whl", ".cache/gpu"] (bash bench/prepare_gpu_suite.sh here first). In order:
#   1. its kernel tests compiled (tests/kernels/test_mosaic_gpu.py -k SmallMatmul) and the routing tests
#   2. bench/bench_matmul.py: XLA's bf16 dot against the kernel on llama3-8b's and qwen2-0.5b's layers, M = 1, 8, 64
#   3. llama3-8b over HTTP at concurrency 1 (serve_vs_offline.sh --c1-only: openqa, median TPOT) with the kernel,
#      then with it switched off in this device copy (MAX_ROWS = 0: it declines every call), one machine
#   4. --offline M,...: offline ShareGPT 1000 of each model (families.sh), with the kernel
# Everything goes to $OUT (when set).
set -u
cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd)
TESTS=1; TABLE=1; C1=1; OFFLINE=""; TABLE_ARGS=""
while [ $# -gt 0 ]; do
  case $1 in --no-tests) TESTS=0 ;; --no-table) TABLE=0 ;; --no-c1) C1=0 ;; --offline) OFFLINE=$2; shift ;;
             --table-args) TABLE_ARGS=$2; shift ;; esac
  shift
done
OUT=${OUT:-/tmp/small_matmul_out}; mkdir -p "$OUT"
(
  source bench/gpu_env.sh
  echo "small_matmul_gpu: rev $JAXPAGED_GIT_REV, $($PY -c 'import jax; print(jax.__version__, jax.devices()[0].device_kind)' 2>&1 | tail -1)"
  if [ $TESTS = 1 ]; then
    echo "== 1. tests"
    JAX_PLATFORMS=cuda timeout 240 $PY -m pytest -q -p no:cacheprovider -o pythonpath= -x \
      "$REPO/tests/kernels/test_mosaic_gpu.py" -k SmallMatmul 2>&1 | tail -4
  fi
  if [ $TABLE = 1 ]; then
    echo "== 2. bench_matmul"
    timeout 200 $PY "$REPO/bench/bench_matmul.py" --out "$OUT" --git-rev "$JAXPAGED_GIT_REV" --budget-s 150 \
      --rows 1,8,64 --only xla-bf16,mgpu-bf16 ${TABLE_ARGS:---models llama3-8b,qwen2-0.5b} 2>&1 | grep -v "^WARNING" | tail -40
  fi
)
if [ $C1 = 1 ]; then
  KERNEL=$ROOT/pallas_kernels/small_matmul_mgpu.py
  cp "$KERNEL" /tmp/small_matmul_mgpu.py.orig
  for arm in kernel xla; do
    echo "== 3. c1 llama3-8b, $arm"; [ $arm = xla ] && [ "${NO_XLA_ARM:-0}" = 1 ] && continue
    if [ $arm = xla ]; then
      sed -i 's/^MAX_ROWS = [0-9]*$/MAX_ROWS = 0    # switched off for the A\/B/' "$KERNEL"
      grep -n "^MAX_ROWS" "$KERNEL"
    fi
    timeout 200 bash "$ROOT/bench/serve_vs_offline.sh" llama3-8b --server-only --c1-only 2>&1 \
      | grep -E "TPOT|health|Error|error|Output token" | head -12
    cp /tmp/server.log "$OUT/server-c1-$arm.log" 2>/dev/null; rm -f "$OUT/server-llama3-8b.log"
    for f in "$OUT"/serve_vs_offline-llama3-8b.*; do [ -e "$f" ] && mv "$f" "${f/llama3-8b/llama3-8b-c1-$arm}"; done
  done
  cp /tmp/small_matmul_mgpu.py.orig "$KERNEL"
fi
if [ -n "$OFFLINE" ]; then
  echo "== 4. offline"
  timeout 300 bash "$ROOT/bench/families.sh" ${OFFLINE//,/ } 2>&1 | grep -vE "^\| |^#|^$|device:" | tail -12
  cp "$ROOT"/bench/results/families* "$OUT"/ 2>/dev/null
fi
