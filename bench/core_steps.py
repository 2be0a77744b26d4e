"""A server burst's first steps, from the engine core's step log (JAXPAGED_STEP_LOG; bench/serve_vs_offline.sh
--core-step-log): when each step was scheduled and ended, its tokens and requests, the token bucket it ran in,
and how many requests had reached the core by the time it was scheduled.

    python -m bench.core_steps /tmp/core-steps.csv [--steps 20] [--max-num-batched-tokens 16384] [--client R.json]

--client R.json (bench/serve.py's result of the same burst): also how long after the client's start the burst's
first request reached the core and its first step ended (both logs read the host's one monotonic clock).

The engine keeps one step in flight, so step N is scheduled as step N-1 is launched, about when N-2 ends:
a step's "scheduled" column is the end of the step two before it (the burst's first arrival for the first
two). Times are seconds from the burst's first arrival (the first of 10 within 0.1 s: a benchmark's warm-up
request comes before)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from jaxpaged.engine.stats import ZERO_PERF_COUNTER
from jaxpaged.runner.buckets import BucketPolicy


def arrival_times(arrivals: np.ndarray) -> np.ndarray:
    """One time per request, from the log's (time, requests) rows."""
    return np.repeat(arrivals[:, 0], arrivals[:, 1].astype(int)) if len(arrivals) else np.zeros(0)


def burst_start(arrivals: np.ndarray, count: int = 10, within_s: float = 0.1) -> int:
    """The first arrival of the first burst (`count` arrivals within `within_s`): the log's first arrivals may
    be a benchmark's warm-up request."""
    t = arrival_times(arrivals)
    for i in range(max(len(t) - count + 1, 0)):
        if t[i + count - 1] - t[i] <= within_s:
            return i
    return 0


def table(steps: np.ndarray, arrivals: np.ndarray, n: int, max_tokens: int, max_seqs: int) -> list[dict]:
    """The first n steps that end after the burst's first arrival; times from that arrival."""
    policy = BucketPolicy(max_tokens, max_seqs)
    t = arrival_times(arrivals)
    first = burst_start(arrivals)
    t0 = t[first] if len(t) else 0.0
    start = int(np.searchsorted(steps[:, 0], t0, side="right"))
    rows = []
    for i in range(start, min(start + n, len(steps))):
        end, tokens, requests, _ctx = steps[i]
        scheduled = max(steps[i - 2, 0], t0) if i >= 2 else t0      # (steps before `start` ended by t0)
        arrived = int(np.searchsorted(t, scheduled, side="right")) - first
        bucket = policy.pick(int(tokens), int(requests), decode_only=tokens == requests)
        rows.append({"step": i - start + 1, "scheduled_s": round(float(scheduled - t0), 3),
                     "end_s": round(float(end - t0), 3), "tokens": int(tokens),
                     "bucket_tokens": bucket.padded_num_tokens, "requests": int(requests),
                     "arrived_by_schedule": arrived})
    return rows


def log_zero(path: Path) -> float | None:
    """The step log's time zero as a perf_counter() reading (its first line), or None (a log without it)."""
    first = path.read_text().split("\n", 1)[0]
    key = f"# {ZERO_PERF_COUNTER}="
    return float(first[len(key):]) if first.startswith(key) else None


def client_offsets(steps: np.ndarray, arrivals: np.ndarray, zero: float, client_start: float) -> dict:
    """Seconds from the client's start to the burst's first arrival at the core, and to the end of the first
    step after it."""
    t = arrival_times(arrivals)
    first = t[burst_start(arrivals)] if len(t) else 0.0
    after = steps[steps[:, 0] > first, 0]
    return {"first_arrival_s": round(float(zero + first - client_start), 3),
            "first_step_end_s": round(float(zero + after[0] - client_start), 3) if len(after) else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--client", default=None, help="bench/serve.py's JSON result of the same burst")
    a = p.parse_args()
    path = Path(a.csv)
    steps = np.loadtxt(path, delimiter=",", ndmin=2)
    arrivals = np.loadtxt(path.with_name(path.stem + "-arrivals.csv"), delimiter=",", ndmin=2)
    rows = table(steps, arrivals, a.steps, a.max_num_batched_tokens, a.max_num_seqs)
    print(f"{len(steps)} steps, {int(arrivals[:, 1].sum()) if len(arrivals) else 0} arrivals, the last at "
          f"{arrivals[-1, 0] if len(arrivals) else 0:.3f} s")
    print("| " + " | ".join(rows[0]) + " |" if rows else "(no steps)")
    for r in rows:
        print("| " + " | ".join(str(v) for v in r.values()) + " |")
    if a.client:
        zero = log_zero(path)
        start = json.loads(Path(a.client).read_text())["metrics"].get("start_perf_counter_s")
        if zero is None or start is None:
            print("(the step log or the client's result has no clock reading: written before they recorded one)")
        else:
            off = client_offsets(steps, arrivals, zero, start)
            print(f"from the client's start: the burst's first request reached the core after "
                  f"{off['first_arrival_s']} s, the first step after it ended at {off['first_step_end_s']} s")


if __name__ == "__main__":
    main()
