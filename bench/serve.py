"""Serving benchmark: an async streaming client for any OpenAI-compatible /v1/completions endpoint.

Mirrors vLLM's benchmarks/benchmark_serving.py: requests arrive as a Poisson process (`--request-rate`,
inf = all at once) under an optional `--max-concurrency`; each streams its completion, and the client
records TTFT, inter-token latencies (ITL, one per streamed chunk after the first), TPOT (excluding the
first token) and end-to-end latency; goodput counts requests that meet both SLOs per second. The SLO
defaults are the serving issue's, TTFT <= 1000 ms and TPOT <= 50 ms (vLLM has no default: these are its
`--goodput ttft:1000 tpot:50`). Prompts go out as token-id lists with `max_tokens` = the workload's output
length and `ignore_eos: true`, so every request produces exactly its output length.

`--request-rates inf,4,16,64` sweeps the rate: the same workload runs once per rate against one server
(one warm-up request before the first), each rate's result is written as a single run's is, under
`<stem>-r<rate>`, and `<stem>-sweep.{json,md,png}` hold a row per rate (throughputs, goodput, p50 and p99
of TTFT, TPOT, ITL and E2EL) and the plot of output throughput and p50/p99 TTFT and TPOT against rate.

Examples (a jaxpaged server on port 8000):
  python -m bench.serve --base-url http://localhost:8000 --dataset openqa --max-concurrency 10
  python -m bench.serve --dataset sharegpt --request-rates inf,4,16,64
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import numpy as np

if __package__ in (None, ""):   # run as a file: see bench/common.py add_repo_to_path
    _bench = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _bench]
    sys.path.append(str(_bench.parent))

from bench.datasets import DATASETS, SampleRequest  # noqa: E402

AIOHTTP_TIMEOUT_S = 6 * 60 * 60
# How long the client keeps an idle connection for reuse: under the server's own keep-alive (5 s, as vLLM's
# uvicorn setting), so that a request never goes out on a connection the server is closing at that moment
# (aiohttp's default, 15 s, left that race open: a request failed with ServerDisconnectedError 1 ms after it
# was sent, once, in a soak run).
CLIENT_KEEPALIVE_S = 2.0


def client_connector(limit: int = 0):
    """The benchmark clients' aiohttp connector: `limit` connections at most (0: no limit), idle ones kept
    CLIENT_KEEPALIVE_S."""
    import aiohttp
    return aiohttp.TCPConnector(limit=limit, force_close=False, keepalive_timeout=CLIENT_KEEPALIVE_S)


@dataclass
class RequestFuncInput:
    prompt: list[int] | str         # token ids (what we send) or text
    api_url: str                    # full URL of /v1/completions
    prompt_len: int
    output_len: int
    model: str
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestFuncOutput:
    generated_text: str = ""
    success: bool = False
    latency: float = 0.0            # s, request sent -> last chunk
    output_tokens: int = 0          # usage.completion_tokens, else the number of content chunks
    ttft: float = 0.0               # s, request sent -> first content chunk
    itl: list[float] = field(default_factory=list)   # s, gaps between content chunks
    prompt_len: int = 0
    error: str = ""
    status: int = 0                 # HTTP status, or the code of an error event inside a 200 stream
    sent_at: float = 0.0            # perf_counter() when the request was sent, when its response's
    admitted_at: float = 0.0        # headers came back (the server has taken the request), and when it
    ended_at: float = 0.0           # ended (one clock for every process of the machine: CLOCK_MONOTONIC)


def completion_payload(inp: RequestFuncInput) -> dict[str, Any]:
    """The streamed /v1/completions body of one request: greedy, exactly its output length."""
    return {"model": inp.model, "prompt": inp.prompt, "temperature": 0.0, "max_tokens": inp.output_len,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": inp.ignore_eos,
            **inp.extra_body}


async def async_request_openai_completions(inp: RequestFuncInput, session,
                                           pbar=None) -> RequestFuncOutput:
    """One streamed completion; never raises (a failure is recorded in the output)."""
    payload = completion_payload(inp)
    out = RequestFuncOutput(prompt_len=inp.prompt_len)
    num_chunks = 0
    st = most_recent = out.sent_at = time.perf_counter()
    try:
        async with session.post(inp.api_url, json=payload) as response:
            out.admitted_at = time.perf_counter()
            out.status = response.status
            if response.status != 200:
                out.error = f"HTTP {response.status}: {(await response.text())[:500]}"
                return out
            async for data in sse_events(response.content):
                if "error" in data:      # the server failed the request after its 200 header
                    code = data["error"].get("code")
                    out.status = code if isinstance(code, int) else 0
                    out.error = f"error event {out.status}: {str(data['error'].get('message'))[:500]}"
                    return out
                now = time.perf_counter()
                if data.get("choices"):
                    if num_chunks == 0:
                        out.ttft = now - st
                    else:
                        out.itl.append(now - most_recent)
                    most_recent = now
                    num_chunks += 1
                    out.generated_text += data["choices"][0].get("text") or ""
                if data.get("usage"):
                    out.output_tokens = int(data["usage"].get("completion_tokens") or 0)
        if num_chunks == 0:
            out.error = "no content chunk received"
        else:
            out.success = True
            out.latency = most_recent - st
            out.output_tokens = out.output_tokens or num_chunks
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        out.error = f"{type(e).__name__}: {e}"
    finally:
        out.ended_at = time.perf_counter()
        if pbar is not None:
            pbar.update(1)
    return out


async def sse_events(stream) -> AsyncIterator[dict[str, Any]]:
    """JSON payloads of a server-sent-event stream ("data: {...}\\n\\n", ending with "data: [DONE]")."""
    buffer = b""
    async for chunk in stream.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                body = line[5:].strip()
                if body == b"[DONE]":
                    return
                yield json.loads(body)


async def get_request(requests: list[SampleRequest], request_rate: float, burstiness: float = 1.0,
                      seed: int = 0) -> AsyncIterator[SampleRequest]:
    """Requests spaced by gamma(burstiness, 1/(rate*burstiness)) gaps: Poisson at burstiness 1, all at
    once at rate inf (as vLLM)."""
    rng = np.random.default_rng(seed)
    theta = 1.0 / (request_rate * burstiness) if request_rate != float("inf") else 0.0
    for req in requests:
        yield req
        if request_rate == float("inf"):
            continue
        await asyncio.sleep(float(rng.gamma(shape=burstiness, scale=theta)))


def _stats(name: str, values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    """mean/median/std/pXX of `values_s` in ms, vLLM's key names (e.g. mean_ttft_ms, p99_ttft_ms)."""
    arr = np.asarray(values_s if values_s else [0.0], dtype=float) * 1000
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def calculate_metrics(input_requests: list[SampleRequest], outputs: list[RequestFuncOutput], dur_s: float,
                      percentiles: list[float] = (99,), slo_ttft_ms: float = 1000.0,
                      slo_tpot_ms: float = 50.0) -> dict[str, Any]:
    """vLLM's BenchmarkMetrics from per-request outputs: TPOT = (latency - ttft) / (output_tokens - 1),
    ITL pooled over all requests, goodput = requests meeting both SLOs per second."""
    completed = failed = good = total_input = 0
    output_lens, ttfts, tpots, itls, e2els = [], [], [], [], []
    for req, out in zip(input_requests, outputs):
        if not out.success:
            failed += 1
            output_lens.append(0)
            continue
        n_out = out.output_tokens
        output_lens.append(n_out)
        total_input += len(req.prompt_token_ids)
        tpot = (out.latency - out.ttft) / (n_out - 1) if n_out > 1 else 0.0
        if n_out > 1:
            tpots.append(tpot)
        itls += out.itl
        ttfts.append(out.ttft)
        e2els.append(out.latency)
        completed += 1
        if out.ttft * 1000 <= slo_ttft_ms and tpot * 1000 <= slo_tpot_ms:
            good += 1
    total_output = int(sum(output_lens))
    metrics: dict[str, Any] = {
        "duration": dur_s, "completed": completed, "failed": failed, "total_input_tokens": total_input,
        "total_output_tokens": total_output, "request_throughput": completed / dur_s,
        "request_goodput": good / dur_s, "output_throughput": total_output / dur_s,
        "total_token_throughput": (total_input + total_output) / dur_s,
        "goodput_slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
    }
    for name, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        metrics.update(_stats(name, vals, list(percentiles)))
    return metrics


