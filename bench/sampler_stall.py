"""What a sampler variant's first request costs a running server (runner/step.py: a variant with no compiled
step of its own runs the default step, then the head and its sampler alone, while its own step compiles on a
background thread). Against a server already up:

  python bench/sampler_stall.py --base-url http://127.0.0.1:8011 --model qwen2-0.5b --server-log /tmp/server.log

First it waits for the log line that says the server's background compiles of the common variants' head and
sampler are done (--warm-deadline-s at most). Then for each variant (--variants; default top_p and logprobs):
  1. a plain greedy stream A is running; once it has 64 tokens, request B of the variant (32 tokens) is sent:
     B's TTFT and A's longest gap between tokens while B runs, against A's median gap before B;
  2. at once, one variant stream of 300 tokens alone: its TPOT while the variant's own step compiles;
  3. once the server's log has said nothing new about compiling variants for 15 s: the same stream again
     (the variant's own step), then a plain stream of 300 tokens (the default step's TPOT).
The log's "Compiled the step of sampler variant ... in X s" lines give each background compile: what the
engine loop used to wait for, holding every stream. Results: bench/results/sampler-stall-<model>.{json,md}.

  python bench/sampler_stall.py --compare OUT label=results.json [label=results.json ...]

tables (OUT.md) and plots (OUT.png) several runs' results side by side.
"""
from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):   # run as a file: see bench/common.py add_repo_to_path
    _bench = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _bench]
    sys.path.append(str(_bench.parent))

from bench.common import stamp, write_result  # noqa: E402
from bench.serve import RequestFuncInput, async_request_openai_completions  # noqa: E402

VARIANTS = {"top_p": {"temperature": 0.8, "top_p": 0.9, "seed": 1},
            "logprobs": {"temperature": 0.8, "logprobs": 5, "seed": 2},
            "penalties": {"temperature": 0.8, "presence_penalty": 0.5, "seed": 3}}
COMPILED = re.compile(r"Compiled the step of sampler variant .* in the background in ([0-9.]+) s")
WARM = re.compile(r"Compiled the head and sampler of the common sampler variants \((\d+) programs\) in the "
                  r"background in ([0-9.]+) s")


def tpot_ms(out) -> float:
    return (out.latency - out.ttft) / max(out.output_tokens - 1, 1) * 1e3


async def run_variant(name: str, body: dict, args, session) -> dict:
    url = args.base_url.rstrip("/") + "/v1/completions"

    def inp(prompt: str, n: int, extra: dict) -> RequestFuncInput:
        return RequestFuncInput(prompt, url, 0, n, args.model, True, dict(extra))

    arrivals: list[float] = []

    async def stream_a():
        # A's own chunk times, as they arrive (async_request_openai_completions keeps only the gaps)
        from bench.serve import completion_payload, sse_events
        payload = completion_payload(inp("Tell me a long story about the sea.", 4000, {}))
        async with session.post(url, json=payload) as r:
            async for data in sse_events(r.content):
                if data.get("choices"):
                    arrivals.append(time.perf_counter())

    a = asyncio.create_task(stream_a())
    deadline = time.perf_counter() + 120
    while len(arrivals) < 64:
        if a.done() or time.perf_counter() > deadline:
            raise RuntimeError(f"stream A gave {len(arrivals)} tokens")
        await asyncio.sleep(0.01)
    b = await async_request_openai_completions(inp("Name three rivers.", 32, body), session)
    settle = time.perf_counter() + 0.5
    while time.perf_counter() < settle and not a.done():
        await asyncio.sleep(0.01)
    a.cancel()
    t = np.array(arrivals)
    before = np.diff(t[t < b.sent_at])
    during = np.diff(t[(t >= b.sent_at) & (t <= b.ended_at + 0.2)])
    fallback = await async_request_openai_completions(inp("Write a poem about rain.", 300, body), session)
    lines = 0
    quiet_since, deadline = time.perf_counter(), time.perf_counter() + args.compile_deadline_s
    while time.perf_counter() < deadline:
        n = len(COMPILED.findall(Path(args.server_log).read_text(errors="replace")))
        if n != lines:
            lines, quiet_since = n, time.perf_counter()
        elif n and time.perf_counter() - quiet_since > 15:
            break
        await asyncio.sleep(0.5)
    own = await async_request_openai_completions(inp("Write a poem about rain.", 300, body), session)
    plain = await async_request_openai_completions(inp("Write a poem about rain.", 300, {}), session)
    for o in (b, fallback, own, plain):
        if not o.success:
            raise RuntimeError(f"{name}: {o.error}")
    return {"variant": name, "body": body, "first_request_ttft_ms": b.ttft * 1e3,
            "first_request_latency_ms": b.latency * 1e3,
            "stream_median_gap_before_ms": float(np.median(before) * 1e3) if len(before) else None,
            "stream_longest_gap_during_ms": float(during.max() * 1e3) if len(during) else None,
            "tpot_while_compiling_ms": tpot_ms(fallback), "tpot_own_step_ms": tpot_ms(own),
            "tpot_plain_ms": tpot_ms(plain)}


