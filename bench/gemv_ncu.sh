#!/usr/bin/env bash
# The W4A16 GEMV under Nsight Compute on the GPU machine (bench/gemv_ncu.py, through bench/ncu_profile.sh).
#   run: bash bench/gemv_ncu.sh [--layers gate_up,down]     (carry .whl and .cache/gpu)
exec bash bench/ncu_profile.sh gemv 'int4_matmul|load_probe' 16 bench/gemv_ncu.py "$@"
