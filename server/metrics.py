"""GET /metrics: vLLM V1's Prometheus metrics under the `jaxpaged:` prefix, each meaning what vLLM's does.

The engine core's gauges and counters (scheduler, KV cache, prompt tokens) are read at scrape time from its
latest snapshot, which comes with every step's outputs to every API process (a custom collector, so there is
one source of truth). What this API process received (RequestStats: generated tokens, finish reasons,
latency samples) moves prometheus_client's counters and histograms on each scrape and every few seconds in
the background, so nothing grows. With several API processes (--api-server-count) those go through
prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR, set before prometheus_client is imported),
as vLLM's do: any process's /metrics sums every process's, each as of its last update (at most
MULTIPROCESS_PERIOD_S old).

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
import collections
import contextlib
import os

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
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
# How often each API process updates its share of the metrics when there are several.
MULTIPROCESS_PERIOD_S = 1.0
SINGLE_PROCESS_PERIOD_S = 5.0


def multiprocess_mode() -> bool:
    """Whether prometheus_client keeps its values in PROMETHEUS_MULTIPROC_DIR (read as it was imported)."""
    from prometheus_client import values
    return values.ValueClass is not values.MutexValue


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

        core = self.llm.core_stats
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


class ServerMetrics:
    def __init__(self, llm, model_name: str):
        self.llm = llm
        llm.request_stats.record_latencies = True       # drained into the histograms below
        self.registry = CollectorRegistry()
        self.multiprocess = multiprocess_mode()
        if self.multiprocess:
            multiprocess.MultiProcessCollector(self.registry, os.environ["PROMETHEUS_MULTIPROC_DIR"])
        own = None if self.multiprocess else self.registry      # (multiprocess: in the shared files)
        self.registry.register(_EngineCollector(llm, model_name))
        self.period_s = MULTIPROCESS_PERIOD_S if self.multiprocess else SINGLE_PROCESS_PERIOD_S

        def hist(name, doc, buckets):
            return Histogram(PREFIX + name, doc, ["model_name"], registry=own, buckets=buckets).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", E2E_BUCKETS)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Number of generation tokens processed.",
                                         ["model_name"], registry=own).labels(model_name)
        success = Counter(PREFIX + "request_success", "Count of successfully processed requests, by finish "
                          "reason (one per sample; abort: the client left or the server shut down).",
                          ["model_name", "finished_reason"], registry=own)
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self._success_family, self._model_name = success, model_name
        self._moved_tokens = 0                                  # what the counters hold of RequestStats
        self._moved_finished: collections.Counter = collections.Counter()

    def drain(self) -> None:
        """Move what this process received since the last drain into the counters and histograms."""
        stats = self.llm.request_stats
        ttft, itl, e2e = stats.drain_latencies()
        for hist, samples in ((self.ttft, ttft), (self.itl, itl), (self.e2e, e2e)):
            for s in samples:
                hist.observe(s)
        if stats.generation_tokens != self._moved_tokens:
            self.generation_tokens.inc(stats.generation_tokens - self._moved_tokens)
            self._moved_tokens = stats.generation_tokens
        for reason, count in list(stats.finished_by_reason.items()):
            if count != self._moved_finished[reason]:
                if reason not in self.success:
                    self.success[reason] = self._success_family.labels(self._model_name, reason)
                self.success[reason].inc(count - self._moved_finished[reason])
                self._moved_finished[reason] = count

    def render(self) -> bytes:
        self.drain()
        return generate_latest(self.registry)

    async def drain_forever(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            while True:
                await asyncio.sleep(self.period_s)
                self.drain()
