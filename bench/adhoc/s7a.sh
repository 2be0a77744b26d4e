#!/usr/bin/env bash
# seventh session, call A (dca8934): inputs copied into donated device buffers (JAXPAGED_STAGE_INPUTS, since
# replaced) against fresh host arrays, then XLA's command-buffer update log
source bench/adhoc/preamble.sh
SWITCH=JAXPAGED_STAGE_INPUTS MODE=staged source $R/bench/adhoc/inputs_ab.sh
el vmodule
TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1 timeout 90 python3 $R/bench/step_probe.py --model qwen2-0.5b --batches 64 --layer-dispatch scan --num-blocks 20000 --inputs staged,numpy > /tmp/vm.log 2>&1
grep PROBE /tmp/vm.log > $OUT/vmodule.txt; wc -l /tmp/vm.log >> $OUT/vmodule.txt
grep -v PROBE /tmp/vm.log | sed -E 's/^[IWE][0-9: .]+[0-9]+ //' | sed -E 's/0x[0-9a-f]+/ADDR/g; s/[0-9]+/N/g' | sort | uniq -c | sort -rn | head -60 >> $OUT/vmodule.txt
tail -c 20000 /tmp/vm.log > $OUT/vmodule_tail.txt
el done
