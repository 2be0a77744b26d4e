"""EngineCore: the scheduler, the KV cache and the device. EngineCoreRequests in, EngineCoreOutputs out.

It never tokenizes or detokenizes: the API process (llm_engine.LLMEngine in-process, async_llm.AsyncLLM
through core_client.py's process) does. One `step()`:

    schedule step N -> dispatch it to the device -> fetch and process step N-1's sampled ids

Scheduling N before N-1's tokens are on the host is safe: each request that N-1 samples for holds a
placeholder (scheduler.py), and N reads that token on the device. A request that N-1 finishes has one
wasted token computed in N, then is freed. Batches that need the exact token history on the host
(penalties) run synchronously. Stops that need no text (EOS, stop token ids, max_tokens, max_model_len)
are found here, token by token, so a multi-step program's tokens after one never leave the core; stop
strings are the API process's (it aborts the request here when it finds one).
"""
from __future__ import annotations

import gc
import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from jaxpaged import envs
from jaxpaged.config import EngineArgs, RunConfig, detect_platform, resolve
from jaxpaged.engine.cache_sizing import activation_reserve, block_bytes, size_kv_cache, tree_bytes
from jaxpaged.engine.kv_cache_manager import KVCacheManager
from jaxpaged.engine.model_path import resolve_model_path
from jaxpaged.engine.messages import (CoreInfo, CoreStats, EngineCoreOutput, EngineCoreRequest, FinishReason,
                                      PromptLogprobs, SampleLogprobs)
from jaxpaged.engine.output import ModelRunnerOutput
from jaxpaged.engine.request import Request, RequestStatus
from jaxpaged.engine.scheduler import Scheduler, SchedulerConfig
from jaxpaged.engine.stats import EngineStats

if TYPE_CHECKING:
    from jaxpaged.runner.model_runner import InFlight

logger = logging.getLogger("jaxpaged.engine")

# How often core_stats() asks the device for its memory in use: a runtime call, kept off most steps' host time.
DEVICE_MEMORY_PERIOD_S = 1.0

_FINISH = {RequestStatus.FINISHED_STOPPED: FinishReason.STOP, RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
           RequestStatus.FINISHED_ABORTED: FinishReason.ABORT}


def _configure_jax() -> None:
    import jax
    if envs.JAXPAGED_COMPILE_CACHE:
        jax.config.update("jax_compilation_cache_dir", str(envs.JAXPAGED_XLA_CACHE_PATH))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    if envs.JAXPAGED_LOG_COMPILES:
        jax.config.update("jax_log_compiles", True)


