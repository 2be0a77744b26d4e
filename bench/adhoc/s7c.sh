#!/usr/bin/env bash
source bench/adhoc/preamble.sh
for v in 1 0; do
echo "== pinned=$v"
JAXPAGED_PINNED_INPUTS=$v timeout 140 python3 $R/bench/throughput.py --model qwen2-0.5b --dataset sharegpt --num-prompts 64 --profile --no-tqdm > $OUT/profile$v.txt 2>&1; grep -vE "Compiling|INFO|WARN|tokenizer" $OUT/profile$v.txt | cut -c1-900 | tail -80
done
