"""Which of the model's operations each kernel of a decode step runs: the step's programs compiled as the
engine compiles them, their optimized HLO kept, a few calls traced, and every traced kernel named by the
fusion it launches and the JAX operations (op_name metadata) fused into it.

    python3 bench/step_kernels.py --model qwen2-0.5b --rows 1 --out DIR          # the GPU: compile, trace, table
    python3 bench/step_kernels.py --model llama3-8b --rows 64 --prefill-len 256  # a mixed step: 64 prompts of 256
    python3 bench/step_kernels.py --table DIR                                     # the table again, from DIR
    python3 bench/step_kernels.py --model llama3-8b-awq --set jaxpaged.models.decoder.INT4_PREPARED_X=False

--set MODULE.NAME=VALUE (repeatable) sets a module constant before the engine is built (an A/B of a code
switch in one process); the compile caches are then off, since their keys do not see it.

With --prefill-len P the step is a mixed one, as a burst of prompts is run: each of --rows requests has P new
tokens from position 0 (its bucket as the engine picks it), and the table is per step.

DIR gets hlo-<i>.txt.gz (each program's optimized HLO), kernels.json (kernel name -> calls, microseconds per
step) and kernels.txt (the table: per decode step, each kernel's count, mean and total time and what it runs).
A kernel of a multi-step program is counted per decode step (its calls / steps).
"""
from __future__ import annotations

import argparse
import ast
import gzip
import importlib
import json
import os
import re
import shutil
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))

