#!/usr/bin/env bash
# seventh session, call F: per-layer dispatch with the inputs in pinned host buffers: probe, and greedy tokens
# equal to the scan's
source bench/adhoc/preamble.sh
el probe per_layer
timeout 120 python3 $R/bench/step_probe.py --model qwen2-0.5b --batches 1,64 --layer-dispatch per_layer --num-blocks 20000 --inputs numpy,host_inputs 2>&1 | grep -E "PROBE|Error|error" | tee $OUT/probe.txt
el equal
timeout 100 python3 $R/bench/adhoc/equal_check.py 1 2>&1 | grep TOKENS > /tmp/ts.txt
JAXPAGED_LAYER_DISPATCH=per_layer timeout 100 python3 $R/bench/adhoc/equal_check.py 1 2>&1 | grep TOKENS > /tmp/tp.txt
python3 -c "
import json
a, b = (json.loads(open(f).read().split(' ', 1)[1]) for f in ('/tmp/ts.txt', '/tmp/tp.txt'))
print('EQUAL scan==per_layer (pinned inputs):', a == b, len(a), 'sequences')" | tee $OUT/equal.txt
el done
