"""Soak benchmark: a long ShareGPT run against one server, then the same traffic with faults mixed in.

Phase 1 ("clean") sends --num-prompts ShareGPT requests as bench/serve.py does (streamed /v1/completions,
token-id prompts, ignore_eos, max_tokens = the sample's output length, capped by --max-output-len) at a
Poisson --request-rate. Phase 2 ("faults") sends the next --fault-num-prompts samples the same way, with
--fault-fraction of them (positions drawn from a seeded RNG, the kinds in equal shares) replaced by faults
(bench/soak_faults.py): client disconnects mid-stream and before the response, and bad requests that must
get a 4xx in OpenAI's error schema.

Every --sample-period-s (bench/soak_memory.py) it records the server's host RSS (the API process and the
engine core, from /proc/<pid>/status; needs --server-pid or --serve) and, from /metrics, the device memory
in use and the running and waiting requests. After the run it waits for the server to go idle and reads
/metrics again.

Verdicts: no 5xx; every request got what its kind must get (a normal one its whole output); RSS and
device memory flat after warm-up: the median of the last window grew less than --max-growth over the
median of the first window after warm-up (warm-up: until the first --warmup-fraction of phase 1's
requests were sent; each window --window-fraction of the samples after it, the load's end its close);
at the end 0 running, 0 waiting, every KV block free; no ERROR or Traceback line in the server's log
(--server-log, or --serve's); with --serve, a clean exit on SIGTERM. Exit status 1 if a verdict fails.
Writes bench/results/<name>.json (every sample, the faults and anything unexpected), .md and .png.

  python bench/soak.py --base-url http://127.0.0.1:8000 --server-pid PID --model qwen2-0.5b --request-rate 40
  python bench/soak.py --model tiny-llama --num-prompts 200 --fault-num-prompts 100 --request-rate 20 \\
      --max-output-len 32 --serve -- --model ~/.cache/jaxpaged/bench_models/tiny-llama --load-format dummy \\
      --max-model-len 2048 --num-gpu-blocks-override 1024
  bash bench/serve_vs_offline.sh qwen2-0.5b --soak --soak-args "--request-rate 64"     # on the H100
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

if __package__ in (None, ""):   # run as a file: see bench/common.py add_repo_to_path
    _bench = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _bench]
    sys.path.append(str(_bench.parent))

from bench.datasets import SampleRequest  # noqa: E402
from bench.serve import RequestFuncOutput, client_connector  # noqa: E402
from bench.soak_faults import EXPECTED, FAULT_KINDS, Target, disconnect_point, plan_kinds, send  # noqa: E402
from bench.soak_memory import RSS_KEYS, Sampler, scrape  # noqa: E402

PHASES = ("clean", "faults")
MIN_WINDOW_SAMPLES = 3


@dataclass
class Outcome:
    """One request of the run, and what it got."""
    phase: str
    index: int                 # in its phase
    kind: str                  # "normal" or a fault kind (bench/soak_faults.py)
    outcome: str               # soak_faults.Sent.outcome
    expected: bool             # the outcome is one its kind must get (soak_faults.EXPECTED)
    status: int                # HTTP status, or an error event's code; 0: none read
    sent_s: float              # since the run's start
    done_s: float
    detail: str
    timing: RequestFuncOutput | None     # normal requests: serve.py's timings


# ---- one phase -----------------------------------------------------------------------------------
async def run_phase(phase: str, target: Target, session, requests: list[SampleRequest], kinds: list[str],
                    rate: float, seed: int, t0: float, counts: Counter, pbar) -> list[Outcome]:
    """Each request (or the fault that replaces it) at Poisson arrivals; returns every outcome in order."""
    from bench.serve import get_request
    rng = np.random.default_rng([seed, PHASES.index(phase)])      # the mid-stream disconnects' points

    async def one(i: int, req: SampleRequest, k: int, sent_s: float) -> Outcome:
        kind = kinds[i]
        out = await send(target, session, kind, req, k)
        counts["done"] += 1
        pbar.update(1)
        return Outcome(phase, i, kind, out.outcome, out.outcome in EXPECTED[kind], out.status, sent_s,
                       time.perf_counter() - t0, out.detail, out.timing)

    tasks = []
    async for req in get_request(requests, rate, seed=seed + PHASES.index(phase)):
        counts["sent"] += 1
        i = len(tasks)
        tasks.append(asyncio.create_task(one(i, req, disconnect_point(req, rng), time.perf_counter() - t0)))
    return list(await asyncio.gather(*tasks))


async def wait_idle(session, base_url: str, timeout_s: float) -> dict[str, float]:
    """/metrics once the server holds no request and every block is free, or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        g = await scrape(session, base_url)
        idle = (g.get("num_requests_running") == 0 and g.get("num_requests_waiting") == 0
                and g.get("num_free_blocks") == g.get("num_blocks"))
        if idle or time.monotonic() > deadline:
            return g
        await asyncio.sleep(0.2)