class EngineCore:
    def __init__(self, args: EngineArgs):
        from jaxpaged.models import load_model
        from jaxpaged.models.loader import layer_bytes, model_config, resolve_dtype

        self.args = args
        _configure_jax()
        t0 = time.perf_counter()
        platform = detect_platform()
        self.model_path = resolve_model_path(args.model, args.quantization)
        # The program is chosen from the model's shapes, then the weights load in the layout it runs on.
        cfg = model_config(self.model_path, args.quantization, args.kv_cache_dtype)
        self.run = run = resolve(args, platform, layer_bytes=layer_bytes(cfg, resolve_dtype(args.dtype, cfg,
                                                                                            platform.name)),
                                 max_position_embeddings=cfg.max_position_embeddings,
                                 compile_cache=envs.JAXPAGED_COMPILE_CACHE)
        logger.info("Run config: %s", run.summary())
        loaded = load_model(self.model_path, args.dtype, args.load_format, args.seed, platform=platform.name,
                            per_layer=run.layer_dispatch in ("per_layer", "unrolled"),
                            quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
        if args.calculate_kv_scales:
            loaded = self._calibrate_kv_scales(loaded, run.max_model_len)
        self.model_config = cfg = loaded.config
        self.dtype = np.dtype(loaded.dtype).name
        self.max_model_len, self.max_num_batched_tokens = run.max_model_len, run.max_num_batched_tokens
        self.max_num_seqs, self.num_scheduler_steps = run.max_num_seqs, run.num_scheduler_steps
        weights_gib = tree_bytes(loaded.params) / 2**30
        self._build_cache_and_scheduler(loaded, run)
        self.stats = EngineStats()
        self._inflight: InFlight | None = None    # the launched step whose results are not processed yet
        self._device_memory = (0, -DEVICE_MEMORY_PERIOD_S)   # (bytes in use, time.monotonic() of the reading)
        logger.info("Model %s (%s, %s) loaded: %.2f GiB of weights", self.model_path, cfg.architecture,
                    self.dtype, weights_gib)
        if run.compile_buckets:
            secs = self.runner.warmup(self.buckets.all_buckets(), num_steps=run.num_scheduler_steps)
            cache = self.runner.exec_cache
            logger.info("Compiled %d buckets in %.1f s%s", len(self.buckets.all_buckets()), secs,
                        f" ({cache.hits} loaded from {cache.dir}, {cache.load_s:.1f} s of it reading them)"
                        if cache is not None and cache.hits else "")
            self._check_reserve()
        # As vLLM after start-up: what exists now (weights' host objects, JAX's caches) lives as long as
        # the engine, so it leaves the collector's generations, and a full collection then walks only the
        # requests' objects.
        gc.collect()
        gc.freeze()
        self.startup_seconds = time.perf_counter() - t0

    def _calibrate_kv_scales(self, loaded, max_model_len: int):
        """--calculate-kv-scales: the e4m3 pool's per-layer scales from one calibration prompt
        (models/kv_calibration.py), before any program is built."""
        from jaxpaged.engine.tokenizer import load_tokenizer
        from jaxpaged.models.kv_calibration import CALIBRATION_TEXT, calibrated_params, kv_amax
        ids = load_tokenizer(self.args.tokenizer or self.model_path).encode(CALIBRATION_TEXT)[:max_model_len]
        amax = kv_amax(loaded.config, loaded.dtype, loaded.params, ids, self.args.block_size)
        params = calibrated_params(loaded.params, amax)
        logger.info("KV cache scales from a calibration prompt of %d tokens: largest |k| %.3g-%.3g, |v| %.3g-%.3g "
                    "across layers", len(ids), amax[:, 0].min(), amax[:, 0].max(), amax[:, 1].min(), amax[:, 1].max())
        return loaded._replace(params=params)

    def _build_cache_and_scheduler(self, loaded, run: RunConfig) -> None:
        """Size the KV pool from the memory left after the weights, then the runner, manager, scheduler."""
        from jaxpaged.runner.buckets import BucketPolicy
        from jaxpaged.runner.model_runner import ModelRunner
        from jaxpaged.models import kv_cache_dtype
        from jaxpaged.pallas_kernels import cache_values_dtype
        args, cfg = self.args, loaded.config
        pool_dtype = kv_cache_dtype(cfg, loaded.dtype, run.platform)
        per_block = block_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, args.block_size, pool_dtype)
        self.activation_reserve = activations = activation_reserve(cfg, run.max_num_batched_tokens,
                                                                   run.max_num_seqs, loaded.dtype)
        size = size_kv_cache(per_block, tree_bytes(loaded.params), activations, args.gpu_memory_utilization,
                             args.num_gpu_blocks_override, np.dtype(pool_dtype).itemsize)
        num_cpu_blocks = int(args.swap_space * 2**30 // per_block) if args.preemption_mode == "swap" else 0
        self.num_blocks, self.block_size = size.num_blocks, args.block_size
        self.buckets = BucketPolicy(run.max_num_batched_tokens, run.max_num_seqs)
        exec_root = str(envs.JAXPAGED_CACHE_ROOT / "executables") if run.executable_cache else None
        self.runner = ModelRunner(loaded, run, size.num_blocks, args.block_size, self.buckets, num_cpu_blocks,
                                  exec_root)
        # a window on every layer frees the blocks behind it (layers of both kinds keep every block)
        window = cfg.sliding_window if cfg.layer_types is None else None
        self.kv_manager = KVCacheManager(size.num_blocks, args.block_size, args.enable_prefix_caching,
                                         num_cpu_blocks, sliding_window=window)
        self.scheduler = Scheduler(SchedulerConfig(run.max_num_seqs, run.max_num_batched_tokens,
                                                   run.max_model_len, args.enable_chunked_prefill,
                                                   args.scheduling_policy, args.preemption_mode or "recompute",
                                                   run.num_scheduler_steps),
                                   self.kv_manager)
        self.kv_cache_tokens = tokens = (size.num_blocks - 1) * args.block_size
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB, %s), %d tokens of context; maximum concurrency "
                    "for %d tokens per request: %.2fx", size.num_blocks - 1, args.block_size,
                    size.num_blocks * per_block / 2**30, cache_values_dtype(pool_dtype).name, tokens, run.max_model_len,
                    tokens / run.max_model_len)
        if tokens < run.max_model_len:      # vLLM refuses to start here; this engine refuses such requests
            logger.warning("The KV cache holds %d tokens, fewer than max_model_len=%d: a request needing more "
                           "(prompt + max_tokens - 1) is refused on arrival", tokens, run.max_model_len)

    def _check_reserve(self) -> None:
        """A compiled program whose temporaries exceed the memory the pool left for them (activation_reserve) ran
        at warm-up only by the allocator's slack, and may not when it runs beside another's buffers: said
        at start-up, with what to lower."""
        if self.run.platform != "gpu" or self.args.num_gpu_blocks_override is not None:
            return          # (the CPU's pool has a fixed budget; an override sizes the pool itself)
        largest = self.runner.programs.largest_temporaries(1)
        if largest and largest[0][1] > self.activation_reserve:
            logger.warning("The step of %s takes %.2f GiB of temporaries, more than the %.2f GiB the KV pool left "
                           "for them: lower --gpu-memory-utilization or --max-num-batched-tokens if it runs out of "
                           "memory", largest[0][0], largest[0][1] / 2**30, self.activation_reserve / 2**30)

    def info(self) -> CoreInfo:
        cfg = self.model_config
        return CoreInfo(self.model_path, cfg.architecture, self.dtype, cfg.vocab_size, tuple(cfg.eos_token_ids),
                        self.max_model_len, self.max_num_seqs, self.args.max_logprobs, self.block_size,
                        self.num_blocks, self.num_scheduler_steps, self.run.summary(), self.startup_seconds,
                        self.kv_window_slots())

    def kv_window_slots(self) -> int | None:
        """Sliding window: a step's first token attends back window - 1 positions and the step computes up to
        max_num_batched_tokens, so a request holds at most window + that + two partial blocks of slots."""
        window = self.kv_manager.sliding_window
        if window is None:
            return None
        return window + self.run.max_num_batched_tokens + 2 * self.block_size

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, r: EngineCoreRequest) -> None:
        if r.request_id in self.scheduler.requests:
            raise ValueError(f"request id {r.request_id!r} is already in use")
        self.scheduler.add_request(Request(r.request_id, r.prompt_token_ids, r.sampling_params, r.eos_token_ids,
                                           r.arrival_time, r.priority, None, self.block_size,
                                           r.sample_seed & 0xFFFFFFFF))
        self.stats.on_arrival(1)

    def abort_requests(self, request_ids) -> None:
        requests = self.scheduler.requests
        for rid in request_ids:
            req = requests.get(rid)
            if req is not None:
                self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def core_stats(self) -> CoreStats:
        """The gauges now (read live: an abort moves them between steps; device memory at most once per
        DEVICE_MEMORY_PERIOD_S) and the counters."""
        s, kv, sched = self.stats, self.kv_manager, self.scheduler
        now = time.monotonic()
        if now - self._device_memory[1] >= DEVICE_MEMORY_PERIOD_S:
            self._device_memory = (self.runner.device_memory_in_use(), now)
        return CoreStats(sched.num_running, sched.num_waiting, kv.pool.usage, s.kv_cache_waste,
                         kv.pool.num_free_blocks, kv.prefix_cache_queries, kv.prefix_cache_hits,
                         sched.num_preemptions, s.prompt_tokens, s.generation_tokens, s.num_steps,
                         self._device_memory[0])

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Schedule and launch step N, then process step N-1's results while N runs on the device."""
        t0 = time.perf_counter()
        outputs: list[EngineCoreOutput] = []
        if self._inflight is not None and self._needs_sync():
            outputs += self._finish_inflight()
        t1 = time.perf_counter()
        sched = self.scheduler.schedule()
        self.stats.on_schedule(sched, self.scheduler.requests)
        t2 = time.perf_counter()
        if sched.is_empty:
            # Nothing to launch, but the requests this schedule reports finished or preempted (an abort of every
            # running request) must still leave the runner's batch, as a dispatch's hand-off would take them.
            self.runner.release_finished(sched.dropped_req_ids)
            new = None
        else:
            new = self.runner.dispatch(sched)
        t3 = time.perf_counter()
        try:
            outputs += self._finish_inflight()
        finally:
            self._inflight = new
        if new is not None:
            self.stats.prepare_inputs_s += new.prepared.prepare_s
            self.stats.launch_s += new.launch_s
        if self._inflight is None and not self.scheduler.has_unfinished():
            self.release_finished()
        t4 = time.perf_counter()
        self.stats.on_step(self.scheduler, self.kv_manager, schedule_s=t2 - t1, execute_s=t3 - t2,
                           process_s=(t1 - t0) + (t4 - t3))
        return outputs

    def release_finished(self) -> None:
        """The engine is idle: no next step will pass the requests finished since the last one to the runner, so
        it drops them now."""
        self.runner.release_finished(self.scheduler.finished_req_ids)
        self.scheduler.finished_req_ids = set()

    def _needs_sync(self) -> bool:
        return any(r.needs_host_history for r in self.scheduler.running)

    def _finish_inflight(self) -> list[EngineCoreOutput]:
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return []
        t0 = time.perf_counter()
        result = self.runner.fetch(inflight)
        self.stats.wait_s += time.perf_counter() - t0
        return self._process(result, inflight.prepared.sched.num_steps)

    def _process(self, result: ModelRunnerOutput, steps: int) -> list[EngineCoreOutput]:
        """Append step N-1's sampled tokens and check the stops that need no text.

        Per request and token this is the core's hottest host loop (1000+ running requests): a multi-step
        row's tokens after a stop are dropped here, so nothing past a stop leaves the core.
        """
        requests, settle, check_stop = self.scheduler.requests, self.scheduler.settle, self.scheduler.check_stop
        prompt_lps = self._prompt_logprobs(result) if result.prompt_logprobs else {}
        outputs = []
        finished = []
        num_tokens = num_prompt_tokens = 0
        for rid, tokens in result.sampled_token_ids.items():
            req = requests.get(rid)
            if req is None:
                continue      # finished (or aborted) while this step was in flight: wasted tokens
            settle(req, steps)
            first = req.num_output_tokens == 0
            status = None
            n = 0
            for token in tokens:
                req.append_output_token(token)
                n += 1
                status = check_stop(req)
                if status is not None:
                    break
            num_tokens += n
            out = EngineCoreOutput(rid, tokens if n == len(tokens) else tokens[:n])
            if first:
                # vLLM's prompt_tokens: a request's whole prompt (cached tokens too) at its first token,
                # once (recomputing it after a preemption is not counted again)
                num_prompt_tokens += req.num_prompt_tokens
                if req.num_cached_tokens > 0:
                    out.num_cached_tokens = req.num_cached_tokens
            if req.sampling_params.logprobs is not None:     # single steps only (Request.multi_step_ok)
                out.new_logprobs = self._sample_logprobs(result, result.rows[rid], req.sampling_params.logprobs)
            if rid in prompt_lps:
                out.new_prompt_logprobs = prompt_lps.pop(rid)
            if status is not None:
                out.finish_reason = _FINISH[status]
                if isinstance(req.stop_reason, int):
                    out.stop_reason = req.stop_reason
                finished.append((req, status))
            outputs.append(out)
        for rid, chunk in prompt_lps.items():      # prompt chunks that sampled nothing yet
            if rid in requests:
                outputs.append(EngineCoreOutput(rid, [], new_prompt_logprobs=chunk))
        self.stats.generation_tokens += num_tokens
        self.stats.prompt_tokens += num_prompt_tokens
        for req, status in finished:
            self.scheduler.finish_request(req, status)
        return outputs

    @staticmethod
    def _sample_logprobs(result: ModelRunnerOutput, row: int, k: int) -> SampleLogprobs:
        lp = result.logprobs
        assert lp is not None, "a request that asked for logprobs got none"
        return SampleLogprobs([float(lp.logprobs[row])], [int(lp.ranks[row])], [lp.top_ids[row][:k].tolist()],
                              [lp.top_logprobs[row][:k].tolist()])

    def _prompt_logprobs(self, result: ModelRunnerOutput) -> dict[str, PromptLogprobs]:
        requests = self.scheduler.requests
        out = {}
        for rid, chunk in result.prompt_logprobs.items():
            req = requests.get(rid)
            if req is None or req.is_finished:
                continue
            k = req.sampling_params.prompt_logprobs
            out[rid] = PromptLogprobs(chunk.first_index, chunk.logprobs.tolist(), chunk.ranks.tolist(),
                                      chunk.top_ids[:, :k].tolist(), chunk.top_logprobs[:, :k].tolist())
        return out
