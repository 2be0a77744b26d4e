#!/usr/bin/env bash
# seventh session, call A: staged inputs vs fresh host inputs (probe, ShareGPT 1000, profiled run, graph-update log)
source bench/adhoc/preamble.sh
el probe
timeout 150 python3 $R/bench/step_probe.py --model qwen2-0.5b --batches 1,16,64,256 --layer-dispatch scan --num-blocks 20000 --inputs numpy,staged,device 2>&1 | grep -E "PROBE|Error|error" | tee $OUT/probe.txt
for v in 1 0 1; do
  el tput stage=$v
  JAXPAGED_STAGE_INPUTS=$v timeout 200 python3 $R/bench/throughput.py --model qwen2-0.5b --dataset sharegpt --no-tqdm 2>&1 | grep -E "Throughput|start-up|step|Error" | tee -a $OUT/tput.txt
done
el profile
timeout 100 python3 $R/bench/throughput.py --model qwen2-0.5b --dataset sharegpt --num-prompts 64 --profile --no-tqdm > $OUT/profile.txt 2>&1; tail -c 6000 $OUT/profile.txt > $OUT/profile_tail.txt; rm $OUT/profile.txt
el vmodule
TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1 timeout 90 python3 $R/bench/step_probe.py --model qwen2-0.5b --batches 64 --layer-dispatch scan --num-blocks 20000 --inputs staged,numpy > /tmp/vm.log 2>&1
grep PROBE /tmp/vm.log > $OUT/vmodule.txt; wc -l /tmp/vm.log >> $OUT/vmodule.txt
grep -v PROBE /tmp/vm.log | sed -E 's/^[IWE][0-9: .]+[0-9]+ //' | sed -E 's/0x[0-9a-f]+/ADDR/g; s/[0-9]+/N/g' | sort | uniq -c | sort -rn | head -60 >> $OUT/vmodule.txt
tail -c 20000 /tmp/vm.log > $OUT/vmodule_tail.txt
el done
