#!/usr/bin/env bash
source bench/adhoc/preamble.sh
el equal
timeout 100 python3 $R/bench/adhoc/equal_check.py 1 2>&1 | grep TOKENS > /tmp/t1.txt
JAXPAGED_PINNED_INPUTS=0 timeout 100 python3 $R/bench/adhoc/equal_check.py 1 2>&1 | grep TOKENS > /tmp/t0.txt
timeout 100 python3 $R/bench/adhoc/equal_check.py 8 2>&1 | grep TOKENS > /tmp/t8.txt
python3 - <<'PY' | tee $OUT/equal.txt
import json
t = {k: json.loads(open(f"/tmp/t{k}.txt").read().split(" ", 1)[1]) for k in ("1", "0", "8")}
print("EQUAL pinned==fresh:", t["1"] == t["0"], " pinned==multistep8:", t["1"] == t["8"],
      " sequences:", len(t["1"]), " tokens each:", sorted({len(x) for x in t["1"]}))
PY
for k in 16; do
el tput ms$k
timeout 170 python3 $R/bench/throughput.py --model qwen2-0.5b --dataset sharegpt --no-tqdm --num-scheduler-steps $k --result-name tput-ms$k 2>&1 | grep -E "Throughput|start-up" | tee -a $OUT/tput.txt
el profile ms$k
timeout 110 python3 $R/bench/throughput.py --model qwen2-0.5b --dataset sharegpt --num-prompts 64 --profile --no-tqdm --num-scheduler-steps $k --result-name prof-ms$k > /tmp/p.txt 2>&1; grep -E "Throughput|trace:|_s  " /tmp/p.txt | tee -a $OUT/profile.txt
done
el done