def format_metrics(m: dict[str, Any], max_concurrency: int | None, request_rate: float) -> str:
    """vLLM's printed summary."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    row = lambda k, v: lines.append(f"{k:<40}{v:<10}")  # noqa: E731
    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    if m.get("skipped"):
        row("Skipped requests (time limit):", m["skipped"])
    if max_concurrency is not None:   # as vLLM: no line when unlimited
        row("Maximum request concurrency:", max_concurrency)
    row("Request rate (req/s):", request_rate)
    row("Benchmark duration (s):", f"{m['duration']:.2f}")
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", f"{m['request_throughput']:.2f}")
    row("Request goodput (req/s):", f"{m['request_goodput']:.2f}")
    row("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}")
    row("Total Token throughput (tok/s):", f"{m['total_token_throughput']:.2f}")
    if "last_admitted_s" in m:          # jaxpaged's own lines (admission_metrics, server_latency_metrics)
        row("Last request sent at (s):", f"{m['last_sent_s']:.3f}")
        row("Requests admitted, median / last (s):", f"{m['median_admitted_s']:.3f} / {m['last_admitted_s']:.3f}")
    if m.get("num_first_token_waves", 0) > 1:        # steps shorter than WAVE_GAP_S make one "wave": no line
        waves = m["first_token_waves"]
        k = m["median_first_token_wave"]
        row("First-token waves (s: requests):", " ".join(f"{t:.2f}:{c}" for t, c in waves[:8])
            + (" ..." if m["num_first_token_waves"] > 8 else ""))
        row("Median request's first token:", f"wave {k} of {m['num_first_token_waves']}"
            + (f", at {waves[k - 1][0]:.3f} s" if k <= len(waves) else ""))
    if "server_mean_ttft_ms" in m:
        row("Server-side mean TTFT / E2EL (ms):",
            f"{m['server_mean_ttft_ms']:.2f} / {m.get('server_mean_e2el_ms', 0):.2f}")
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for key, title in titles.items():
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        for stat in [k for k in m if k.endswith(f"_{key}_ms") and not k.startswith("std")]:
            label = stat.split("_")[0].capitalize() if not stat.startswith("p") else stat.split("_")[0].upper()
            row(f"{label} {key.upper()} (ms):", f"{m[stat]:.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)


async def _in_processes(inputs: list[RequestFuncInput], k: int, event_loop: str,
                        ) -> tuple[list[RequestFuncOutput], float]:
    """Every request at once from k processes (request i from process i % k); the outputs in input order,
    and the perf_counter() at which the processes were released: the earliest that any of them (this one
    included) saw the barrier open. perf_counter is the system's monotonic clock, one for every process;
    this process alone would see the release after its executor thread woke the event loop, later than a
    client process that had already sent its first requests."""
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")          # (never fork a process with a running event loop)
    ready, results = ctx.Barrier(k + 1), ctx.Queue()
    procs = [ctx.Process(target=_client_process, args=(i, inputs[i::k], event_loop, ready, results), daemon=True)
             for i in range(k)]
    for proc in procs:
        proc.start()
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, ready.wait)      # each has its session open: go
    start = time.perf_counter()
    outputs: list[RequestFuncOutput] = [RequestFuncOutput()] * len(inputs)
    for _ in range(k):
        i, released, shard = await loop.run_in_executor(None, results.get)
        outputs[i::k] = shard
        start = min(start, released)
    for proc in procs:
        proc.join()
    return outputs, start


def _client_process(index: int, inputs: list[RequestFuncInput], event_loop: str, ready, results) -> None:
    """One of _in_processes' processes: its share of the requests, all at once once every process is ready."""
    import aiohttp

    released = 0.0

    async def send_all() -> list[RequestFuncOutput]:
        nonlocal released
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=AIOHTTP_TIMEOUT_S),
                                         connector=client_connector(), trust_env=True) as session:
            ready.wait()
            released = time.perf_counter()
            return await asyncio.gather(*(async_request_openai_completions(inp, session) for inp in inputs))
    shard = event_loop_runner(event_loop)(send_all())
    results.put((index, released, shard))


