"""Every environment variable jaxpaged reads, in one place. Read once at import."""
from __future__ import annotations

import os
import pathlib

# Where the converted default model and the XLA compilation cache live.
JAXPAGED_CACHE_ROOT = pathlib.Path(os.environ.get("JAXPAGED_CACHE_ROOT", pathlib.Path.home() / ".cache" / "jaxpaged"))
# Override the attention implementation: reference | xla | pallas | mosaic (default: by platform and GPU).
JAXPAGED_ATTENTION_BACKEND = os.environ.get("JAXPAGED_ATTENTION_BACKEND") or None
# How a step runs the layers: scan | per_layer | unrolled (default: by a layer's size, platform and usage:
# runner/layerwise.py default_dispatch).
JAXPAGED_LAYER_DISPATCH = os.environ.get("JAXPAGED_LAYER_DISPATCH") or None
# Per-layer dispatch: layers per dispatched program (default: runner/layerwise.py LAYERS_PER_DISPATCH).
JAXPAGED_LAYER_GROUP = int(os.environ.get("JAXPAGED_LAYER_GROUP") or 0) or None
# Launch each step's JAX computation from a second thread while the engine processes the previous step.
JAXPAGED_LAUNCH_THREAD = os.environ.get("JAXPAGED_LAUNCH_THREAD", "0") == "1"
# Write each step's packed inputs in place into persistent pinned host buffers that the step copies to
# the device itself, instead of handing it new host arrays (a transfer call per array, which held the
# host for about a device step on the H100; runner/step_inputs.py, HostInputs). "0": new arrays.
JAXPAGED_PINNED_INPUTS = os.environ.get("JAXPAGED_PINNED_INPUTS", "1") != "0"
# Elements (4 bytes each) that every piece of a step's packed inputs starts at a multiple of (unset: 64 for
# unrolled layers, whose Mosaic GPU calls need the 256-byte grid, else 1; runner/step_inputs.py). For
# measuring: 1 breaks the unrolled dispatch's start-up on GPUs.
_align = os.environ.get("JAXPAGED_INPUT_ALIGN")
JAXPAGED_INPUT_ALIGN = max(1, int(_align)) if _align else None
# Keep each bucket's compiled step on disk and load it at start-up, skipping tracing (runner/exec_cache.py).
# "1" / "0"; unset: on for GPUs (warm start-up of qwen2-0.5b on an H100: 17.3 s against 30.7 s without it),
# off on the CPU, where XLA:CPU cannot run some deserialized bf16 programs (they would fall back anyway).
_exec_cache = os.environ.get("JAXPAGED_EXEC_CACHE")
JAXPAGED_EXEC_CACHE: bool | None = None if _exec_cache in (None, "") else _exec_cache == "1"
# Start-up threads with the executable cache on: they deserialize the cached steps and XLA-compile the
# others, all before the warm-up runs them one by one (1: each bucket loaded or compiled in its turn).
JAXPAGED_STARTUP_THREADS = max(1, int(os.environ.get("JAXPAGED_STARTUP_THREADS") or 8))
# The server's engine thread shares the GIL with the HTTP event loop: how long (ms) a thread may hold it
# while another waits. Python's 5 ms is longer than a small model's whole step: on an H100, qwen2-0.5b
# openqa at concurrency 10 gave 3,031 output tok/s with it and 3,574 with 0.5 ms. Empty: Python's.
_switch = os.environ.get("JAXPAGED_GIL_SWITCH_INTERVAL_MS", "0.5")
JAXPAGED_GIL_SWITCH_INTERVAL_MS: float | None = float(_switch) if _switch else None
# Persistent XLA compilation cache (set to "0" to disable).
JAXPAGED_COMPILE_CACHE = os.environ.get("JAXPAGED_COMPILE_CACHE", "1") != "0"
# KV budget on the CPU backend, which reports no device memory (MiB).
JAXPAGED_CPU_KV_CACHE_MIB = int(os.environ.get("JAXPAGED_CPU_KV_CACHE_MIB", "512"))
# Log every XLA compilation (for checking that nothing recompiles in steady state).
JAXPAGED_LOG_COMPILES = os.environ.get("JAXPAGED_LOG_COMPILES", "0") == "1"

# JAX preallocates 75% of GPU memory by default; jaxpaged sizes its own pool from
# gpu_memory_utilization, so let XLA's allocator see nearly all of it (the user's setting wins).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
# The fraction actually in force (jax may have started before jaxpaged was imported: then XLA's 0.75).
XLA_MEM_FRACTION = float(os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"])
# As vLLM: give the `jaxpaged` logger its own INFO handler (start-up facts such as the KV pool size),
# unless the application configures logging itself ("0").
JAXPAGED_CONFIGURE_LOGGING = os.environ.get("JAXPAGED_CONFIGURE_LOGGING", "1") != "0"
