#!/usr/bin/env bash
# The seventh session's A/B of how a step gets its inputs (sourced by s7a.sh and s7b.sh after the preamble):
# the step probe with fresh host arrays, the runner's way ($MODE) and device inputs; ShareGPT 1000 with the
# switch $SWITCH on, off, on (one machine); the profiled 64-prompt run with the default.
el probe
timeout 150 python3 $R/bench/step_probe.py --model qwen2-0.5b --batches 1,16,64,256 --layer-dispatch scan --num-blocks 20000 --inputs numpy,$MODE,device 2>&1 | grep -E "PROBE|Error|error" | tee $OUT/probe.txt
for v in 1 0 1; do
  el tput $SWITCH=$v
  env $SWITCH=$v timeout 200 python3 $R/bench/throughput.py --model qwen2-0.5b --dataset sharegpt --no-tqdm 2>&1 | grep -E "Throughput|start-up|launch_s|wait_s|step|Error" | tee -a $OUT/tput.txt
done
el profile
timeout 100 python3 $R/bench/throughput.py --model qwen2-0.5b --dataset sharegpt --num-prompts 64 --profile --no-tqdm > /tmp/profile.txt 2>&1; grep -E "Throughput|trace|_s  " /tmp/profile.txt | cut -c1-2000 > $OUT/profile_tail.txt
