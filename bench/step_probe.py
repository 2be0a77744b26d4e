"""Probe one decode step's cost on the GPU: blocking latency, pipelined (back-to-back) time and launch
time per step, for batch sizes 1..256, the step run as the engine runs it (its resolved layer dispatch,
inputs in its pinned host buffers).

    python3 bench/step_probe.py --model llama3-8b --batches 1,64,256 [--trace DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))


def decode_inputs(runner, rows: int, ctx: int, table_blocks: int, rng):
    """One decode token for each of `rows` requests at context `ctx`, their first `table_blocks` table entries
    random distinct blocks of the runner's pool (the rest the null block)."""
    import numpy as np

    from jaxpaged.models import AttentionMetadata
    from jaxpaged.runner.inputs import ModelInput
    tables = np.zeros((rows, runner.max_blocks_per_req), np.int32)
    tables[:, :table_blocks] = rng.permutation(np.arange(1, runner.num_blocks))[:rows * table_blocks].reshape(
        rows, table_blocks)
    pos = np.full(rows, ctx - 1, np.int32)
    slots = tables[np.arange(rows), pos // runner.block_size] * runner.block_size + pos % runner.block_size
    meta = AttentionMetadata(pos, slots, tables, np.full(rows, ctx, np.int32), np.arange(rows + 1, dtype=np.int32))
    return ModelInput(rng.integers(100, 1000, rows).astype(np.int32), meta, np.arange(rows, dtype=np.int32),
                      np.full(rows, rows, np.int32), np.zeros(rows, np.int32), np.zeros(0, np.int32))


def time_decode_steps(llm, batches=(1, 16, 64, 256), ctx: int = 512, trace_dir: str | None = None) -> dict:
    """Per decode step (model + sampler, context `ctx` each): blocking latency, back-to-back time, and how
    long the launch holds the host."""
    import jax
    import numpy as np

    from jaxpaged.runner.buckets import Bucket
    from jaxpaged.runner.sampler import SamplerFlags

    runner = llm.llm_engine.runner
    programs = runner.programs
    rng = np.random.default_rng(0)
    res = {}
    for R in batches:
        mi = decode_inputs(runner, R, ctx, ctx // runner.block_size, rng)
        bucket = Bucket(R, R, True)
        _, si = programs.dummy_inputs(bucket)
        options = programs.options(bucket, 1)

        def step():
            runner.kv_cache, runner.prev_sampled, r = programs(runner.kv_cache, runner.prev_sampled, mi, si,
                                                               options=options, flags=SamplerFlags())
            return r

        t0 = time.perf_counter()
        jax.block_until_ready(step())
        compile_s = time.perf_counter() - t0
        lat = []
        for _ in range(20):
            t0 = time.perf_counter()
            jax.block_until_ready(step())
            lat.append(time.perf_counter() - t0)
        n = 50
        launch = []        # how long the call itself holds the host: near the step time = launch is synchronous
        t0 = time.perf_counter()
        for _ in range(n):
            t1 = time.perf_counter()
            r = step()
            launch.append(time.perf_counter() - t1)
        jax.block_until_ready(r)
        res[R] = {"blocking_us": round(float(np.median(lat)) * 1e6),
                  "pipelined_us": round((time.perf_counter() - t0) / n * 1e6),
                  "launch_us": round(float(np.median(launch)) * 1e6), "compile_s": round(compile_s, 1)}
        if trace_dir is not None:      # 10 pipelined steps under the profiler: the kernels by total time
            from bench import trace_analysis
            d = f"{trace_dir}/R{R}"
            with jax.profiler.trace(d, create_perfetto_trace=True):
                for _ in range(10):
                    r = step()
                jax.block_until_ready(r)
            events = trace_analysis.load_events(d)
            if events:
                res[R]["busy"] = trace_analysis.analyze_events(events)
                res[R]["top_kernels_per_10_steps"] = trace_analysis.top_kernels(events, 25)
                res[R]["top_host_events_per_10_steps"] = trace_analysis.top_host_events(events, 30)
                res[R]["gaps_by_neighbours"] = trace_analysis.gaps_by_neighbours(events)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2-0.5b")
    ap.add_argument("--backend", default=None, help="attention backend (default: the resolved one)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--label", default="")
    ap.add_argument("--num-blocks", type=int, default=None, help="KV pool size (default: sized from memory)")
    ap.add_argument("--layer-dispatch", choices=["scan", "per_layer", "unrolled"], default=None,
                    help="default: the resolved one (config.resolve)")
    ap.add_argument("--trace", default=None, help="folder: trace 10 steps per batch, list the top kernels")
    args = ap.parse_args()
    from bench.models import ensure_model_dir
    from jaxpaged import LLM
    llm = LLM(model=ensure_model_dir(args.model), load_format="dummy", dtype="bfloat16", max_model_len=2048,
              attention_backend=args.backend, compile_buckets=False, num_gpu_blocks_override=args.num_blocks,
              layer_dispatch=args.layer_dispatch, num_scheduler_steps=1)
    run = llm.llm_engine.run
    res = {"label": args.label, "backend": run.attention_backend, "layer_dispatch": run.layer_dispatch}
    batches = [int(b) for b in args.batches.split(",")]
    print("PROBE", json.dumps({**res, **time_decode_steps(llm, batches, args.ctx, args.trace)}), flush=True)


if __name__ == "__main__":
    main()
