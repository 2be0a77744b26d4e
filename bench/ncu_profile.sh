#!/usr/bin/env bash
# A kernel under Nsight Compute on the GPU machine, one device call. Writes under $OUT (or ./ncu_out): the kernels'
# detail pages, their SASS with sampled stall reasons, and its summaries (bench/gemv_ncu.py --summarize: instructions
# executed, the loop's body by opcode; --blocks: the basic blocks by stall samples).
#   bash bench/ncu_profile.sh NAME KERNEL_REGEX LAUNCHES DRIVER.py [driver args]     (carry .whl and .cache/gpu)
# e.g. bench/gemv_ncu.sh (the W4A16 GEMV) and bench/decode_ncu.py (the decode attention kernels).
NAME=${1:?name}; KERNELS=${2:?kernel name regex}; LAUNCHES=${3:?launch count}; DRIVER=${4:?driver}; shift 4
source bench/gpu_setup.sh
OUT=${OUT:-ncu_out}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"; "$NCU" --version | tail -1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
# XLA's preallocation keeps ncu from profiling; command buffers would hide the kernels inside CUDA graphs
export XLA_FLAGS="--xla_gpu_enable_command_buffer=" XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 240 "$NCU" ${NCU_ARGS:-} --clock-control none --cache-control all -k regex:"$KERNELS" --launch-count "$LAUNCHES" \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
  --section WarpStateStats --section SchedulerStats --section SourceCounters --section ComputeWorkloadAnalysis \
  --import-source no -o "$OUT/$NAME" python3 "$DRIVER" "$@" > "$OUT/ncu_run.txt" 2>&1
echo "ncu rc=$?"; tail -5 "$OUT/ncu_run.txt"
"$NCU" -i "$OUT/$NAME.ncu-rep" --page details > "$OUT/details.txt" 2>&1
"$NCU" -i "$OUT/$NAME.ncu-rep" --page source --print-source sass --csv > "$OUT/sass.csv" 2>&1
python3 bench/gemv_ncu.py --summarize "$OUT/sass.csv" | tee "$OUT/sass_summary.txt"
python3 bench/gemv_ncu.py --blocks "$OUT/sass.csv" > "$OUT/sass_blocks.txt"; head -40 "$OUT/sass_blocks.txt"
grep -E "^  [a-zA-Z_0-9]+.*\(|Duration|Issue Slots Busy|DRAM Throughput|Stall|Warp Cycles Per Issued" "$OUT/details.txt" | head -80
