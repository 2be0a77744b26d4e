#!/usr/bin/env bash
# seventh session, call B: inputs written in place into pinned host buffers (HostInputs) vs fresh host arrays
source bench/adhoc/preamble.sh
el probe
timeout 150 python3 $R/bench/step_probe.py --model qwen2-0.5b --batches 1,16,64,256 --layer-dispatch scan --num-blocks 20000 --inputs numpy,host_inputs,device 2>&1 | grep -E "PROBE|Error|error" | tee $OUT/probe.txt
for v in 1 0 1; do
  el tput pinned=$v
  JAXPAGED_PINNED_INPUTS=$v timeout 200 python3 $R/bench/throughput.py --model qwen2-0.5b --dataset sharegpt --no-tqdm 2>&1 | grep -E "Throughput|start-up|launch_s|wait_s|Error" | tee -a $OUT/tput.txt
done
el profile
timeout 100 python3 $R/bench/throughput.py --model qwen2-0.5b --dataset sharegpt --num-prompts 64 --profile --no-tqdm > $OUT/profile.txt 2>&1; grep -E "Throughput|trace|_s  " $OUT/profile.txt > $OUT/profile_tail.txt; rm $OUT/profile.txt; cat $OUT/profile_tail.txt | cut -c1-600
el probe-unrolled
timeout 150 python3 $R/bench/step_probe.py --model qwen2-0.5b --batches 1,16,64,256 --layer-dispatch unrolled --num-blocks 20000 --inputs numpy,host_inputs 2>&1 | grep -E "PROBE|Error|error" | tee -a $OUT/probe.txt
el done
