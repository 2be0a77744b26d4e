#!/usr/bin/env bash
# Issue 26 (quantization) on the GPU, in one call: the int4 kernel's tests at real sizes, the linear-layer
# table (bench/bench_matmul.py), the fp8 GEMM probe (bench/fp8_probe.py), llama3-8b's concurrency-1 TPOT over
# HTTP as AWQ int4 (dummy weights) beside bf16, then (--fp8-throughput) llama3-8b offline ShareGPT 1000 with
# fp8 weights quantized at load beside bf16 (dummy weights).
# --fp8-kv: decode attention over a bf16 pool and the same pool in e4m3 (llama3-8b's layout; FP8_KV_LAYOUTS and
#   FP8_KV_PARTS widen it), on the Triton and the Mosaic GPU kernels, and what attention() routes
#   (bench_kernels.py --fp8-cache); the Mosaic kernels' tests.
# --gguf: the default SmolLM2 with quantization="gguf" (its Q4_1 layers through the W4A16 kernel) against its
#   dense run (bench/gguf_gpu.py).
# --fp8-kv-throughput: llama3-8b offline ShareGPT 1000 with an e4m3 KV cache beside the bf16 one (dummy weights).
#   bash bench/quant_gpu.sh [--no-tests] [--no-table] [--no-fp8] [--no-c1] [--fp8-throughput] [--fp8-kv]
#        [--fp8-kv-throughput] [--gguf]
#        [--table-args "FLAGS"] [--c1-models llama3-8b-awq,llama3-8b] [--fp8-rows 1,256,2048,8192] [--c1-settled]
# --c1-settled: each c1 server measured again once its background compiles are done (serve_vs_offline.sh).
# carry=[".whl", ".cache/gpu"] (bash bench/prepare_gpu_suite.sh here first). Results under $OUT (or /tmp/int4).
set -u
cd "$(dirname "$0")/.." || exit 1
TESTS=1; TABLE=1; FP8=1; C1=1; FP8_TPUT=0; FP8_KV=0; FP8_KV_TPUT=0; GGUF=0; TABLE_ARGS="--sweep"; C1_MODELS=llama3-8b-awq,llama3-8b
FP8_ROWS=1,256,2048,8192; C1_SETTLED=""
while [ $# -gt 0 ]; do
  case $1 in --no-tests) TESTS=0 ;; --no-table) TABLE=0 ;; --no-c1) C1=0 ;; --no-fp8) FP8=0 ;; --fp8-throughput) FP8_TPUT=1 ;; --fp8-kv) FP8_KV=1 ;; --fp8-kv-throughput) FP8_KV_TPUT=1 ;; --gguf) GGUF=1 ;; --table-args) TABLE_ARGS=$2; shift ;;
             --c1-models) C1_MODELS=$2; shift ;; --fp8-rows) FP8_ROWS=$2; shift ;; --c1-settled) C1_SETTLED=--c1-settled ;; esac
  shift
done
OUTDIR=${OUT:-/tmp/quant}
mkdir -p "$OUTDIR"
ROOT=$(pwd)
if [ $C1 = 1 ]; then   # (before gpu_env.sh leaves the repository)
  c1() { bash "$ROOT/bench/serve_vs_offline.sh" "$1" --server-only --c1-only $C1_SETTLED 2>&1 \
    | grep -E "TPOT|health|Error|error|background|^== 4" | head -24; }
fi
source bench/gpu_env.sh
echo "quant_gpu: rev $JAXPAGED_GIT_REV, $($PY -c 'import jax; print(jax.__version__, jax.devices()[0].device_kind)' 2>&1 | tail -1)"
if [ $TESTS = 1 ]; then
  echo "== kernel tests (GPU)"
  MOSAIC=""; [ $FP8_KV = 1 ] && MOSAIC="$REPO/tests/kernels/test_mosaic_gpu.py"
  # shellcheck disable=SC2086
  JAX_PLATFORMS=cuda timeout 300 $PY -m pytest -q -p no:cacheprovider -o pythonpath= "$REPO/tests/kernels/test_int4_matmul.py" \
    "$REPO/tests/kernels/test_fp8_cache.py" $MOSAIC 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -12
