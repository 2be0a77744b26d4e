#!/usr/bin/env bash
# The W4A16 GEMV under Nsight Compute on the GPU machine (bench/gemv_ncu.py). Writes under $OUT (or ./ncu_out):
# the kernels' detail pages, their SASS with sampled stall reasons, and its summary (instructions, the loop's body).
#   run: bash bench/gemv_ncu.sh [--layers gate_up,down]     (carry .whl and .cache/gpu)
source bench/gpu_setup.sh
OUT=${OUT:-ncu_out}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"; "$NCU" --version | tail -1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
export XLA_FLAGS="--xla_gpu_enable_command_buffer=" XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 240 "$NCU" ${NCU_ARGS:-} --clock-control none --cache-control all -k regex:'int4_matmul|load_probe' --launch-count 16 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
  --section WarpStateStats --section SchedulerStats --section SourceCounters --section ComputeWorkloadAnalysis \
  --import-source no -o "$OUT/gemv" python3 bench/gemv_ncu.py "$@" > "$OUT/ncu_run.txt" 2>&1
echo "ncu rc=$?"; tail -5 "$OUT/ncu_run.txt"
"$NCU" -i "$OUT/gemv.ncu-rep" --page details > "$OUT/details.txt" 2>&1
"$NCU" -i "$OUT/gemv.ncu-rep" --page source --print-source sass --csv > "$OUT/sass.csv" 2>&1
python3 bench/gemv_ncu.py --summarize "$OUT/sass.csv" | tee "$OUT/sass_summary.txt"
grep -E "^  [a-z_]+ \(|Duration|Issue Slots Busy|DRAM Throughput" "$OUT/details.txt"