async def soak(args: argparse.Namespace, target: Target, pid: int | None,
               phases: dict[str, tuple[list[SampleRequest], list[str]]]) -> dict[str, Any]:
    """Both phases under one sampler; returns the outcomes, samples, load end and the idle reading."""
    import aiohttp
    from tqdm.asyncio import tqdm

    counts: Counter = Counter()
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)    # a request past it fails: TimeoutError
    async with aiohttp.ClientSession(timeout=timeout, connector=client_connector()) as session:
        t0 = time.perf_counter()
        sampler = Sampler(session, target.base_url, pid, args.sample_period_s, t0, counts)
        task = asyncio.create_task(sampler.run())
        outcomes: list[Outcome] = []
        phase_start: dict[str, float] = {}
        total = sum(len(r) for r, _ in phases.values())
        with tqdm(total=total, desc="soak", disable=args.disable_tqdm) as pbar:
            for name, (requests, kinds) in phases.items():
                pbar.set_description(name)
                phase_start[name] = time.perf_counter() - t0
                outcomes += await run_phase(name, target, session, requests, kinds, args.request_rate, args.seed,
                                            t0, counts, pbar)
        load_end = time.perf_counter() - t0
        idle = await wait_idle(session, target.base_url, args.drain_timeout_s)
        await sampler.sample()                  # the idle server's footprint closes the series
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return {"outcomes": outcomes, "samples": sampler.samples, "sampler_errors": sampler.errors,
            "phase_start_s": phase_start, "load_end_s": load_end, "idle": idle}


# ---- analysis ------------------------------------------------------------------------------------
def window_growth(samples: list[dict[str, float]], key: str, t_from: float, t_to: float,
                  window_fraction: float) -> dict[str, Any]:
    """Median of `key` over the last window against the first window of the samples in [t_from, t_to]."""
    inside = [s for s in samples if t_from <= s["t_s"] <= t_to and key in s]
    values, times = [s[key] for s in inside], [s["t_s"] for s in inside]
    w = max(MIN_WINDOW_SAMPLES, round(window_fraction * len(values)))
    if len(values) < 2 * w or not any(values):
        return {"samples": len(values), "growth": None}
    first, last = float(np.median(values[:w])), float(np.median(values[-w:]))
    return {"samples": len(values), "window": w, "first_median": first, "last_median": last,
            "growth": last / first - 1 if first else None,
            "first_window_s": [times[0], times[w - 1]], "last_window_s": [times[-w], times[-1]]}


def phase_report(phase: str, outcomes: list[Outcome], requests: list[SampleRequest],
                 percentiles: list[float]) -> dict[str, Any]:
    """Counts by kind and outcome and by status; serve.py's metrics over the phase's normal requests."""
    from bench.serve import calculate_metrics
    mine = [o for o in outcomes if o.phase == phase]
    normal = [(requests[o.index], o.timing) for o in mine if o.kind == "normal" and o.timing is not None]
    dur = max((o.done_s for o in mine), default=0.0) - min((o.sent_s for o in mine), default=0.0)
    m = calculate_metrics([r for r, _ in normal], [t for _, t in normal], dur or 1.0, percentiles)
    sent = sorted(o.sent_s for o in mine)
    return {"requests": len(mine), "duration_s": dur,
            "sent_rate": (len(sent) - 1) / (sent[-1] - sent[0]) if len(sent) > 1 and sent[-1] > sent[0] else None,
            "outcomes": dict(sorted(Counter(f"{o.kind}:{o.outcome}" for o in mine).items())),
            "statuses": dict(sorted(Counter(str(o.status) for o in mine).items())),
            "unexpected": sum(not o.expected for o in mine), **m}


def log_errors(path: Path | None) -> list[str] | None:
    """The server log's ERROR and Traceback lines (first 20); None without a log."""
    if path is None or not path.exists():
        return None
    lines = path.read_text(errors="replace").splitlines()
    return [line[:300] for line in lines if line.startswith(("ERROR", "Traceback"))][:20]


