"""The soak benchmark's view of the server's memory (bench/soak.py): host RSS of its processes from /proc,
and /metrics' gauges (device memory in use, running and waiting requests, free blocks), sampled on a period.
"""
from __future__ import annotations

import asyncio
import os
import time
from collections import Counter

# Gauges read from /metrics at each sample (without the "jaxpaged:" prefix).
GAUGES = ("device_memory_used_bytes", "num_requests_running", "num_requests_waiting", "num_free_blocks",
          "num_blocks", "kv_cache_usage_perc")
RSS_KEYS = ("api_rss_bytes", "core_rss_bytes", "rss_bytes")


def _vm_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(p) for p in f.read().split()]
    return out


def server_rss(pid: int) -> dict[str, int]:
    """Host RSS of the server's process tree: the API process (pid), the engine core (a spawned child,
    `spawn_main` in its command line) and all of it (multiprocessing's resource tracker included)."""
    api = _vm_rss(pid)
    core = children = 0
    todo = _children(pid)
    while todo:
        child = todo.pop()
        try:
            rss = _vm_rss(child)
            with open(f"/proc/{child}/cmdline", "rb") as f:
                is_core = b"spawn_main" in f.read()
            todo += _children(child)
        except FileNotFoundError:        # it exited meanwhile
            continue
        children += rss
        core += rss if is_core else 0
    return {"api_rss_bytes": api, "core_rss_bytes": core, "rss_bytes": api + children}


async def scrape(session, base_url: str) -> dict[str, float]:
    """The GAUGES of /metrics (one model: labels dropped)."""
    from prometheus_client.parser import text_string_to_metric_families
    async with session.get(base_url + "/metrics") as r:
        text = await r.text()
    values = {}
    for family in text_string_to_metric_families(text):
        name = family.name.removeprefix("jaxpaged:")
        if name in GAUGES and family.samples:
            values[name] = float(family.samples[0].value)
    return values


class Sampler:
    """A sample every period_s: time, RSS of the server's processes, /metrics' gauges, and the client's
    requests sent and finished so far. A sample that fails (the server gone, /metrics timing out) is
    counted in `errors` and the series goes on."""

    def __init__(self, session, base_url: str, pid: int | None, period_s: float, t0: float, counts: Counter):
        self.session, self.base_url, self.pid, self.period_s, self.t0 = session, base_url, pid, period_s, t0
        self.counts = counts
        self.samples: list[dict[str, float]] = []
        self.errors: list[str] = []

    async def sample(self) -> dict[str, float]:
        s: dict[str, float] = {"t_s": time.perf_counter() - self.t0, "sent": self.counts["sent"],
                               "done": self.counts["done"]}
        if self.pid is not None:
            s.update(server_rss(self.pid))
        s.update(await scrape(self.session, self.base_url))
        self.samples.append(s)
        return s

    async def run(self) -> None:
        import aiohttp
        while True:
            try:
                await asyncio.wait_for(self.sample(), self.period_s * 5)
            except (OSError, aiohttp.ClientError, asyncio.TimeoutError) as e:
                self.errors.append(f"{time.perf_counter() - self.t0:.1f} s: {type(e).__name__}: {e}"[:300])
            await asyncio.sleep(self.period_s)
