"""The environment variables users set, in one place, read once at import. What runs is not chosen here:
that is config.resolve(), from the engine arguments and the platform."""
from __future__ import annotations

import os
import pathlib

# Where the converted default model, the XLA compilation cache and the compiled steps live.
JAXPAGED_CACHE_ROOT = pathlib.Path(os.environ.get("JAXPAGED_CACHE_ROOT", pathlib.Path.home() / ".cache" / "jaxpaged"))
# XLA's persistent compilation cache (as vLLM's VLLM_XLA_CACHE_PATH). Fixed here rather than derived from the root
# when an engine starts: JAX opens its cache once per process, at the first compile after the folder is set, so a
# later engine pointed at another root could not move it anyway.
JAXPAGED_XLA_CACHE_PATH = pathlib.Path(os.environ.get("JAXPAGED_XLA_CACHE_PATH", JAXPAGED_CACHE_ROOT / "xla"))
# Keep compiled programs on disk (XLA's persistent cache and the engine's executables); "0" disables.
JAXPAGED_COMPILE_CACHE = os.environ.get("JAXPAGED_COMPILE_CACHE", "1") != "0"
# KV budget on the CPU backend, which reports no device memory (MiB), as vLLM's VLLM_CPU_KVCACHE_SPACE.
JAXPAGED_CPU_KV_CACHE_MIB = int(os.environ.get("JAXPAGED_CPU_KV_CACHE_MIB", "512"))
# Log every XLA compilation (for checking that nothing recompiles in steady state).
JAXPAGED_LOG_COMPILES = os.environ.get("JAXPAGED_LOG_COMPILES", "0") == "1"
# The server's API key when --api-key is not given (as vLLM's VLLM_API_KEY): keeps the key off the command line.
JAXPAGED_API_KEY = os.environ.get("JAXPAGED_API_KEY") or None
# As vLLM: give the `jaxpaged` logger its own INFO handler (start-up facts such as the KV pool size),
# unless the application configures logging itself ("0").
JAXPAGED_CONFIGURE_LOGGING = os.environ.get("JAXPAGED_CONFIGURE_LOGGING", "1") != "0"
# Threads that compile (and read from the executable cache) the step and head programs at start-up and in the
# background: XLA compiles one program a thread. Default: the host's cores, at least 8 and at most 16. On an H100
# host of 16 cores, llama3-8b's 29 buckets compiled in 37 s on 16 threads against 48-49 s on 8 (cold /health 50 s
# against 61 s, one machine: bench/results/NOTES.md); the lowering workers are done after the first ~14 s, and
# from there 8 threads left half the cores idle.
JAXPAGED_STARTUP_THREADS = int(os.environ.get("JAXPAGED_STARTUP_THREADS") or min(16, max(8, os.cpu_count() or 8)))
# A CSV path: the server's engine core records every step and every arrival and writes them there when it
# stops (engine/stats.py write_core_step_log), for reading a burst's first steps (bench/serve_vs_offline.sh).
# The record grows by a row a step and a request: for a benchmark's run, not for a server that runs for days.
JAXPAGED_STEP_LOG = os.environ.get("JAXPAGED_STEP_LOG") or None

# JAX preallocates 75% of GPU memory by default; jaxpaged sizes its own pool from
# gpu_memory_utilization, so let XLA's allocator see nearly all of it (the user's setting wins).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
# The fraction actually in force (jax may have started before jaxpaged was imported: then XLA's 0.75).
XLA_MEM_FRACTION = float(os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"])


def with_xla_default(flags: str, name: str, value: str) -> str:
    """XLA_FLAGS with `--name=value` added, unless the user's flags already set `name`."""
    if f"--{name}=" in flags or flags.split().count(f"--{name}"):
        return flags
    return f"{flags} --{name}={value}".strip()


# Two XLA defaults for the engine's programs (the user's XLA_FLAGS win, flag by flag). Like the allocator's
# fraction, they take effect only if jax has not started its backend before jaxpaged is imported.
# - Triton GEMM fusions off: every matmul goes to cuBLAS, whose algorithm XLA picks from a few candidates,
#   where each Triton fusion had its tilings compiled and timed on the GPU. That autotuning was most of a
#   cold start-up's compile time (llama3-8b on the H100: 35 buckets compiled in 42 s instead of 78 s), and
#   the programs run as fast.
# - No rematerialization: XLA's memory estimate for a step counts the donated KV pool up to three times, so
#   on a GPU whose pool fills its memory every step program looked over the limit, and the pass recomputed
#   small fusions in every layer to save memory that was never short (qwen2-0.5b's one-request decode: 3
#   extra kernels a layer, 1.24 ms a token instead of 1.18). What keeps the programs within memory is the
#   room the pool leaves for a step's temporaries (engine/cache_sizing.py activation_reserve), and the warm-up
#   runs every bucket's program once before the engine serves.
_flags = with_xla_default(os.environ.get("XLA_FLAGS", ""), "xla_gpu_enable_triton_gemm", "false")
os.environ["XLA_FLAGS"] = with_xla_default(_flags, "xla_disable_hlo_passes", "rematerialization")