_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?\b([a-z][\w\-]*)\(")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_CUSTOM_TARGET = re.compile(r'custom_call_target="([^"]*)"')


def _short(op_name: str) -> str:
    """An op_name without its jit(...) wrappers and transforms: the module path and primitive."""
    parts = [p for p in op_name.split("/") if p and not p.startswith(("jit(", "pjit(", "while", "body",
                                                                       "cond", "closed_call", "checkpoint"))]
    parts = [re.sub(r"^layers_\d+$", "layers_N", p) for p in parts]
    return "/".join(parts[-3:])


def parse_hlo(text: str) -> dict[str, dict]:
    """Instruction name (as a kernel is named: '.' -> '_') -> {"op": opcode, "what": Counter of the short
    op_names of the instructions it runs (a fusion: its fused computation's)}."""
    comps: dict[str, list[tuple[str, str, str]]] = defaultdict(list)   # computation -> (name, opcode, op_name)
    calls: dict[str, str] = {}
    targets: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m and "=" not in line.split("{")[0]:
            current = m.group(1)
            continue
        m = _INSTR.match(line)
        if m is None or current is None:
            continue
        name, op = m.group(1), m.group(2)
        o = _OP_NAME.search(line)
        comps[current].append((name, op, o.group(1) if o else ""))
        c = _CALLS.search(line)
        if c and op == "fusion":
            calls[name] = c.group(1)
        t = _CUSTOM_TARGET.search(line)
        if t:
            targets[name] = t.group(1)
    out: dict[str, dict] = {}
    for instrs in comps.values():
        for name, op, op_name in instrs:
            what: Counter = Counter()
            if op == "fusion" and name in calls:
                for _, fop, fname in comps.get(calls[name], []):
                    if fop not in ("parameter", "constant", "bitcast", "get-tuple-element", "tuple"):
                        what[_short(fname) or fop] += 1
            else:
                what[_short(op_name) or op] += 1
            out[name.replace(".", "_")] = {"op": targets.get(name, op), "what": what}
    return out


def _what(info: dict | None, n: int = 4) -> str:
    if info is None:
        return "?"
    parts = [f"{k}" + (f" x{v}" if v > 1 else "") for k, v in info["what"].most_common(n)]
    more = len(info["what"]) - n
    return "; ".join(parts) + (f"; +{more} more" if more > 0 else "")


def table(out_dir: Path) -> str:
    data = json.loads((out_dir / "kernels.json").read_text())
    hlo: dict[str, dict] = {}
    for f in sorted(out_dir.glob("hlo-*.txt.gz")):
        hlo.update(parse_hlo(gzip.open(f, "rt").read()))
    rows = data["kernels"]
    per_step = data["calls"] * data["steps_per_call"]
    total = sum(r["total_us"] for r in rows) / per_step
    what = (f"a mixed step of {data['rows']} prompts x {data['prefill_len']} tokens (bucket {data.get('bucket')})"
            if data.get("prefill_len") else f"{data['rows']} rows x ctx {data['ctx']}")
    lines = [f"{data['model']}, {what} (max_model_len {data.get('max_model_len')}), "
             f"{data['steps_per_call']} decode steps a call, {data['calls']} calls traced; "
             f"dispatch {data['layer_dispatch']}; {data['device']}",
             f"kernels a step: {sum(r['count'] for r in rows) / per_step:.1f}; device time a step: "
             f"{total:.1f} us (the sum of kernel durations); untraced, back to back: {data['us_per_step']:.1f} us",
             "", f"{'kernel':48s} {'a step':>7s} {'mean us':>8s} {'us/step':>8s}  runs"]
    for r in sorted(rows, key=lambda r: -r["total_us"]):
        name = r["name"]
        info = hlo.get(name.replace(".", "_"))
        lines.append(f"{name[:48]:48s} {r['count'] / per_step:7.2f} {r['total_us'] / r['count']:8.2f} "
                     f"{r['total_us'] / per_step:8.1f}  {_what(info)}")
    return "\n".join(lines) + "\n"


def prefill_inputs(runner, bucket, rows: int, plen: int, rng):
    """`rows` prompts of `plen` new tokens each, from position 0, in fresh random blocks of the runner's pool,
    padded to `bucket` as runner/inputs.py pads a mixed step."""
    import numpy as np

    from jaxpaged.models import AttentionMetadata
    from jaxpaged.runner.inputs import ModelInput
    T, R, bs = bucket.padded_num_tokens, bucket.padded_num_reqs, runner.block_size
    n = rows * plen
    per_req = -(-plen // bs)
    tables = np.zeros((R, runner.max_blocks_per_req), np.int32)
    tables[:rows, :per_req] = rng.permutation(np.arange(1, runner.num_blocks))[:rows * per_req].reshape(rows, per_req)
    req_of_token = np.repeat(np.arange(rows), plen)
    positions = np.zeros(T, np.int32)
    positions[:n] = np.tile(np.arange(plen, dtype=np.int32), rows)
    slots = np.zeros(T, np.int32)
    slots[:n] = tables[req_of_token, positions[:n] // bs] * bs + positions[:n] % bs
    seq_lens = np.zeros(R, np.int32)
    seq_lens[:rows] = plen
    qsl = np.full(R + 1, n, np.int32)
    qsl[:rows + 1] = np.arange(rows + 1) * plen
    logits_idx = np.zeros(R, np.int32)
    logits_idx[:rows] = qsl[1:rows + 1] - 1
    tokens = np.zeros(T, np.int32)
    tokens[:n] = rng.integers(100, 1000, n)
    meta = AttentionMetadata(positions, slots, tables, seq_lens, qsl)
    return ModelInput(tokens, meta, logits_idx, np.full(R, T, np.int32), np.zeros(R, np.int32), np.zeros(0, np.int32))


def probe(model: str, rows: int, ctx: int, steps: int | None, layer_dispatch: str | None, out_dir: Path,
          num_blocks: int | None = None, max_model_len: int | None = None, calls: int = 5,
          prefill_len: int = 0) -> None:
    import jax
    import numpy as np

    from bench import trace_analysis
    from bench.models import ensure_model_dir
    from bench.step_probe import decode_inputs
    from jaxpaged import LLM
    from jaxpaged.runner.buckets import Bucket
    from jaxpaged.runner.sampler import SamplerFlags

    llm = LLM(model=ensure_model_dir(model), load_format="dummy", dtype="bfloat16", max_model_len=max_model_len,
              compile_buckets=False, layer_dispatch=layer_dispatch, num_scheduler_steps=steps,
              num_gpu_blocks_override=num_blocks)
    runner = llm.llm_engine.runner
    programs = runner.programs
    steps = 1 if prefill_len else llm.llm_engine.run.num_scheduler_steps
    bucket = (llm.llm_engine.core.buckets.pick(rows * prefill_len, rows, False) if prefill_len
              else Bucket(rows, rows, True))
    options = programs.options(bucket, steps)
    flags = SamplerFlags()
    out_dir.mkdir(parents=True, exist_ok=True)
    for i, spec in enumerate(programs.program_specs(runner, bucket, options, flags).values()):
        with gzip.open(out_dir / f"hlo-{i:02d}.txt.gz", "wt") as f:
            f.write(spec.lower().compile().as_text())
    if prefill_len:
        mi = prefill_inputs(runner, bucket, rows, prefill_len, np.random.default_rng(0))
    else:   # room in the tables for the program's further steps
        mi = decode_inputs(runner, rows, ctx, -(-(ctx + 64) // runner.block_size), np.random.default_rng(0))
    _, si = programs.dummy_inputs(bucket)

    def call():
        runner.kv_cache, runner.prev_sampled, r = programs(runner.kv_cache, runner.prev_sampled, mi, si,
                                                           options=options, flags=flags)
        return r

    for _ in range(3):
        jax.block_until_ready(call())
    n = 30
    t0 = time.perf_counter()
    for _ in range(n):
        r = call()
    jax.block_until_ready(r)
    us_per_step = (time.perf_counter() - t0) / n / steps * 1e6
    trace_dir = out_dir / "trace"
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for _ in range(calls):
            r = call()
        jax.block_until_ready(r)
    events = trace_analysis.load_events(str(trace_dir)) or []
    kernels = trace_analysis.top_kernels(events, len(events))
    (out_dir / "kernels.json").write_text(json.dumps({
        "model": model, "rows": rows, "ctx": prefill_len or ctx, "max_model_len": llm.llm_engine.run.max_model_len,
        "prefill_len": prefill_len, "bucket": list(bucket),
        "steps_per_call": steps, "calls": calls,
        "layer_dispatch": llm.llm_engine.run.layer_dispatch, "device": str(jax.devices()[0].device_kind),
        "us_per_step": us_per_step, "jax": jax.__version__,
        "kernels": [{"name": k["name"], "total_us": 1000 * k["total_ms"], "count": k["count"]} for k in kernels]},
        indent=1))
    shutil.rmtree(trace_dir, ignore_errors=True)


def apply_sets(items: list[str]) -> list[tuple[str, object]]:
    """MODULE.NAME=VALUE items (VALUE a Python literal): each module imported and its constant set; returns
    (MODULE.NAME, value) pairs. A name the module lacks is an error, not a new attribute nothing reads."""
    done = []
    for item in items:
        target, eq, value = item.partition("=")
        module, _, name = target.rpartition(".")
        if not eq or not module:
            raise SystemExit(f"--set {item!r}: expected MODULE.NAME=VALUE")
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            raise SystemExit(f"--set {item}: {module} has no {name}")
        setattr(mod, name, ast.literal_eval(value))
        done.append((target, getattr(mod, name)))
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2-0.5b")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--prefill-len", type=int, default=0,
                    help="a mixed step instead: each of --rows prompts has this many new tokens")
    ap.add_argument("--steps", type=int, default=None, help="decode steps a program (default: the resolved)")
    ap.add_argument("--layer-dispatch", choices=["scan", "per_layer", "unrolled"], default=None)
    ap.add_argument("--num-blocks", type=int, default=None, help="KV pool size (default: sized from memory)")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's, as the benchmarks run")
    ap.add_argument("--out", default=None, help="folder for the HLO, the kernels and the table")
    ap.add_argument("--table", default=None, help="print the table of a folder written before")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="set a module constant (a Python literal) before the engine is built")
    args = ap.parse_args()
    if args.table:
        print(table(Path(args.table)), end="")
        return
    if args.set:
        os.environ["JAXPAGED_COMPILE_CACHE"] = "0"       # read by jaxpaged.envs at its import, below
        for target, value in apply_sets(args.set):
            print(f"set {target} = {value!r}")
    out = Path(args.out or f"bench/results/step_kernels-{args.model}-R{args.rows}"
               + (f"-P{args.prefill_len}" if args.prefill_len else ""))
    probe(args.model, args.rows, args.ctx, args.steps, args.layer_dispatch, out, args.num_blocks, args.max_model_len,
          prefill_len=args.prefill_len)
    text = table(out)
    (out / "kernels.txt").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