def verdicts(result: dict[str, Any], memory: dict[str, dict], max_growth: float, server_exit: int | None,
             server_log_errors: list[str] | None) -> dict[str, str]:
    """'pass', 'FAIL' or 'n/a' (nothing to judge it by), per requirement."""
    def judge(ok: bool | None) -> str:
        return "n/a" if ok is None else ("pass" if ok else "FAIL")

    outcomes, idle = result["outcomes"], result["idle"]
    growth = {k: memory[k]["growth"] for k in ("api_rss_bytes", "core_rss_bytes", "device_memory_used_bytes")}
    out = {"zero_5xx": judge(not any(o.status >= 500 for o in outcomes)),
           "every_outcome_expected": judge(all(o.expected for o in outcomes))}
    for key, g in growth.items():
        out[f"{key.removesuffix('_bytes')}_growth_under_{max_growth:.0%}"] = judge(None if g is None
                                                                                   else g < max_growth)
    out["pool_free_at_end"] = judge(idle.get("num_requests_running") == 0 and idle.get("num_requests_waiting") == 0
                                    and idle.get("num_free_blocks") == idle.get("num_blocks"))
    out["server_log_without_errors"] = judge(None if server_log_errors is None else not server_log_errors)
    if server_exit is not None:          # SIGTERM: uvicorn re-raises the signal after a clean shutdown
        out["server_clean_exit"] = judge(server_exit in (0, -signal.SIGTERM))
    return out


# ---- the report ----------------------------------------------------------------------------------
def plot(path: Path, samples: list[dict[str, float]], result: dict[str, Any], memory: dict[str, dict],
         t_warm: float, period_s: float, title: str) -> Path | None:
    """RSS (API process, engine core, all), device memory, and requests sent / finished per second; the
    windows the growth compares shaded."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    t = [s["t_s"] for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    for key, label in zip(RSS_KEYS, ("API process", "engine core", "all")):
        if any(key in s for s in samples):
            axes[0].plot(t, [s.get(key, 0) / 2**20 for s in samples], label=label)
    axes[0].set_ylabel("host RSS (MiB)")
    device = [s.get("device_memory_used_bytes", 0) / 2**30 for s in samples]
    axes[1].plot(t, device, color="C3")
    axes[1].set_ylabel("device memory in use (GiB)")
    if not any(device):
        axes[1].text(0.5, 0.7, "the server reports no device memory (the CPU keeps no count)",
                     transform=axes[1].transAxes, ha="center", fontsize=9)
    for ax, key in ((axes[0], "rss_bytes"), (axes[1], "device_memory_used_bytes")):
        for window in ("first_window_s", "last_window_s"):
            if window in memory[key]:
                ax.axvspan(*memory[key][window], color="grey", alpha=0.15)
    outcomes = result["outcomes"]
    end = max([o.done_s for o in outcomes] + t + [period_s])
    bins = np.arange(0.0, end + period_s, period_s)
    for attr, label in (("sent_s", "sent"), ("done_s", "finished")):
        hist, _ = np.histogram([getattr(o, attr) for o in outcomes], bins)
        axes[2].step(bins[1:], hist / period_s, where="pre", label=label)
    axes[2].set_ylabel("requests / s")
    axes[2].set_xlabel("time since the start (s)")
    for ax in axes:
        ax.axvline(t_warm, color="grey", linestyle=":", linewidth=1)
        ax.axvline(result["phase_start_s"]["faults"], color="grey", linestyle="--", linewidth=1)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"{title}\n(dotted: warm-up ends; dashed: the fault phase starts; shaded: the windows compared)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(name: str, meta: dict[str, Any], metrics: dict[str, Any]) -> str:
    """The provenance and settings, the verdicts, per-phase figures and outcomes, the memory windows, the
    end state, and every 5xx, server log error and (the first 50) unexpected outcomes."""
    from bench.common import markdown_table
    lines = [f"# soak: {name}", ""] + [f"- {k}: `{v}`" for k, v in {**meta, **metrics["settings"]}.items()]
    lines += ["", "## Verdicts", "", markdown_table([{"check": k, "verdict": v}
                                                    for k, v in metrics["verdicts"].items()])]
    cols = ["requests", "duration_s", "sent_rate", "unexpected", "completed", "failed", "request_throughput",
            "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms"]
    lines += ["## Phases", "", markdown_table([{"phase": p, **{c: m[c] for c in cols}}
                                               for p, m in metrics["phases"].items()])]
    lines += ["## Outcomes", "", markdown_table([{"phase": p, "kind:outcome": k, "count": n}
                                                 for p, m in metrics["phases"].items()
                                                 for k, n in m["outcomes"].items()])]
    lines += ["## Memory after warm-up (bytes; median of the first and the last window)", "",
              markdown_table([{"series": k, **v} for k, v in metrics["memory"].items()])]
    lines += [f"Most requests waiting in a sample: {metrics['max_num_requests_waiting']}; samples that failed: "
              f"{len(metrics['sampler_errors'])}.", ""]
    lines += ["## At the end", "", markdown_table([metrics["idle"]])]
    if metrics["five_xx"]:
        lines += ["## 5xx", "", markdown_table(metrics["five_xx"])]
    if metrics["server_log_errors"]:
        lines += ["## Server log errors", "", "```", *metrics["server_log_errors"], "```", ""]
    if metrics["unexpected"]:
        lines += ["## Unexpected outcomes (first 50)", "", markdown_table(metrics["unexpected"][:50])]
    return "\n".join(lines)


def write_report(name: str, meta: dict[str, Any], metrics: dict[str, Any], result: dict[str, Any], t_warm: float,
                 period_s: float) -> Path:
    """<name>.json ({"meta", "metrics"}), .md and .png in the results folder; returns the JSON's path."""
    from bench import common
    results_dir = Path(common.RESULTS_DIR)
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    path.write_text(json.dumps({"meta": meta, "metrics": metrics}, indent=2, default=str) + "\n")
    (results_dir / f"{name}.md").write_text(markdown(name, meta, metrics))
    plot(results_dir / f"{name}.png", result["samples"], result, metrics["memory"], t_warm, period_s,
         f"{name}: {meta['device']}, rev {meta['git_revision']}, {metrics['settings']['request_rate']} req/s")
    return path


