#!/usr/bin/env bash
# seventh session, call B (5156246): inputs written in place into pinned host buffers (HostInputs) against
# fresh host arrays, then the probe of the unrolled step
source bench/adhoc/preamble.sh
SWITCH=JAXPAGED_PINNED_INPUTS MODE=host_inputs source $R/bench/adhoc/inputs_ab.sh
el probe-unrolled
timeout 150 python3 $R/bench/step_probe.py --model qwen2-0.5b --batches 1,16,64,256 --layer-dispatch unrolled --num-blocks 20000 --inputs numpy,host_inputs 2>&1 | grep -E "PROBE|Error|error" | tee -a $OUT/probe.txt
el done
