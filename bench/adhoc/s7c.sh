#!/usr/bin/env bash
R=$(pwd); source bench/gpu_setup.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/jp:/tmp/site JAXPAGED_BENCH_MODELS=$R/.cache/gpu/bench_models JAXPAGED_BENCH_DATA=$R/.cache/gpu/bench_data JAXPAGED_GIT_REV=$(cat .cache/gpu/GIT_REV)
mkdir -p /tmp/w && cd /tmp/w
for v in 1 0; do
echo "== pinned=$v"
JAXPAGED_PINNED_INPUTS=$v timeout 140 python3 $R/bench/throughput.py --model qwen2-0.5b --dataset sharegpt --num-prompts 64 --profile --no-tqdm > $OUT/profile$v.txt 2>&1; grep -vE "Compiling|INFO|WARN|tokenizer" $OUT/profile$v.txt | cut -c1-900 | tail -80
done