def admission_metrics(outputs: list[RequestFuncOutput], start: float) -> dict[str, float]:
    """jaxpaged's own, not vLLM's: how long after the benchmark's start the client sent the requests and the
    server took them (response headers back), which tells a client-bound run from a server-bound one
    when every request is sent at once."""
    sent = [o.sent_at - start for o in outputs if o.sent_at]
    admitted = [o.admitted_at - start for o in outputs if o.admitted_at]
    if not sent or not admitted:
        return {}
    return {"last_sent_s": max(sent), "median_admitted_s": float(np.median(admitted)),
            "last_admitted_s": max(admitted)}


WAVE_GAP_S = 0.05       # first tokens this far apart or more belong to different engine steps' waves


def first_token_waves(outputs: list[RequestFuncOutput], start: float, max_waves: int = 12) -> dict[str, Any]:
    """jaxpaged's own, not vLLM's: when every request is sent at once, first tokens reach the clients in waves, one
    per engine step that completes prompts (a gap of WAVE_GAP_S or more between two first tokens ends a wave).
    The median TTFT is then set by the wave that holds the median request, so it moves by whole steps:

        first tokens at [0.36, 0.36, 0.74, 0.74, 0.74, 1.10] s -> waves [[0.36, 2], [0.74, 3], [1.10, 1]];
        the median (3rd of 6) request's first token is in wave 2, at 0.74 s

    -> {"first_token_waves": [[last first token of the wave (s from the start), requests], ...] (the first
    max_waves), "median_first_token_wave": 1-based wave of the median request, "num_first_token_waves"}."""
    firsts = np.sort([o.sent_at - start + o.ttft for o in outputs if o.success and o.ttft > 0])
    if len(firsts) < 2:
        return {}
    ends = np.flatnonzero(np.diff(firsts) >= WAVE_GAP_S)                 # index of each wave's last first token
    ends = np.append(ends, len(firsts) - 1)
    counts = np.diff(np.concatenate([[-1], ends]))
    median_index = (len(firsts) - 1) // 2
    return {"first_token_waves": [[round(float(firsts[e]), 3), int(c)] for e, c in zip(ends[:max_waves],
                                                                                        counts[:max_waves])],
            "median_first_token_wave": int(np.searchsorted(ends, median_index) + 1),
            "num_first_token_waves": len(ends)}


