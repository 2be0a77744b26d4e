"""Device busy time and idle gaps from a JAX profiler trace, independent of the engine's own counters.

`jax.profiler.trace(dir, create_perfetto_trace=True)` writes plugins/profile/<run>/perfetto_trace.json.gz
(and <host>.trace.json.gz). On a GPU its processes named "/device:GPU:N" hold one complete ("X") event per
kernel. The union of those intervals is the device's busy time; what is left of the span between the
first and last kernel is idle, mostly host gaps between steps (a decode step of qwen2-0.5b is ~1 ms, so
gaps over 20 us between kernels are counted separately). On the CPU backend there is no device process
and `analyze` returns None.
"""
from __future__ import annotations

import glob
import gzip
import json
import os
from typing import Any

GAP_THRESHOLD_US = 20.0


def find_trace(trace_dir: str) -> str | None:
    """The newest perfetto (else Chrome-format) trace under `trace_dir`."""
    files = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    files = files or glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    return max(files, key=os.path.getmtime) if files else None


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merged, sorted intervals: [(0, 2), (1, 3), (5, 6)] -> [(0, 3), (5, 6)]."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _device_pids(events: list[dict[str, Any]]) -> set:
    """The trace's processes named like a device ("/device:GPU:0"), host-side ones excluded."""
    return {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
            and "/device:" in str(e.get("args", {}).get("name", ""))
            and "host" not in str(e.get("args", {}).get("name", "")).lower()}


def _device_kernels(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The complete ("X") events of the processes named like a device ("/device:GPU:0")."""
    device_pids = _device_pids(events)
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in device_pids and "ts" in e]


def device_intervals(events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(start_us, end_us) of every complete event in a process named like a device ("/device:GPU:0")."""
    return [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in _device_kernels(events)]


def analyze_events(events: list[dict[str, Any]], gap_threshold_us: float = GAP_THRESHOLD_US) -> dict[str, Any] | None:
    busy = _union(device_intervals(events))
    if not busy:
        return None
    span = busy[-1][1] - busy[0][0]
    busy_us = sum(b - a for a, b in busy)
    gaps = [b[0] - a[1] for a, b in zip(busy, busy[1:])]
    big = [g for g in gaps if g > gap_threshold_us]
    return {"span_ms": span / 1000, "device_busy_ms": busy_us / 1000, "device_idle_ms": (span - busy_us) / 1000,
            "device_busy_fraction": busy_us / span if span else 1.0,
            f"num_gaps_over_{gap_threshold_us:g}us": len(big), "gaps_over_threshold_ms": sum(big) / 1000,
            "median_gap_over_threshold_us": float(sorted(big)[len(big) // 2]) if big else 0.0}


def gaps_by_neighbours(events: list[dict[str, Any]], n: int = 12,
                       gap_threshold_us: float = GAP_THRESHOLD_US) -> list[dict[str, Any]]:
    """Device idle gaps over the threshold, grouped by the kernel that ran last before the gap and the one
    that starts it: [{"before", "after", "count", "total_ms", "mean_us"}], the largest totals first."""
    kernels = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), str(e.get("name", "?"))[:60])
                     for e in _device_kernels(events))
    totals: dict[tuple[str, str], list[float]] = {}
    end, last = None, ""
    for start, stop, name in kernels:
        if end is not None and start - end > gap_threshold_us:
            t = totals.setdefault((last, name), [0.0, 0])
            t[0] += start - end
            t[1] += 1
        if end is None or stop >= end:
            end, last = stop, name
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"before": b, "after": a, "count": int(v[1]), "total_ms": v[0] / 1000, "mean_us": v[0] / v[1]}
            for (b, a), v in rows]


def _top_events(events: list[dict[str, Any]], n: int, on_device: bool) -> list[dict[str, Any]]:
    """Complete events of the device's processes (or of the host's) by total time, longest first:
    [{"name", "total_ms", "count", "mean_us"}]."""
    device_pids = _device_pids(events)
    totals: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") == "X" and "pid" in e and (e["pid"] in device_pids) == on_device:
            t = totals.setdefault(str(e.get("name", "?"))[:90], [0.0, 0])
            t[0] += float(e.get("dur", 0.0))
            t[1] += 1
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"name": k, "total_ms": v[0] / 1000, "count": int(v[1]), "mean_us": v[0] / v[1]} for k, v in rows]


def top_kernels(events: list[dict[str, Any]], n: int = 20) -> list[dict[str, Any]]:
    """The device's kernels by total time."""
    return _top_events(events, n, on_device=True)


def top_host_events(events: list[dict[str, Any]], n: int = 25) -> list[dict[str, Any]]:
    """The host side's events (runtime API calls, PjRt and thunk TraceMes) by total time: where the
    launching thread spends a step, e.g. blocked in a synchronize."""
    return _top_events(events, n, on_device=False)


def one_call_in_detail(events: list[dict[str, Any]], name: str = "PjRtCApiLoadedExecutable::Execute",
                       n: int = 60) -> list[dict[str, Any]]:
    """The host events nested inside the median-length call of `name` (same thread; the lower median), in
    order: where one launch spends its time. [{"at_us": offset from the call's start, "dur_us", "depth", "name"}]."""
    device_pids = _device_pids(events)
    host = [e for e in events if e.get("ph") == "X" and "pid" in e and e["pid"] not in device_pids]
    calls = sorted((e for e in host if name in str(e.get("name", ""))), key=lambda e: float(e.get("dur", 0)))
    if not calls:
        return []
    c = calls[(len(calls) - 1) // 2]
    t0, t1 = float(c["ts"]), float(c["ts"]) + float(c.get("dur", 0))
    inner = sorted((e for e in host if e.get("pid") == c.get("pid") and e.get("tid") == c.get("tid")
                    and t0 <= float(e["ts"]) and float(e["ts"]) + float(e.get("dur", 0)) <= t1 and e is not c),
                   key=lambda e: (float(e["ts"]), -float(e.get("dur", 0))))
    out, stack = [], []
    for e in inner:
        start, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
        while stack and start >= stack[-1] - 0.01:      # (trace times are rounded: 0.01 us slack)
            stack.pop()
        out.append({"at_us": round(start - t0, 1), "dur_us": round(end - start, 1), "depth": len(stack) + 1,
                    "name": str(e.get("name", "?"))[:70]})
        stack.append(end)
    return [{"at_us": 0.0, "dur_us": round(t1 - t0, 1), "depth": 0, "name": name}] + out[:n]


def _read_events(path: str) -> list[dict[str, Any]]:
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def load_events(trace_dir: str) -> list[dict[str, Any]] | None:
    path = find_trace(trace_dir)
    return None if path is None else _read_events(path)


def analyze(trace_dir: str, detail: bool = False) -> dict[str, Any] | None:
    """Device busy/idle over the trace; with detail, also where the time goes: the host's events and the
    device's kernels by total time, and the idle gaps grouped by the kernels around them."""
    path = find_trace(trace_dir)
    if path is None:
        return None
    events = _read_events(path)
    out = analyze_events(events)
    if out is not None:
        out["trace_file"] = path
        if detail:
            out["top_host_events"] = top_host_events(events, 30)
            out["top_kernels"] = top_kernels(events, 20)
            out["gaps_by_neighbours"] = gaps_by_neighbours(events)
            out["one_launch"] = one_call_in_detail(events)
    return out