fi
if [ $TABLE = 1 ]; then
  echo "== linear layers (bench_matmul.py $TABLE_ARGS)"
  # shellcheck disable=SC2086
  timeout 330 $PY "$REPO/bench/bench_matmul.py" --out "$OUTDIR" --git-rev "$JAXPAGED_GIT_REV" $TABLE_ARGS 2>&1 \
    | grep -vE "^\| "
fi
if [ $GGUF = 1 ]; then
  echo "== SmolLM2 quantization=gguf against dense (gguf_gpu.py)"
  timeout 300 $PY "$REPO/bench/gguf_gpu.py" --out "$OUTDIR" --git-rev "$JAXPAGED_GIT_REV" 2>&1 \
    | grep -vE "^(INFO|WARNING|DEBUG)" | tail -8
fi
if [ $FP8 = 1 ]; then
  echo "== fp8 GEMM probe"
  timeout 280 $PY "$REPO/bench/fp8_probe.py" --out "$OUTDIR" --rows "$FP8_ROWS" --budget-s 200 2>&1 | tail -25
fi
if [ $C1 = 1 ]; then
  cd "$ROOT" || exit 1
  for model in ${C1_MODELS//,/ }; do echo "== c1 $model"; c1 $model; done
fi
if [ $FP8_KV = 1 ]; then
  echo "== attention, bf16 against fp8 cache (bench_kernels.py --fp8-cache)"
  # llama3-8b's layout (head size 128: where e4m3 decode runs the Mosaic kernel) unless FP8_KV_LAYOUTS names more
  # (FP8_KV_LAYOUTS=qwen2-0.5b,llama3-8b); prefill over e4m3 too with FP8_KV_PARTS=decode,prefill
  timeout 330 $PY "$REPO/bench/bench_kernels.py" --out "$OUTDIR" --git-rev "$JAXPAGED_GIT_REV" \
    --parts "${FP8_KV_PARTS:-decode}" --layouts "${FP8_KV_LAYOUTS:-llama3-8b}" \
    --fp8-cache --decode-shapes 256x4096,64x4096 --decode-configs "" --decode-mgpu-configs "128,2" \
    --prefill-configs "" --budget-s 280 2>&1 | grep -E '^(decode|prefill) |failed' \
    | grep -oE '^(decode|prefill)|"layout"[^,]*|"(seqs|ctx|len)"[^,]*|"(default|routed|mgpu)_us"[^,]*|"routed_kernel"[^,]*|"(fp8_|routed_fp8|bf16_split)[a-z0-9_]*(\[[0-9a-z,]*\])?": [^,}]*|failed.*' \
    | tr '\n' ' ' | sed -E 's/ (decode|prefill) /\n\1 /g'; echo
fi
if [ $FP8_KV_TPUT = 1 ]; then
  for kv in fp8 auto; do
    echo "== offline llama3-8b ShareGPT 1000, kv-cache-dtype $kv"
    timeout 280 $PY "$REPO/bench/throughput.py" --no-tqdm --dataset sharegpt --model llama3-8b \
      --kv-cache-dtype $kv --result-name "llama3-8b-sharegpt-kv-$kv" 2>&1 \
      | grep -E "Throughput|Run config|KV cache|loaded|Error|error" | tail -6
  done
fi
if [ $FP8_TPUT = 1 ]; then
  for q in fp8 none; do
    echo "== offline llama3-8b ShareGPT 1000, quantization $q"
    # shellcheck disable=SC2046
    timeout 300 $PY "$REPO/bench/throughput.py" --no-tqdm --dataset sharegpt --model llama3-8b \
      $( [ $q = fp8 ] && echo --quantization fp8 ) --result-name "llama3-8b-sharegpt-$q" 2>&1 \
      | grep -E "Throughput|Run config|loaded|Error|error" | tail -5
  done
fi
