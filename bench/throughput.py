"""Offline throughput through jaxpaged's `LLM.generate`, as vLLM's benchmarks/benchmark_throughput.py.

All requests are handed to the engine at once; every request generates exactly its workload output
length (`ignore_eos=True`, `max_tokens`=output length, temperature 1.0, top_p 1.0). Prints vLLM's line
  Throughput: X requests/s, Y total tokens/s, Z output tokens/s
and writes bench/results/<name>.json + .md.

`--profile` wraps the timed run in `jax.profiler.trace` (bench/results/traces/<name>/, open it in
Perfetto or TensorBoard), prints the engine's per-step split (llm.llm_engine.stats) and the device
busy/idle split measured from the trace itself.

Examples:
  python -m bench.throughput --model qwen2-0.5b --dataset sharegpt --num-prompts 1000
  python -m bench.throughput --model tiny-llama --dataset sharegpt-like --num-prompts 8 --max-model-len 2048
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):   # run as a file: see bench/common.py add_repo_to_path
    _bench = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _bench]
    sys.path.append(str(_bench.parent))

from bench.datasets import DATASETS, SampleRequest  # noqa: E402
from bench.llm_args import add_engine_args  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", choices=DATASETS, default="sharegpt")
    p.add_argument("--num-prompts", type=int, default=None, help="default: the workload's (1000 / 100)")
    p.add_argument("--input-len", type=int, default=None, help="override random/openqa/longalpaca input length")
    p.add_argument("--output-len", type=int, default=None, help="override their output length")
    p.add_argument("--warmup-prompts", type=int, default=0,
                   help="run this many prompts first, untimed (compilation not done at start-up)")
    p.add_argument("--profile", action="store_true", help="JAX profiler trace + per-step split")
    p.add_argument("--profile-graph-trace", action="store_true",
                   help="with --profile on a GPU: CUPTI traces each CUDA graph launch as one device event "
                        "(gpu_enable_cupti_activity_graph_trace) instead of every kernel inside it. Kernel-level "
                        "tracing of graphs holds the host in each cuGraphLaunch (~0.9 ms for a 500-node graph on "
                        "the H100), which distorts the host gap it is meant to measure")
    p.add_argument("--step-log", default=None, metavar="CSV",
                   help="write one row per engine step: seconds from the previous step's results to its own, "
                        "tokens, requests, context tokens read, garbage-collection seconds (all, generation 2); "
                        "and a plot beside it (.png)")
    p.add_argument("--result-name", default=None, help="results file stem (default throughput-<model>-<dataset>)")
    p.add_argument("--no-tqdm", action="store_true")
    add_engine_args(p)
    return p.parse_args(argv)


def build_inputs(requests: list[SampleRequest]):
    """(prompts as {"prompt_token_ids"} dicts, one SamplingParams per request)."""
    from jaxpaged import SamplingParams
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=r.output_len, ignore_eos=True)
              for r in requests]
    return prompts, params


def count_tokens(requests: list[SampleRequest], outputs) -> dict[str, int]:
    """Prompt and generated tokens actually seen in the outputs, and how many requests got a wrong length."""
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    wrong = sum(len(o.outputs[0].token_ids) != r.output_len for r, o in zip(requests, outputs))
    return {"total_prompt_tokens": prompt_tokens, "total_output_tokens": out_tokens,
            "requested_output_tokens": sum(r.output_len for r in requests), "num_wrong_output_len": wrong}


def request_latencies(outputs) -> dict[str, float]:
    """Mean TTFT / E2E (s) from each output's `.metrics`, where the engine fills them."""
    import numpy as np
    ttft, e2e = [], []
    for o in outputs:
        m = getattr(o, "metrics", None)
        if m is None or getattr(m, "first_token_time", None) is None:
            continue
        ttft.append(m.first_token_time - m.arrival_time)
        if getattr(m, "finished_time", None) is not None:
            e2e.append(m.finished_time - m.arrival_time)
    out: dict[str, float] = {}
    if ttft:
        out.update(mean_ttft_s=float(np.mean(ttft)), p99_ttft_s=float(np.percentile(ttft, 99)))
    if e2e:
        out.update(mean_e2e_s=float(np.mean(e2e)), p99_e2e_s=float(np.percentile(e2e, 99)))
    return out


