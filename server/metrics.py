"""GET /metrics: vLLM's Prometheus metrics under the `jaxpaged:` prefix.

Gauges and counters are read at scrape time (a custom collector, so there is one source of truth): the
scheduler's and the KV cache's from the engine core's latest snapshot (it comes with every step's outputs),
tokens and finish reasons from what this process delivered (RequestStats). Latency samples are drained
into histograms on each scrape and every few seconds in the background, so the lists never grow.
"""
from __future__ import annotations

import asyncio
import contextlib

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "jaxpaged:"
# vLLM's bucket boundaries
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort")


class _EngineCollector:
    def __init__(self, llm, model_name: str):
        self.llm, self.model_name = llm, model_name

    def collect(self):
        labels = [self.model_name]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        core, stats = self.llm.core_stats, self.llm.request_stats
        yield gauge("num_requests_running", "Requests in the running batch.", core.num_requests_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", core.num_requests_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", core.kv_cache_usage)
        yield gauge("num_free_blocks", "KV cache blocks free (cached-but-unreferenced included).",
                    core.num_free_blocks)
        yield gauge("num_blocks", "KV cache blocks in the pool (the null block excluded).",
                    self.llm.info.num_blocks - 1)
        yield gauge("kv_cache_waste_perc", "Allocated but unused token slots over allocated slots, over the "
                    "running requests (waste sits only in each sequence's last block).", core.kv_cache_waste)
        yield gauge("device_memory_used_bytes", "Device memory the engine core's allocator holds (weights, KV "
                    "cache, temporaries; 0 where the backend keeps no count). jaxpaged's own: vLLM has none.",
                    core.device_memory_bytes)
        yield counter("prefix_cache_queries", "Blocks looked up in the prefix cache.", core.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Blocks found in the prefix cache.", core.prefix_cache_hits)
        yield counter("num_preemptions", "Preemptions of running requests.", core.num_preemptions)
        yield counter("prompt_tokens", "Prompt tokens prefilled.", core.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", stats.generation_tokens)
        success = CounterMetricFamily(PREFIX + "request_success", "Finished requests, by finish reason.",
                                      labels=["model_name", "finished_reason"])
        finished = dict(stats.finished_by_reason)
        for reason in sorted(set(FINISH_REASONS) | set(finished)):
            success.add_metric([self.model_name, reason], finished.get(reason, 0))
        yield success


class ServerMetrics:
    def __init__(self, llm, model_name: str):
        self.llm = llm
        llm.request_stats.record_latencies = True       # drained into the histograms below
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(llm, model_name))

        def hist(name, doc, buckets):
            return Histogram(PREFIX + name, doc, ["model_name"], registry=self.registry,
                             buckets=buckets).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish of a request.", E2E_BUCKETS)

    def drain(self) -> None:
        ttft, itl, e2e = self.llm.request_stats.drain_latencies()
        for hist, samples in ((self.ttft, ttft), (self.itl, itl), (self.e2e, e2e)):
            for s in samples:
                hist.observe(s)

    def render(self) -> bytes:
        self.drain()
        return generate_latest(self.registry)

    async def drain_forever(self, period_s: float = 5.0) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            while True:
                await asyncio.sleep(period_s)
                self.drain()