def analyse(args: argparse.Namespace, result: dict[str, Any], phases: dict[str, tuple[list, list]],
            server_exit: int | None, server_log: Path | None) -> tuple[dict[str, Any], float]:
    """The metrics the report holds, and the end of warm-up (s since the start)."""
    outcomes = result["outcomes"]
    clean = [o for o in outcomes if o.phase == "clean"]
    t_warm = sorted(o.sent_s for o in clean)[min(len(clean) - 1, math.ceil(args.warmup_fraction * len(clean)))]
    samples = result["samples"]
    memory = {k: window_growth(samples, k, t_warm, result["load_end_s"], args.window_fraction)
              for k in (*RSS_KEYS, "device_memory_used_bytes")}

    def row(o: Outcome) -> dict[str, Any]:
        return {k: v for k, v in asdict(o).items() if k != "timing"}
    metrics = {
        "phases": {p: phase_report(p, outcomes, phases[p][0], [50.0, 99.0]) for p in phases},
        "memory": memory, "idle": result["idle"], "warmup_end_s": t_warm, "load_end_s": result["load_end_s"],
        "five_xx": [row(o) for o in outcomes if o.status >= 500],
        "unexpected": [row(o) for o in outcomes if not o.expected],
        "faults": [row(o) for o in outcomes if o.kind != "normal"],
        "max_num_requests_waiting": max((s.get("num_requests_waiting", 0) for s in samples), default=None),
        "sampler_errors": result["sampler_errors"], "server_exit_status": server_exit,
        "server_log_errors": log_errors(server_log), "samples": samples}
    metrics["verdicts"] = verdicts(result, memory, args.max_growth, server_exit, metrics["server_log_errors"])
    return metrics, t_warm


