"""Where an offline run's time goes, from its step log (`bench/throughput.py --step-log CSV`): the steps grouped
by kind and request count, each group's seconds against its floor on the device.

A step's floor is max(bytes at the HBM's peak, FLOPs at the dense bf16 peak): it reads the weights once and
every scheduled request's KV cache (the log's context tokens, each layer's up to its window), and computes 2 x
the layers' parameters a scheduled token plus the LM head a request. The groups are the mixed steps (any
prompt token) and decode steps by request count (1-16, 17-64, 65-128, 129-256, 257-512, 513-1024, more).

    python -m bench.step_log_table CSV [CSV ...] --model llama3-8b --device "NVIDIA H200"
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):   # run as a file: see bench/common.py add_repo_to_path
    _bench = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _bench]
    sys.path.append(str(_bench.parent))

EDGES = (16, 64, 128, 256, 512, 1024)


def load(path: str) -> np.ndarray:
    """[steps, 4]: seconds, tokens, requests, context tokens."""
    return np.loadtxt(path, delimiter=",", ndmin=2)[:, :4]


def mixed_steps(steps: np.ndarray) -> np.ndarray:
    """bool[steps]: the steps with prompt tokens (more tokens scheduled than requests)."""
    return steps[:, 1] > steps[:, 2]


def floors(steps: np.ndarray, step_weight_bytes: int, layer_flops_per_token: int, head_flops: int,
           kv_bytes_per_token: int, peaks: tuple[float, float]) -> np.ndarray:
    """Each step's floor in seconds (see the module docstring)."""
    flop_peak, byte_peak = peaks
    tokens, requests, ctx = steps[:, 1], steps[:, 2], steps[:, 3]
    nbytes = step_weight_bytes + ctx * kv_bytes_per_token
    flops = tokens * layer_flops_per_token + requests * head_flops
    return np.maximum(nbytes / byte_peak, flops / flop_peak)


def groups(steps: np.ndarray, floor: np.ndarray) -> list[dict]:
    """One row a group that has steps: its name, steps, seconds, median step (ms), floor (s), seconds / floor."""
    mixed = mixed_steps(steps)
    masks = [("mixed", mixed)]
    lo = 1
    for hi in (*EDGES, None):
        req = steps[:, 2]
        m = ~mixed & (req >= lo) & ((req <= hi) if hi is not None else True)
        masks.append((f"decode {lo}-{hi}" if hi is not None else f"decode {lo}+", m))
        lo = (hi or 0) + 1
    rows = []
    for name, m in masks:
        if not m.any():
            continue
        s, f = float(steps[m, 0].sum()), float(floor[m].sum())
        rows.append({"group": name, "steps": int(m.sum()), "seconds": s,
                     "median_ms": 1e3 * float(np.median(steps[m, 0])), "floor_s": f, "ratio": s / f})
    s, f = float(steps[:, 0].sum()), float(floor.sum())
    rows.append({"group": "all", "steps": len(steps), "seconds": s, "median_ms": 1e3 * float(np.median(steps[:, 0])),
                 "floor_s": f, "ratio": s / f})
    return rows


def markdown(rows: list[dict], title: str) -> str:
    out = [f"{title}\n", "| steps | count | seconds | median step | floor | measured / floor |",
           "|---|---|---|---|---|---|"]
    out += [f"| {r['group']} | {r['steps']} | {r['seconds']:.2f} | {r['median_ms']:.2f} ms | {r['floor_s']:.2f} s | "
            f"{r['ratio']:.2f} |" for r in rows]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--device", default="NVIDIA H200", help="a key of bench.families.DEVICE_PEAKS")
    args = ap.parse_args()
    from bench.families import DEVICE_PEAKS, model_costs
    from bench.models import ensure_model_dir
    from jaxpaged.models.loader import model_config
    cfg = model_config(ensure_model_dir(args.model))
    costs = model_costs(args.model)
    # the cost of a token of context: every layer's K and V (a windowed layer's window is not applied here:
    # the log has each step's context summed over requests, not per request)
    kv = sum(b for b, _ in costs.kv_bytes)
    head = 2 * cfg.hidden_size * cfg.vocab_size
    for path in args.csv:
        steps = load(path)
        f = floors(steps, costs.step_weight_bytes, costs.layer_flops_per_token, head, kv, DEVICE_PEAKS[args.device])
        print(markdown(groups(steps, f), f"{path} ({args.model}, floors on the {args.device})"))


if __name__ == "__main__":
    main()
