"""GET /metrics: vLLM V1's Prometheus metrics under the `jaxpaged:` prefix, each meaning what vLLM's does.

Gauges and counters are read at scrape time (a custom collector, so there is one source of truth): the
scheduler's and the KV cache's from the engine core's latest snapshot (it comes with every step's outputs),
tokens and finish reasons from what this process received (RequestStats). Latency samples are drained
into histograms on each scrape and every few seconds in the background, so the lists never grow.

What moves each counter, as in vLLM V1 (a request with n samples is n requests, as vLLM's child requests):

    prompt_tokens         a request's whole prompt, prefix-cache hits included, once, at its first token
                          (recomputing it after a preemption does not count again)
    generation_tokens     the tokens the engine core sent for a request not finished here yet (an output that
                          completes a stop string counts whole)
    prefix_cache_queries  a request's tokens, once, when it is first scheduled (not its lookups while it
    prefix_cache_hits     waits for blocks, nor after a preemption); hits: the tokens the cache served
    num_preemptions       each preemption
    request_success       each finished request by finish reason; `abort` counts the requests a client left
                          or a shutdown ended (vLLM declares the label but never moves it, a known vLLM bug)
    histograms            time to first token and e2e latency from arrival; inter-token latency between two
                          outputs that carry tokens
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
        yield gauge("num_requests_running", "Number of requests in model execution batches.",
                    core.num_requests_running)
        yield gauge("num_requests_waiting", "Number of requests waiting to be processed (preempted ones included).",
                    core.num_requests_waiting)
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", core.kv_cache_usage)
        yield gauge("num_free_blocks", "KV cache blocks free (cached-but-unreferenced included).",
                    core.num_free_blocks)
        yield gauge("num_blocks", "KV cache blocks in the pool (the null block excluded).",
                    self.llm.info.num_blocks - 1)
        yield gauge("kv_cache_waste_perc", "Allocated but unused token slots over allocated slots, over the "
                    "running requests (waste sits only in each sequence's last block).", core.kv_cache_waste)
        yield gauge("device_memory_used_bytes", "Device memory the engine core's allocator holds (weights, KV "
                    "cache, temporaries; 0 where the backend keeps no count). jaxpaged's own: vLLM has none.",
                    core.device_memory_bytes)
        yield counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens "
                      "(each request's tokens, once, when it is first scheduled).", core.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      core.prefix_cache_hits)
        yield counter("num_preemptions", "Cumulative number of preemptions from the engine.", core.num_preemptions)
        yield counter("prompt_tokens", "Number of prefill tokens processed: each request's whole prompt, "
                      "prefix-cache hits included, once, at its first token.", core.prompt_tokens)
        yield counter("generation_tokens", "Number of generation tokens processed.", stats.generation_tokens)
        success = CounterMetricFamily(PREFIX + "request_success", "Count of successfully processed requests, by "
                                      "finish reason (one per sample; abort: the client left or the server shut "
                                      "down).", labels=["model_name", "finished_reason"])
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

        self.ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", E2E_BUCKETS)

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