# ---- the server, when this script starts it ----------------------------------------------------
@contextlib.contextmanager
def serve(server_args: list[str], timeout_s: float, log_path: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """`python -m jaxpaged.server <server_args>` (on a free port unless they name one), healthy on entry;
    stopped with SIGTERM on exit (SIGKILL after 60 s). Yields its root URL and its process."""
    import socket
    import urllib.request
    if "--port" not in server_args:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            server_args = [*server_args, "--host", "127.0.0.1", "--port", str(s.getsockname()[1])]
    port = server_args[server_args.index("--port") + 1]
    base = f"http://127.0.0.1:{port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "jaxpaged.server", *server_args], stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode}: see {log_path}")
                with contextlib.suppress(OSError):
                    if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server was not healthy within {timeout_s} s: see {log_path}")
                time.sleep(0.5)
            yield base, proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This script's flags, and the server's after `--` (with --serve)."""
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="a running server's root")
    p.add_argument("--server-pid", type=int, default=None, help="its API process, for RSS (this host only)")
    p.add_argument("--serve", action="store_true", help="start the server with the flags after `--`, stop it after")
    p.add_argument("--server-log", type=Path, default=None,
                   help="its log, checked for ERROR and Traceback lines (--serve: written to <result>-server.log)")
    p.add_argument("--server-timeout-s", type=float, default=900.0, help="--serve: deadline for /health 200")
    p.add_argument("--model", default="qwen2-0.5b", help="bench model of the workload (tokenizer)")
    p.add_argument("--num-prompts", type=int, default=10_000, help="phase 1's ShareGPT requests")
    p.add_argument("--fault-num-prompts", type=int, default=2_000,
                   help="phase 2's requests (the samples after phase 1's), faults included")
    p.add_argument("--fault-fraction", type=float, default=0.05, help="share of phase 2's requests that are faults")
    p.add_argument("--max-output-len", type=int, default=None, help="cap on each sample's output length")
    p.add_argument("--request-rate", type=float, default=40.0, help="Poisson arrivals, req/s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-period-s", type=float, default=2.0)
    p.add_argument("--warmup-fraction", type=float, default=0.1, help="of phase 1's requests: the warm-up")
    p.add_argument("--window-fraction", type=float, default=0.1, help="of the samples after warm-up: a window")
    p.add_argument("--max-growth", type=float, default=0.02, help="allowed growth of RSS and device memory")
    p.add_argument("--request-timeout-s", type=float, default=600.0,
                   help="a request not finished by then fails (a stuck stream is a finding, not a hang)")
    p.add_argument("--drain-timeout-s", type=float, default=120.0, help="wait for the idle server after the run")
    p.add_argument("--result-name", default=None, help="results file stem (default soak-<model>)")
    p.add_argument("--disable-tqdm", action="store_true")
    args = p.parse_args(argv[:split])
    if args.serve != (split < len(argv)):
        p.error("--serve takes the server's flags after `--` (and `--` needs --serve)")
    return args, argv[split + 1:]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from bench.common import RESULTS_DIR, stamp
    from bench.datasets import get_dataset, summarize
    argv = sys.argv[1:] if argv is None else argv
    args, server_args = parse_args(argv)
    name = args.result_name or f"soak-{Path(args.model).name}"
    samples = get_dataset("sharegpt", args.model, args.num_prompts + args.fault_num_prompts, args.seed)
    if args.max_output_len:
        samples = [r._replace(output_len=min(r.output_len, args.max_output_len)) for r in samples]
    rng = np.random.default_rng(args.seed)
    phases = {"clean": (samples[:args.num_prompts], ["normal"] * args.num_prompts),
              "faults": (samples[args.num_prompts:], plan_kinds(args.fault_num_prompts, args.fault_fraction, rng))}
    meta = stamp(["bench/soak.py", *argv], with_device=False)
    with contextlib.ExitStack() as stack:
        proc = None
        if args.serve:
            args.server_log = Path(RESULTS_DIR) / f"{name}-server.log"
            args.base_url, proc = stack.enter_context(serve(server_args, args.server_timeout_s, args.server_log))
        pid = proc.pid if proc is not None else args.server_pid
        target = asyncio.run(Target.connect(args.base_url))
        result = asyncio.run(soak(args, target, pid, phases))
    server_exit = proc.returncode if proc is not None else None
    metrics, t_warm = analyse(args, result, phases, server_exit, args.server_log)
    metrics["settings"] = dict(model=args.model, served_model_name=target.model, request_rate=args.request_rate,
                               fault_fraction=args.fault_fraction, fault_kinds=list(FAULT_KINDS),
                               max_output_len=args.max_output_len, seed=args.seed,
                               workload=summarize(samples), server_args=" ".join(server_args) or None)
    path = write_report(name, meta, metrics, result, t_warm, args.sample_period_s)
    print(markdown(name, meta, {**metrics, "unexpected": metrics["unexpected"][:10]}))
    print(f"results: {path} (+ .md, .png)")
    return metrics


if __name__ == "__main__":
    sys.exit(0 if all(v != "FAIL" for v in main()["verdicts"].values()) else 1)
