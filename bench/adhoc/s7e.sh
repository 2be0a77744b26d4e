#!/usr/bin/env bash
# seventh session, call E: 8 decode steps per program with every layer unrolled, then with the scan (one machine)
source bench/adhoc/preamble.sh
el tput unrolled ms8
JAXPAGED_LAYER_DISPATCH=unrolled timeout 290 python3 $R/bench/throughput.py --model qwen2-0.5b --dataset sharegpt --no-tqdm --num-scheduler-steps 8 --result-name tput-unrolled-ms8 2>&1 | grep -E "Throughput|start-up|Error" | tee -a $OUT/tput.txt
el profile unrolled ms8
JAXPAGED_LAYER_DISPATCH=unrolled timeout 90 python3 $R/bench/throughput.py --model qwen2-0.5b --dataset sharegpt --num-prompts 64 --profile --no-tqdm --num-scheduler-steps 8 --result-name prof-unrolled-ms8 > /tmp/p.txt 2>&1; grep -E "Throughput|start-up|trace:|_s  " /tmp/p.txt | tee -a $OUT/profile.txt
el tput scan ms8
JAXPAGED_LAYER_DISPATCH=scan timeout $(( 575 - $(date +%s) + T0 )) python3 $R/bench/throughput.py --model qwen2-0.5b --dataset sharegpt --no-tqdm --num-scheduler-steps 8 --result-name tput-scan-ms8 2>&1 | grep -E "Throughput|start-up|Error" | tee -a $OUT/tput.txt
el done
