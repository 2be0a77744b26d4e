"""The device's kernels per generated token, from a JAX profiler trace of a decode-only run (e.g.
`bench/throughput.py --dataset openqa --num-prompts 1 --profile`): how many kernels a token costs, how long
they run, and how much of each token's span the device sits idle. Where a one-request decode's time goes.

  python3 bench/kernel_table.py TRACE_DIR --tokens 300 [--top 30]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import trace_analysis as ta  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace_dir")
    p.add_argument("--tokens", type=int, required=True, help="tokens the traced run generated")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    events = ta.load_events(args.trace_dir)
    if events is None:
        sys.exit(f"no trace under {args.trace_dir}")
    summary = ta.analyze_events(events)
    kernels = ta.device_intervals(events)
    n = args.tokens
    print(f"{len(kernels)} kernels, {len(kernels) / n:.1f} per token; per token: "
          f"span {1000 * summary['span_ms'] / n:.1f} us, device busy {1000 * summary['device_busy_ms'] / n:.1f} us")
    print(f"{'kernel':90s} {'per token':>9s} {'mean us':>8s} {'us/token':>9s}")
    for k in ta._top_events(events, args.top, on_device=True):
        print(f"{k['name']:90s} {k['count'] / n:9.2f} {k['mean_us']:8.1f} {1000 * k['total_ms'] / n:9.1f}")


if __name__ == "__main__":
    main()
