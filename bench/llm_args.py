"""Engine arguments shared by throughput.py and latency.py, and the per-step timing split.

Only arguments given on the command line are passed to `jaxpaged.LLM`, so the engine's own defaults
hold otherwise. `--engine-kwargs '{"name": value}'` passes anything else through.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

# The per-step split that issue 6 asks `--profile` to print. The engine exposes its counters as
# `llm.llm_engine.stats` (today an EngineStats dataclass, jaxpaged/engine/stats.py; a dict works too).
# Each field may be a cumulative number of seconds or a list of per-step values.
# The engine's host timers (cumulative seconds): schedule_s, prepare_inputs_s (padded model and sampling
# inputs), launch_s (packing + JAX dispatch), wait_s (host blocked on the sampled ids), detokenize_s, and
# the coarse execute_s / process_s. Device time and the idle gaps between device steps are not host
# timers: on a GPU `--profile` measures them from the trace itself (bench/trace_analysis.py). Sampling
# runs inside the one jitted step, so its device time is part of the step's.
STEP_FIELDS = {
    "device_s": "device time of the jitted step (from the trace)",
    "host_gap_s": "device idle between consecutive steps (from the trace)",
    "schedule_s": "Scheduler.schedule()",
    "prepare_inputs_s": "ModelRunner.prepare_inputs() + prepare_sampling()",
    "launch_s": "packing the inputs + JAX dispatch of the step",
    "wait_s": "host blocked on the device's sampled ids",
    "detokenize_s": "incremental detokenization and stop strings",
    "execute_s": "runner: prepare inputs + dispatch (engine's coarse timer)",
    "process_s": "processing step N-1's results + outputs (engine's coarse timer)",
}
WANTED_FIELDS = ("schedule_s", "prepare_inputs_s", "launch_s", "wait_s", "detokenize_s")
NUM_STEPS_FIELDS = ("num_steps", "steps")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (only given values are passed to jaxpaged.LLM)")
    g.add_argument("--model", default="qwen2-0.5b",
                   help="qwen2-0.5b | llama3-8b | smollm2-135m | tiny-llama | a folder")
    g.add_argument("--dtype", default=None, help="auto | bfloat16 | float16 | float32")
    g.add_argument("--load-format", default=None,
                   help="auto | dummy (default: dummy for generated bench models, else the engine's)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=None)
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--num-scheduler-steps", type=int, default=None,
                   help="decode steps per device program (multi-step scheduling; default: 16 offline on GPUs "
                        "where the step is one program, else 1)")
    g.add_argument("--quantization", "-q", default=None,
                   help="awq | compressed-tensors | fp8 | gguf | gptq (fp8 on a dense model: quantized at load)")
    g.add_argument("--kv-cache-dtype", default=None, help="auto | fp8 (an e4m3 KV cache)")
    g.add_argument("--calculate-kv-scales", action="store_true", default=None,
                   help="with an fp8 KV cache: per-layer scales from a calibration prompt")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--engine-kwargs", default="{}", help="JSON dict of further LLM(...) arguments")


def engine_kwargs(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """(kwargs for jaxpaged.LLM, short model name)."""
    from bench.models import MODELS, resolve_model
    path, short = resolve_model(args.model)
    kw: dict[str, Any] = {"model": path, "seed": args.seed}
    load_format = args.load_format or ("dummy" if short in MODELS and path is not None else None)
    for key, val in (("dtype", args.dtype), ("load_format", load_format), ("max_model_len", args.max_model_len),
                     ("block_size", args.block_size), ("gpu_memory_utilization", args.gpu_memory_utilization),
                     ("num_gpu_blocks_override", args.num_gpu_blocks_override),
                     ("max_num_seqs", args.max_num_seqs), ("max_num_batched_tokens", args.max_num_batched_tokens),
                     ("enable_prefix_caching", args.enable_prefix_caching),
                     ("num_scheduler_steps", args.num_scheduler_steps), ("quantization", args.quantization),
                     ("kv_cache_dtype", args.kv_cache_dtype), ("calculate_kv_scales", args.calculate_kv_scales)):
        if val is not None:
            kw[key] = val
    kw.update(json.loads(args.engine_kwargs))
    return kw, short


def make_llm(args: argparse.Namespace):
    """(LLM, kwargs, short model name, start-up seconds)."""
    from jaxpaged import LLM
    kw, short = engine_kwargs(args)
    t0 = time.perf_counter()
    llm = LLM(**kw)
    return llm, kw, short, time.perf_counter() - t0


def engine_stats(llm) -> dict[str, Any] | None:
    """A copy of `llm.llm_engine.stats` (None where the engine exposes none yet)."""
    stats = getattr(getattr(llm, "llm_engine", None), "stats", None)
    if callable(stats):
        stats = stats()
    if stats is None:
        return None
    if dataclasses.is_dataclass(stats):
        stats = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)}
    stats = dict(stats)
    # the API side's time (detokenization, stop strings) lives beside the core's, in request_stats
    request_stats = getattr(llm.llm_engine, "request_stats", None)
    if request_stats is not None and "detokenize_s" not in stats:
        stats["detokenize_s"] = request_stats.detokenize_s
    return {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in stats.items()}


# Counters that only grow (diffed over a run); any other number is a gauge (kv_cache_usage) and is kept as is.
CUMULATIVE_FIELDS = set(STEP_FIELDS) | set(NUM_STEPS_FIELDS) | {
    "prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
    "arrivals"}


def _delta(key: str, before: Any, after: Any) -> Any:
    """after - before for counters; the new tail for lists; `after` otherwise."""
    if (key in CUMULATIVE_FIELDS and isinstance(after, (int, float)) and isinstance(before, (int, float))
            and not isinstance(after, bool)):
        return after - before
    if isinstance(after, list) and isinstance(before, list):
        return after[len(before):]
    return after


def stats_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    if after is None:
        return None
    before = before or {}
    return {k: _delta(k, before.get(k), v) for k, v in after.items()}


def step_split(stats: dict[str, Any] | None, elapsed_s: float | None = None) -> dict[str, Any]:
    """Per-step means (ms) of the STEP_FIELDS found in `stats` (a delta over one run), and each one's share
    of the run's wall time `elapsed_s` (fields overlap: execute_s contains device_s, so shares need not add up)."""
    if stats is None:
        return {"available": False, "missing": list(WANTED_FIELDS),
                "note": "llm.llm_engine.stats not exposed by the engine yet"}
    num_steps = next((stats[k] for k in NUM_STEPS_FIELDS if isinstance(stats.get(k), (int, float))), None)
    totals: dict[str, float] = {}
    for key in STEP_FIELDS:
        v = stats.get(key)
        if isinstance(v, list) and v:
            totals[key] = float(sum(v))
            num_steps = num_steps or len(v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            totals[key] = float(v)
    out: dict[str, Any] = {"available": True, "num_steps": num_steps,
                           "missing": [k for k in WANTED_FIELDS if k not in totals]}
    for key, tot in totals.items():
        out[key.replace("_s", "_total_s")] = tot
        if num_steps:
            out[key.replace("_s", "_per_step_ms")] = 1000 * tot / num_steps
        if elapsed_s:
            out[key.replace("_s", "_share")] = tot / elapsed_s
    if "host_gap_s" in totals and "device_s" in totals and totals["device_s"]:
        out["host_gap_over_device"] = totals["host_gap_s"] / totals["device_s"]
    out["other_fields"] = {k: v for k, v in stats.items()
                           if k not in STEP_FIELDS and not isinstance(v, list)}
    return out


def format_split(split: dict[str, Any]) -> str:
    if not split.get("available"):
        return f"per-step split: unavailable ({split.get('note')}); missing: {', '.join(split['missing'])}"
    lines = [f"per-step split over {split.get('num_steps')} steps:"]
    for key, what in STEP_FIELDS.items():
        k = key.replace("_s", "")
        if f"{k}_total_s" in split:
            per = split.get(f"{k}_per_step_ms")
            lines.append(f"  {key:<18} {split[f'{k}_total_s']:9.3f} s total"
                         + (f"  {per:8.3f} ms/step" if per is not None else "")
                         + f"  {100 * split.get(f'{k}_share', 0):5.1f}% of wall   {what}")
    if "host_gap_over_device" in split:
        lines.append(f"  host gap / device time: {100 * split['host_gap_over_device']:.1f}% (target < 15%)")
    if split["missing"]:
        lines.append(f"  missing from llm.llm_engine.stats: {', '.join(split['missing'])}")
    if split["other_fields"]:
        lines.append(f"  other stats: {json.dumps(split['other_fields'], default=str)[:600]}")
    return "\n".join(lines)