SERVER_HISTOGRAMS = {"server_mean_ttft_ms": "jaxpaged:time_to_first_token_seconds",
                     "server_mean_e2el_ms": "jaxpaged:e2e_request_latency_seconds"}


async def server_latency_sums(base_url: str) -> dict[str, float]:
    """The sums and counts of jaxpaged's latency histograms (its /metrics; empty for another server)."""
    import aiohttp
    try:
        async with aiohttp.ClientSession() as s, s.get(base_url.rstrip("/") + "/metrics") as r:
            text = await r.text() if r.status == 200 else ""
    except aiohttp.ClientError:
        return {}
    sums: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name.endswith(("_sum", "_count")) and name.rsplit("_", 1)[0] in SERVER_HISTOGRAMS.values():
            sums[name] = sums.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return sums


def server_latency_metrics(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """jaxpaged's own: mean TTFT and e2e latency over the run as the server measured them (from a request's
    arrival in its API process), against the client's own (from sending): the difference is the time the
    requests and their first tokens spend in the client and on the way."""
    out = {}
    for key, name in SERVER_HISTOGRAMS.items():
        count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        if count > 0:
            out[key] = (after[f"{name}_sum"] - before.get(f"{name}_sum", 0.0)) / count * 1e3
    return out


RequestFunc = Callable[..., Awaitable[RequestFuncOutput]]


async def benchmark(api_url: str, model: str, requests: list[SampleRequest], request_rate: float = float("inf"),
                    max_concurrency: int | None = None, burstiness: float = 1.0, seed: int = 0,
                    percentiles: list[float] = (99,), slo_ttft_ms: float = 1000.0, slo_tpot_ms: float = 50.0,
                    warmup: bool = True, disable_tqdm: bool = False, send_text: bool = False,
                    time_limit_s: float | None = None,
                    request_func: RequestFunc = async_request_openai_completions,
                    base_url: str | None = None, client_processes: int = 1,
                    event_loop: str = "asyncio") -> dict[str, Any]:
    """Runs the whole benchmark against `api_url` (…/v1/completions); returns metrics + per-request data.

    time_limit_s: requests not yet started when it has passed are skipped (counted as "skipped", not
    failed, and left out of every metric); the duration ends with the last request that ran.
    base_url: the server's root, whose jaxpaged /metrics give the server-side latencies of the run.
    client_processes > 1 (rate inf only): the requests are sent from that many processes (every k-th request
    from each, all released at once, each on `event_loop`), so that the client's own time per request does not
    set when the server sees them; the duration runs from the release to the last request's end."""
    if client_processes > 1 and (request_rate != float("inf") or max_concurrency or time_limit_s is not None):
        raise ValueError("client_processes > 1 needs request rate inf, no max_concurrency and no time limit")
    import aiohttp
    from tqdm.asyncio import tqdm

    def make_input(r: SampleRequest) -> RequestFuncInput:
        prompt = r.prompt if (send_text and r.prompt is not None) else r.prompt_token_ids
        return RequestFuncInput(prompt, api_url, len(r.prompt_token_ids), r.output_len, model)

    timeout = aiohttp.ClientTimeout(total=AIOHTTP_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=client_connector(max_concurrency or 0),
                                     trust_env=True) as session:
        if warmup and requests:   # as vLLM: one request first, so a broken endpoint fails fast
            test = await request_func(make_input(requests[0]), session)
            if not test.success:
                raise RuntimeError(f"warm-up request failed: {test.error}")
        # leave=None: the bar stays when it is the only one, and is cleared under a sweep's bar over rates
        pbar = None if disable_tqdm else tqdm(total=len(requests), desc="requests", leave=None)
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        before = await server_latency_sums(base_url) if base_url else {}

        start = time.perf_counter()
        last_end = [start]

        async def timed(r: SampleRequest) -> RequestFuncOutput | None:
            if time_limit_s is not None and time.perf_counter() - start > time_limit_s:
                return None
            out = await request_func(make_input(r), session, pbar=pbar)
            last_end[0] = max(last_end[0], time.perf_counter())
            return out

        async def limited(r: SampleRequest) -> RequestFuncOutput | None:
            if sem is None:
                return await timed(r)
            async with sem:
                return await timed(r)

        if client_processes > 1:
            results, start = await _in_processes([make_input(r) for r in requests], client_processes, event_loop)
            dur_s = max(o.ended_at for o in results) - start
        else:
            tasks = [asyncio.create_task(limited(r))
                     async for r in get_request(requests, request_rate, burstiness, seed)]
            results = await asyncio.gather(*tasks)
            dur_s = (last_end[0] if time_limit_s is not None else time.perf_counter()) - start
        after = await server_latency_sums(base_url) if base_url else {}
        if pbar is not None:
            pbar.close()
    ran = [(r, o) for r, o in zip(requests, results) if o is not None]
    requests, outputs = [r for r, _ in ran], [o for _, o in ran]
    num_skipped = len(results) - len(ran)
    metrics = calculate_metrics(requests, outputs, dur_s, percentiles, slo_ttft_ms, slo_tpot_ms)
    metrics["skipped"] = num_skipped
    metrics["start_perf_counter_s"] = start     # the host's monotonic clock: other processes' logs read against it
    metrics.update(admission_metrics(outputs, start))
    if request_rate == float("inf") and max_concurrency is None:
        metrics.update(first_token_waves(outputs, start))
    metrics.update(server_latency_metrics(before, after))
    errors = sorted({o.error for o in outputs if o.error})[:5]
    return {"metrics": metrics, "errors": errors,
            "per_request": {"ttfts": [o.ttft for o in outputs], "latencies": [o.latency for o in outputs],
                            "sent_s": [o.sent_at - start for o in outputs],
                            "admitted_s": [o.admitted_at - start if o.admitted_at else None for o in outputs],
                            "output_tokens": [o.output_tokens for o in outputs],
                            "prompt_lens": [o.prompt_len for o in outputs]},
            "itls": [x for o in outputs for x in o.itl]}


async def served_model_name(base_url: str) -> str:
    """The first model of GET /v1/models."""
    import aiohttp
    async with aiohttp.ClientSession() as s, s.get(base_url.rstrip("/") + "/v1/models") as r:
        r.raise_for_status()
        return (await r.json())["data"][0]["id"]


SWEEP_PERCENTILES = (50.0, 99.0)
SWEEP_LATENCIES = ("ttft", "tpot", "itl", "e2el")


def parse_rates(text: str) -> list[float]:
    """'inf,4,16,64' -> [inf, 4.0, 16.0, 64.0]; every rate > 0 and named once (it names a result file)."""
    rates = [float(r) for r in text.split(",") if r.strip()]
    if not rates or any(not r > 0 for r in rates) or len(set(rates)) != len(rates):
        raise argparse.ArgumentTypeError(f"request rates must be distinct and > 0 (inf allowed): {text!r}")
    return rates


def sweep_row(rate: float, m: dict[str, Any]) -> dict[str, Any]:
    """One rate's line of the sweep: counts, throughputs, goodput, p50 and p99 latencies in ms."""
    row: dict[str, Any] = {"request_rate": str(rate), "completed": m["completed"], "failed": m["failed"],
                           "request_throughput": m["request_throughput"],
                           "output_throughput": m["output_throughput"],
                           "total_token_throughput": m["total_token_throughput"],
                           "request_goodput": m["request_goodput"]}
    for name in SWEEP_LATENCIES:
        for p in SWEEP_PERCENTILES:
            row[f"p{p:g}_{name}_ms"] = m[f"p{p:g}_{name}_ms"]
    return row


def plot_sweep(path: Path, rates: list[float], rows: list[dict[str, Any]], slo_ttft_ms: float,
               slo_tpot_ms: float, title: str) -> Path | None:
    """Output throughput and p50/p99 TTFT and TPOT against rate, on a log rate axis where inf sits one
    factor of 4 beyond the largest finite rate under an 'inf' tick; None if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import LogFormatter, NullLocator
    except ImportError:
        return None
    finite = [r for r in rates if r != float("inf")]
    inf_x = 4 * max(finite) if finite else 1.0
    xs = [inf_x if r == float("inf") else r for r in rates]
    order = sorted(range(len(rates)), key=lambda i: xs[i])
    panels = [("Output throughput (tok/s)", ["output_throughput"], None),
              ("TTFT (ms)", ["p50_ttft_ms", "p99_ttft_ms"], slo_ttft_ms),
              ("TPOT (ms)", ["p50_tpot_ms", "p99_tpot_ms"], slo_tpot_ms)]
    fig, axes = plt.subplots(1, len(panels), figsize=(14, 4))
    for ax, (ylabel, keys, slo) in zip(axes, panels):
        for key in keys:
            ax.plot([xs[i] for i in order], [rows[i][key] for i in order], marker="o",
                    label=key.split("_")[0] if len(keys) > 1 else None)
        if slo is not None:
            ax.axhline(slo, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo:g} ms")
            ax.legend(fontsize=8)
            if all(rows[i][k] > 0 for i in order for k in keys):
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(LogFormatter())
                ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
        ax.set_xscale("log")
        ax.set_xticks(sorted(set(xs)))
        ax.set_xticklabels(["inf" if x == inf_x else f"{x:g}" for x in sorted(set(xs))])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_sweep(name: str, rates: list[float], rows: list[dict[str, Any]], settings: dict[str, Any],
                meta: dict[str, Any], results_dir: Path | None = None) -> Path:
    """`<name>.json` ({"meta", "metrics": settings + rows}), `<name>.md` (the rows as a table) and
    `<name>.png` (plot_sweep); returns the JSON path."""
    from bench import common
    results_dir = Path(results_dir or common.RESULTS_DIR)
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    path.write_text(json.dumps({"meta": meta, "metrics": dict(settings, rows=rows)}, indent=2, default=str) + "\n")
    lines = [f"# serving sweep: {name}", ""] + [f"- {k}: `{v}`" for k, v in {**meta, **settings}.items()]
    (results_dir / f"{name}.md").write_text("\n".join(lines + ["", common.markdown_table(rows)]))
    slo = settings["goodput_slo"]
    plot_sweep(results_dir / f"{name}.png", rates, rows, slo["ttft_ms"], slo["tpot_ms"],
               f"{name}: {settings['dataset']} ({settings['workload']['num_prompts']} prompts), "
               f"max concurrency {settings['max_concurrency'] or 'unlimited'}")
    return path


def event_loop_runner(name: str) -> Callable[[Awaitable], Any]:
    """asyncio.run on the named event loop."""
    if name == "uvloop":
        import uvloop

        def run(coro: Awaitable) -> Any:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(coro)
        return run
    return asyncio.run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (…/v1/completions is used)")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--served-model-name", default=None, help="'model' field; default: first of /v1/models")
    p.add_argument("--model", default="qwen2-0.5b", help="bench model (tokenizer / vocab of the workload)")
    p.add_argument("--dataset", choices=DATASETS, default="openqa")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--input-len", type=int, default=None, help="override random/openqa/longalpaca input length")
    p.add_argument("--output-len", type=int, default=None, help="override their output length")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--request-rate", type=float, default=float("inf"), help="req/s (Poisson); inf: all at once")
    rate.add_argument("--request-rates", type=parse_rates, default=None,
                      help="sweep: comma-separated rates, e.g. inf,4,16,64 (one run each, p50 and p99 added)")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--goodput-ttft-ms", type=float, default=1000.0, help="goodput SLO on TTFT")
    p.add_argument("--goodput-tpot-ms", type=float, default=50.0, help="goodput SLO on TPOT")
    p.add_argument("--send-text", action="store_true", help="send prompt text where the workload has it")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--time-limit-s", type=float, default=None,
                   help="skip requests not started by then, per rate (reported as skipped; keeps a suite on time)")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--result-name", default=None,
                   help="results file stem (default serve-<dataset>-c<conc>; a sweep adds -r<rate> and -sweep)")
    p.add_argument("--save-per-request", action="store_true", help="keep per-request timings in the JSON")
    p.add_argument("--client-processes", type=int, default=1,
                   help="send the requests from this many processes (rate inf only): vLLM's client is one, "
                        "whose own time per request then delays when the server sees the last ones")
    p.add_argument("--event-loop", choices=["asyncio", "uvloop"], default="asyncio",
                   help="the client's event loop (vLLM's client: asyncio). With every request sent at once, the "
                        "client's own time per request delays their admission and their first tokens")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """One run at --request-rate, or one per rate of --request-rates and the sweep's files; returns the
    run's metrics, or the sweep's (settings and rows)."""
    from tqdm import tqdm

    from bench.common import markdown_table, stamp, write_result
    from bench.datasets import get_dataset, summarize
    args = parse_args(argv)
    requests = get_dataset(args.dataset, args.model, args.num_prompts, args.seed, args.input_len, args.output_len)
    model = args.served_model_name or asyncio.run(served_model_name(args.base_url))
    api_url = args.base_url.rstrip("/") + args.endpoint
    sweeping = args.request_rates is not None
    rates = args.request_rates if sweeping else [args.request_rate]
    percentiles = [float(p) for p in args.percentiles.split(",")]
    if sweeping:
        percentiles = sorted(set(percentiles) | set(SWEEP_PERCENTILES))
    stem = args.result_name or f"serve-{args.dataset}-c{args.max_concurrency or 'inf'}"
    # The client needs no JAX: the device stamp describes this process's view, the server's is its own.
    meta = stamp(sys.argv if argv is None else ["bench/serve.py"] + argv, with_device=False)
    settings = dict(dataset=args.dataset, workload=summarize(requests), model=args.model, served_model_name=model,
                    max_concurrency=args.max_concurrency)
    rows, names, metrics = [], [], {}
    run = event_loop_runner(args.event_loop)
    for i, rate in enumerate(tqdm(rates, desc="request rates", disable=args.disable_tqdm or not sweeping)):
        result = run(benchmark(
            api_url, model, requests, rate, args.max_concurrency, args.burstiness, args.seed, percentiles,
            args.goodput_ttft_ms, args.goodput_tpot_ms, warmup=not args.no_warmup and i == 0,
            disable_tqdm=args.disable_tqdm, send_text=args.send_text, time_limit_s=args.time_limit_s,
            base_url=args.base_url, client_processes=args.client_processes, event_loop=args.event_loop))
        m = result["metrics"]
        m["client_event_loop"], m["client_processes"] = args.event_loop, args.client_processes
        tqdm.write(format_metrics(m, args.max_concurrency, rate))
        if result["errors"]:
            tqdm.write("\n  ".join(["errors:", *result["errors"]]))
        metrics = dict(m, **settings, request_rate=str(rate), errors=result["errors"])
        if args.save_per_request:
            metrics["per_request"] = result["per_request"]
        name = f"{stem}-r{rate:g}" if sweeping else stem
        path = write_result(name, metrics, meta=meta, title=f"serving: {name}")
        tqdm.write(f"results: {path}")
        if sweeping:
            rows.append(sweep_row(rate, m))
            names.append(name)
    if not sweeping:
        return metrics
    sweep = dict(settings, burstiness=args.burstiness, seed=args.seed,
                 goodput_slo={"ttft_ms": args.goodput_ttft_ms, "tpot_ms": args.goodput_tpot_ms},
                 rate_results=names)
    print(markdown_table(rows))
    path = write_sweep(f"{stem}-sweep", rates, rows, sweep, meta)
    print(f"sweep: {path} (+ .md, .png)")
    return dict(sweep, rows=rows)


if __name__ == "__main__":
    main()