def throughput_line(num_requests: int, total_tokens: int, output_tokens: int, elapsed: float) -> str:
    return (f"Throughput: {num_requests / elapsed:.2f} requests/s, {total_tokens / elapsed:.2f} total tokens/s, "
            f"{output_tokens / elapsed:.2f} output tokens/s")


def _time_gc() -> tuple[list, Any]:
    """Record (start, end, generation) of every garbage collection from now on (perf_counter seconds).
    Returns the list and the gc callback, which the caller removes from gc.callbacks when done."""
    pauses: list = []
    started = [0.0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((started[0], time.perf_counter(), info.get("generation", -1)))
    gc.callbacks.append(callback)
    return pauses, callback


def write_step_log(path: str, rows: list, t0: float, gc_pauses: list) -> None:
    """CSV of the engine's per-step rows; each step's seconds measured from the previous step's results to its
    own, and the seconds of garbage collection (of generation 2 separately) that ended inside that interval."""
    import numpy as np
    a = np.array(rows, np.float64).reshape(-1, 4)
    ends = a[:, 0].copy()
    gc_s, gc2_s = np.zeros(len(a)), np.zeros(len(a))
    for start, end, gen in gc_pauses if len(a) else ():      # a collection after the last step: counted there
        i = min(int(np.searchsorted(ends, end)), len(a) - 1)
        gc_s[i] += end - start
        if gen == 2:
            gc2_s[i] += end - start
    if len(a):
        a[:, 0] = np.diff(ends, prepend=t0)
    a = np.column_stack([a, gc_s, gc2_s])
    np.savetxt(path, a, fmt=["%.6f", "%d", "%d", "%d", "%.6f", "%.6f"], delimiter=",",
               header="seconds,tokens,requests,context_tokens,gc_seconds,gc_gen2_seconds")
    print(f"step log: {len(a)} steps -> {path}; garbage collection {gc_s.sum():.3f} s "
          f"({len(gc_pauses)} collections, generation 2: {gc2_s.sum():.3f} s)")
    plot_step_log(a, str(Path(path).with_suffix(".png")))


def plot_step_log(a, png: str) -> None:
    """Each step's time against its request count, decode-only steps and steps with prompt tokens apart."""
    if not len(a):
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    seconds, tokens, requests = a[:, 0], a[:, 1], a[:, 2]
    decode = tokens == requests
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.scatter(requests[decode], 1e3 * seconds[decode], s=4, label="decode-only steps")
    ax.scatter(requests[~decode], 1e3 * seconds[~decode], s=12, marker="x", label="steps with prompt tokens")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("requests in the step")
    ax.set_ylabel("ms since the previous step")
    ax.set_title(f"{len(a)} steps, {seconds.sum():.2f} s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace, argv: list[str] | None = None) -> dict[str, Any]:
    from bench import trace_analysis
    from bench.common import RESULTS_DIR, stamp, write_result
    from bench.datasets import get_dataset, summarize
    from bench.llm_args import engine_stats, format_split, make_llm, stats_delta, step_split

    requests = get_dataset(args.dataset, args.model, args.num_prompts, args.seed, args.input_len, args.output_len)
    print(f"workload {args.dataset}: {summarize(requests)}")
    llm, kw, short, startup_s = make_llm(args)
    print(f"engine start-up: {startup_s:.1f} s  ({kw})")
    if args.warmup_prompts:
        prompts, params = build_inputs(requests[:args.warmup_prompts])
        llm.generate(prompts, params, use_tqdm=False)
    prompts, params = build_inputs(requests)
    name = args.result_name or f"throughput-{short}-{args.dataset}"
    trace_dir = RESULTS_DIR / "traces" / name
    before = engine_stats(llm)
    profiling = contextlib.nullcontext()
    if args.profile:
        import jax
        trace_dir.mkdir(parents=True, exist_ok=True)
        options = jax.profiler.ProfileOptions()
        if args.profile_graph_trace:
            options.advanced_configuration = {"gpu_enable_cupti_activity_graph_trace": True}
        profiling = jax.profiler.trace(str(trace_dir), create_perfetto_trace=True, profiler_options=options)
    gc_pauses, gc_callback = [], None
    with profiling:
        if args.step_log:      # collections timed over the generate call only (not the profiler's start/stop)
            llm.llm_engine.stats.step_log = []
            gc_pauses, gc_callback = _time_gc()
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=not args.no_tqdm)
        elapsed = time.perf_counter() - t0
        if gc_callback is not None:
            gc.callbacks.remove(gc_callback)
    counts = count_tokens(requests, outputs)
    total = counts["total_prompt_tokens"] + counts["total_output_tokens"]
    print(throughput_line(len(requests), total, counts["total_output_tokens"], elapsed))
    print(f"Total num prompt tokens:  {counts['total_prompt_tokens']}")
    print(f"Total num output tokens:  {counts['total_output_tokens']}")
    if counts["num_wrong_output_len"]:
        print(f"WARNING: {counts['num_wrong_output_len']} requests did not generate exactly their output length")
    metrics: dict[str, Any] = {
        "model": short, "dataset": args.dataset, "num_requests": len(requests), "elapsed_time": elapsed,
        "requests_per_second": len(requests) / elapsed, "tokens_per_second": total / elapsed,
        "output_tokens_per_second": counts["total_output_tokens"] / elapsed, **counts,
        "engine_startup_s": startup_s, "engine_kwargs": {k: str(v) for k, v in kw.items()},
        "num_scheduler_steps": llm.llm_engine.num_scheduler_steps,       # as resolved (the default by platform)
        "layer_dispatch": llm.llm_engine.run.layer_dispatch,
        "workload": summarize(requests), **request_latencies(outputs)}
    delta = stats_delta(before, engine_stats(llm))
    if delta is not None:     # the engine's own timers cost nothing: print the split on every run
        split = step_split(delta, elapsed)
        print(format_split(split))
        metrics["step_split"] = split
        metrics["engine_stats"] = {k: v for k, v in delta.items() if not isinstance(v, list)}
    if args.step_log:
        write_step_log(args.step_log, llm.llm_engine.stats.step_log, t0, gc_pauses)
    if args.profile:
        dev = trace_analysis.analyze(str(trace_dir), detail=True)
        metrics["trace"] = dev or {"note": "no device events in the trace (CPU backend?)", "dir": str(trace_dir)}
        if dev:
            print(f"trace: device busy {dev['device_busy_ms']:.1f} ms of {dev['span_ms']:.1f} ms "
                  f"({100 * dev['device_busy_fraction']:.1f}%), idle {dev['device_idle_ms']:.1f} ms")
            steps = max(1, (delta or {}).get("num_steps", 1))
            print("trace, per engine step: host events (us)  " + "; ".join(
                f"{e['name'][:48]} {1000 * e['total_ms'] / steps:.0f} ({e['count'] / steps:.1f}x)"
                for e in dev["top_host_events"][:20]))
            print("trace, idle gaps by neighbours  " + "; ".join(
                f"{g['before'][:30]} -> {g['after'][:30]}: {g['count']} x {g['mean_us']:.0f} us"
                for g in dev["gaps_by_neighbours"][:8]))
            if dev.get("one_launch"):
                print("trace, one launch (the median PjRt Execute) in detail:")
                for e in dev["one_launch"]:
                    print(f"  {e['at_us']:8.1f} us  {e['dur_us']:8.1f} us  {'  ' * e['depth']}{e['name']}")
        print(f"trace written to {trace_dir}")
    meta = stamp(sys.argv if argv is None else ["bench/throughput.py"] + list(argv))
    path = write_result(name, metrics, meta=meta, title=f"offline throughput: {short}, {args.dataset}")
    print(f"results: {path}")
    return metrics


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run(parse_args(argv), argv)


if __name__ == "__main__":
    main()
