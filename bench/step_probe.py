"""Probe one decode step's cost on the GPU: blocking latency and pipelined (back-to-back) time per step,
for batch sizes 1..256, under the current XLA_FLAGS and the given scan unroll.

    python3 bench/step_probe.py --model qwen2-0.5b --unroll 1 --backend pallas
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))


INPUTS = ("numpy", "host_inputs", "put", "put_alias", "pinned", "device")


def time_decode_steps(llm, batches=(1, 16, 64, 256), ctx: int = 512, unroll: int = 1,
                      trace_dir: str | None = None, inputs: str = "numpy") -> dict:
    """Per decode step (model + sampler, context `ctx` each): blocking latency and back-to-back time.

    inputs: "numpy" passes a fresh copy of the packed host arrays every step, which the call copies to
    the device (the engine's way with JAXPAGED_PINNED_INPUTS=0);
    "host_inputs" writes them in place into the runner's persistent pinned host buffers, which the step
    copies to the device itself (HostInputs, the engine's default: no transfer call on the host);
    "put" / "put_alias" copy fresh host arrays with jax.device_put (may_alias=True for the second) before
    the call; "pinned" puts them into pinned host memory first, then onto the device; "device" packs and
    copies them once and passes the same device arrays every step. The sampled-token buffer is donated
    to the step and comes back in place in every mode. Tells how much of a launch is the inputs' copy."""
    import jax
    import numpy as np

    from jaxpaged.models import AttentionMetadata
    from jaxpaged.runner.buckets import Bucket
    from jaxpaged.runner.model_runner import ModelInput
    from jaxpaged.runner.step_inputs import HostInputs, pack
    from jaxpaged.runner.sampler import SamplerFlags
    runner = llm.llm_engine.runner
    rng = np.random.default_rng(0)
    res = {}
    for R in batches:
        nb = ctx // runner.block_size
        tables = np.zeros((R, runner.max_blocks_per_req), np.int32)
        tables[:, :nb] = rng.permutation(np.arange(1, runner.num_blocks))[:R * nb].reshape(R, nb)
        seq = np.full(R, ctx, np.int32)
        pos = seq - 1
        slots = tables[np.arange(R), pos // runner.block_size] * runner.block_size + pos % runner.block_size
        meta = AttentionMetadata(pos, slots, tables, seq, np.arange(R + 1, dtype=np.int32))
        mi = ModelInput(rng.integers(0, 1000, R).astype(np.int32), meta, np.arange(R, dtype=np.int32),
                        np.full(R, R, np.int32), np.zeros(R, np.int32), np.zeros(0, np.int32))
        _, si = runner._dummy_inputs(Bucket(R, R, True))
        si.temperature = np.ones(R, np.float32)
        opts = dataclasses.replace(runner.options(Bucket(R, R, True), 1), scan_unroll=unroll)

        ints, floats, layout = pack((mi, si), runner.input_align)
        dev = jax.devices()[0]
        pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
        on_device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
        if inputs == "device":
            ints, floats = jax.device_put(ints, dev), jax.device_put(floats, dev)
        put = {"numpy": lambda x: np.array(x), "host_inputs": None,
               "put": lambda x: jax.device_put(np.array(x), dev),
               "put_alias": lambda x: jax.device_put(np.array(x), dev, may_alias=True),
               "pinned": lambda x: jax.device_put(jax.device_put(np.array(x), pinned), on_device),
               "device": lambda x: x}[inputs]
        # deeper than the engine's (which has at most two steps queued): the back-to-back loop below queues
        # steps as fast as it launches them, and must not wait for a free slot inside the timed launch
        host = HostInputs(depth=80) if inputs == "host_inputs" else None

        def step():
            if host is not None:
                slot = host.write(ints, floats)
                i, f = slot.arrays
            else:
                i, f = put(ints), put(floats)
            runner.kv_cache, runner.prev_sampled, r = runner.run_packed(
                runner.params, runner.kv_cache, runner.prev_sampled, i, f,
                layout=layout, options=opts, flags=SamplerFlags())
            if host is not None:
                slot.fence = r
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
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="qwen2-0.5b")
    ap.add_argument("--unroll", type=int, default=1)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--label", default="")
    ap.add_argument("--inputs", default="numpy",
                    help=f"comma-separated, each probed in turn: {', '.join(INPUTS)} (see time_decode_steps)")
    ap.add_argument("--num-blocks", type=int, default=None, help="KV pool size (default: sized from memory)")
    ap.add_argument("--layer-dispatch", choices=["scan", "per_layer", "unrolled"], default=None,
                    help="default: the engine's choice (runner/layerwise.default_dispatch)")
    ap.add_argument("--trace", default=None, help="folder: trace 10 steps per batch, list the top kernels")
    ap.add_argument("--groups", default=None,
                    help="per-layer dispatch only: comma-separated layers per dispatch, each probed in turn on "
                         "one engine, e.g. 1,4,8")
    args = ap.parse_args()
    from bench.models import ensure_model_dir
    from jaxpaged import LLM
    llm = LLM(model=ensure_model_dir(args.model), load_format="dummy", dtype="bfloat16", max_model_len=2048,
              attention_backend=args.backend, compile_buckets=False, num_gpu_blocks_override=args.num_blocks,
              layer_dispatch=args.layer_dispatch)
    res = {"label": args.label, "unroll": args.unroll, "backend": llm.llm_engine.runner.attn_backend,
           "layer_dispatch": llm.llm_engine.layer_dispatch}
    batches = [int(b) for b in args.batches.split(",")]
    inputs = args.inputs.split(",")
    if bad := [i for i in inputs if i not in INPUTS]:
        ap.error(f"--inputs: unknown {bad}; choose from {INPUTS}")
    runner = llm.llm_engine.runner
    if args.groups and runner.layer_params is None:   # the layer scan has no groups: each probe would time the same
        ap.error("--groups needs per-layer dispatch (this engine runs the layer scan; --layer-dispatch per_layer)")
    for group in [int(g) for g in args.groups.split(",")] if args.groups else [None]:
        extra = {}
        if group is not None:
            runner.layer_group = group
            extra["layers_per_dispatch"] = group
        for kind in inputs:
            where = f"g{group}" if group else res["layer_dispatch"]
            trace = args.trace and f"{args.trace}/{where}_{kind}"
            print("PROBE", json.dumps({**res, **extra, "inputs": kind,
                                       **time_decode_steps(llm, batches, args.ctx, args.unroll, trace, kind)}),
                  flush=True)


if __name__ == "__main__":
    main()