async def main_async(args) -> list[dict]:
    import aiohttp
    rows = []
    # the server compiles the common variants' head and sampler in the background after start-up: measure
    # once that is done (its log line), or after --warm-deadline-s where it never comes (e.g. the CPU)
    t0, deadline = time.perf_counter(), time.perf_counter() + args.warm_deadline_s
    while time.perf_counter() < deadline and not WARM.search(Path(args.server_log).read_text(errors="replace")):
        await asyncio.sleep(0.5)
    print(f"waited {time.perf_counter() - t0:.1f} s for the common variants' background compiles", flush=True)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for name in args.variants.split(","):
            rows.append(await run_variant(name, VARIANTS[name], args, session))
            print(rows[-1], flush=True)
    return rows


COLUMNS = [("first_request_ttft_ms", "first request's TTFT (ms)"),
           ("stream_longest_gap_during_ms", "running stream's longest gap (ms)"),
           ("stream_median_gap_before_ms", "its median gap before (ms)"),
           ("tpot_while_compiling_ms", "TPOT while its step compiles (ms)"),
           ("tpot_own_step_ms", "TPOT on its own step (ms)"), ("tpot_plain_ms", "plain TPOT (ms)")]


def compare(runs: list[tuple[str, Path]], out: Path) -> None:
    """A table (out.md) and a plot (out.png) of several runs' results, label=path.json each."""
    import json

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [(label, row) for label, path in runs for row in json.loads(path.read_text())["metrics"]["rows"]]
    lines = ["| run | variant | " + " | ".join(t for _, t in COLUMNS) + " |", "|---" * (len(COLUMNS) + 2) + "|"]
    lines += [f"| {label} | {row['variant']} | " + " | ".join(f"{row[k]:,.1f}" if row[k] is not None else "-"
                                                               for k, _ in COLUMNS) + " |" for label, row in rows]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"{label}\n{row['variant']}" for label, row in rows]
    for ax, key, title in ((axes[0], "first_request_ttft_ms", "a new variant's first request: TTFT"),
                           (axes[1], "stream_longest_gap_during_ms", "a running stream's longest gap meanwhile")):
        ax.bar(range(len(rows)), [row[key] for _, row in rows])
        ax.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("ms (log)")
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


def main(argv: list[str] | None = None) -> None:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--compare":      # --compare OUT label=results.json ...
        compare([(a.split("=", 1)[0], Path(a.split("=", 1)[1])) for a in argv[2:]], Path(argv[1]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", default=None, help="the served model's name (default: what /v1/models lists)")
    ap.add_argument("--server-log", required=True, help="the server's log file (its background compiles)")
    ap.add_argument("--variants", default="top_p,logprobs")
    ap.add_argument("--compile-deadline-s", type=float, default=300)
    ap.add_argument("--warm-deadline-s", type=float, default=240)
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    if args.model is None:
        from bench.serve import served_model_name
        args.model = asyncio.run(served_model_name(args.base_url))
    rows = asyncio.run(main_async(args))
    log = Path(args.server_log).read_text(errors="replace")
    compiles = [float(s) for s in COMPILED.findall(log)]
    warm = WARM.search(log)
    metrics = {"rows": rows, "background_compile_s": compiles,
               "common_variants_background_s": float(warm.group(2)) if warm else None}
    path = write_result(args.name or f"sampler-stall-{Path(args.model).name}", metrics,
                        meta=stamp(["bench/sampler_stall.py"] + argv, with_device=False),
                        title="a sampler variant's first request against a running server")
    print(f"background compiles (s): {compiles}\nwrote {path}")


if __name__ == "__main__":
    main()
