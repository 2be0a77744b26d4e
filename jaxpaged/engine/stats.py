"""Counters and samples for /metrics and the benchmarks (vLLM's metric names): EngineStats in the engine
core (scheduling, the KV cache, host timings), RequestStats in the API process (what clients saw: latencies,
tokens delivered, finish reasons)."""
from __future__ import annotations

import dataclasses
import operator
import pathlib
import time
from collections import Counter

import numpy as np

_COMPUTED = operator.attrgetter("num_computed_tokens")


@dataclasses.dataclass
class EngineStats:
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage: float = 0.0                 # fraction of blocks in use
    kv_cache_waste: float = 0.0                 # allocated-but-unused slots over allocated (running requests)
    # vLLM's counters (server/metrics.py says what each one means)
    prefix_cache_queries: int = 0               # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0                  # tokens it served
    num_preemptions: int = 0
    prompt_tokens: int = 0                      # whole prompts of the requests that sampled their first token
    generation_tokens: int = 0                  # tokens sampled (the core's: a stop string may cut some later)
    num_steps: int = 0
    # host timing of the last steps, seconds
    schedule_s: float = 0.0
    execute_s: float = 0.0
    process_s: float = 0.0
    wait_s: float = 0.0                         # host blocked on the device's sampled ids
    prepare_inputs_s: float = 0.0               # runner: padded model and sampling inputs (host)
    launch_s: float = 0.0                       # runner: packing + JAX dispatch of the step (host)
    last_step_time: float = dataclasses.field(default_factory=time.time)
    arrivals: int = 0
    max_waste_seen: float = 0.0
    # summed over steps, so kv_cache_waste_avg is the allocated-slot-weighted average of the run
    waste_slots_allocated: int = 0
    waste_slots_unused: int = 0
    # one row per step when not None (bench/throughput.py --step-log): (perf_counter when the step's results
    # were processed, tokens scheduled, requests, tokens of context the step's attention reads)
    step_log: list | None = None
    # with the step log: (perf_counter, requests added) for each batch of arrivals
    arrival_log: list | None = None
    _step_pending = None        # (not a field) the dispatched step's row, waiting for its results
    _scheduled = None           # (not a field) the row of the step scheduled last

    def on_arrival(self, n: int) -> None:
        self.arrivals += n
        if self.arrival_log is not None:
            self.arrival_log.append((time.perf_counter(), n))

    def on_schedule(self, sched, requests: dict) -> None:
        """Note a step's shape as it is scheduled (its requests are all still there), for the step log."""
        self._scheduled = None
        req_ids = sched.req_ids
        if self.step_log is None or not req_ids:
            return
        m = len(req_ids)
        computed = np.fromiter(map(_COMPUTED, map(requests.__getitem__, req_ids)), np.int64, m)
        n = np.fromiter(map(sched.num_scheduled_tokens.__getitem__, req_ids), np.int64, m)
        # (tokens scheduled, requests, tokens of context the step's attention reads)
        self._scheduled = (int(n.sum()), m, int(computed.sum()))

    def on_step(self, scheduler, kv, *, schedule_s: float, execute_s: float, process_s: float) -> None:
        self.num_steps += 1
        self.num_requests_running = scheduler.num_running
        self.num_requests_waiting = scheduler.num_waiting
        self.kv_cache_usage = kv.pool.usage
        allocated, used = kv.slot_usage(scheduler.running)
        self.kv_cache_waste = 0.0 if allocated == 0 else (allocated - used) / allocated
        self.max_waste_seen = max(self.max_waste_seen, self.kv_cache_waste)
        self.waste_slots_allocated += allocated
        self.waste_slots_unused += allocated - used
        self.prefix_cache_queries = kv.prefix_cache_queries
        self.prefix_cache_hits = kv.prefix_cache_hits
        self.num_preemptions = scheduler.num_preemptions
        if self.step_log is not None:
            # The engine keeps one step in flight: this call launched step N and processed N-1's results,
            # so the time now closes N-1, the step the device ran since the previous call.
            if self._step_pending is not None:
                self.step_log.append((time.perf_counter(), *self._step_pending))
            self._step_pending = self._scheduled
        self.schedule_s += schedule_s
        self.execute_s += execute_s
        self.process_s += process_s
        self.last_step_time = time.time()

    @property
    def kv_cache_waste_avg(self) -> float:
        """Allocated-but-unused slots over allocated slots, weighted over every step so far."""
        return self.waste_slots_unused / self.waste_slots_allocated if self.waste_slots_allocated else 0.0


@dataclasses.dataclass
class RequestStats:
    """The API process's side: what clients received."""
    generation_tokens: int = 0                  # tokens received for unfinished samples (vLLM's count)
    finished_by_reason: Counter = dataclasses.field(default_factory=Counter)    # samples, aborts included
    detokenize_s: float = 0.0                   # incremental detokenization and stop strings (host)
    # latency samples since the last drain, kept only when record_latencies is on (the server turns it on
    # and moves them into histograms every few seconds; offline runs keep none, so nothing grows)
    record_latencies: bool = False
    ttft: list = dataclasses.field(default_factory=list)
    itl: list = dataclasses.field(default_factory=list)
    e2e: list = dataclasses.field(default_factory=list)

    def on_finish(self, reason: str, arrival_time: float, now: float) -> None:
        self.finished_by_reason[reason] += 1
        if self.record_latencies:
            self.e2e.append(now - arrival_time)

    def drain_latencies(self) -> tuple[list, list, list]:
        out = (self.ttft, self.itl, self.e2e)
        self.ttft, self.itl, self.e2e = [], [], []
        return out


ZERO_PERF_COUNTER = "zero_perf_counter_s"      # the step log's header key of its time zero


def write_core_step_log(path: str, stats: EngineStats) -> None:
    """The core's step log as CSV: each step's end (seconds from the first arrival), tokens scheduled, requests,
    tokens of context its attention read; and beside it (`-arrivals.csv`) each batch of arrivals (seconds from
    the first, requests). A burst's first steps read against when its requests reached the core. Each file's
    first line is that zero as a perf_counter() reading (CLOCK_MONOTONIC, one clock for every process on the
    host), so a client's own times can be set against the core's."""
    steps = np.array(stats.step_log or [], np.float64).reshape(-1, 4)
    arrivals = np.array(stats.arrival_log or [], np.float64).reshape(-1, 2)
    t0 = arrivals[0, 0] if len(arrivals) else (steps[0, 0] if len(steps) else 0.0)
    steps[:, 0] -= t0
    arrivals[:, 0] -= t0
    zero = f"{ZERO_PERF_COUNTER}={t0:.6f}\n"
    np.savetxt(path, steps, fmt=["%.6f", "%d", "%d", "%d"], delimiter=",",
               header=zero + "end_s,tokens,requests,context_tokens")
    out = pathlib.Path(path)
    np.savetxt(out.with_name(out.stem + "-arrivals.csv"), arrivals, fmt=["%.6f", "%d"], delimiter=",",
               header=zero + "seconds,requests")
