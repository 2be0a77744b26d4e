"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time (synchronous core; AsyncLLM runs it
on its own thread)."""
from __future__ import annotations

import gc
import logging
import time
from typing import TYPE_CHECKING, cast

import numpy as np

from jaxpaged import envs
from jaxpaged.config import EngineArgs, RunConfig, detect_platform, resolve
from jaxpaged.engine.cache_sizing import block_bytes, size_kv_cache, tree_bytes
from jaxpaged.engine.detokenizer import IncrementalDetokenizer, prepare as prepare_detokenizer
from jaxpaged.engine.kv_cache_manager import KVCacheManager, cdiv
from jaxpaged.engine.output import ModelRunnerOutput
from jaxpaged.engine.output_processor import OutputProcessor
from jaxpaged.engine.request import Request, RequestStatus
from jaxpaged.engine.scheduler import Scheduler, SchedulerConfig
from jaxpaged.engine.stats import EngineStats
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxpaged.runner.model_runner import InFlight

logger = logging.getLogger("jaxpaged.engine")

PromptType = str | list[int] | dict


def resolve_model_path(model: str | None) -> str:
    if model is None:
        from jaxpaged.models.gguf_convert import default_model_dir
        return str(default_model_dir(envs.JAXPAGED_CACHE_ROOT / "models"))
    return model


def _configure_jax() -> None:
    import jax
    if envs.JAXPAGED_COMPILE_CACHE:
        jax.config.update("jax_compilation_cache_dir", str(envs.JAXPAGED_CACHE_ROOT / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    if envs.JAXPAGED_LOG_COMPILES:
        jax.config.update("jax_log_compiles", True)


class LLMEngine:
    def __init__(self, args: EngineArgs):
        from transformers import AutoTokenizer

        from jaxpaged.models import load_model
        from jaxpaged.runner.layerwise import layer_bytes

        self.args = args
        _configure_jax()
        t0 = time.perf_counter()
        platform = detect_platform()
        self.model_path = resolve_model_path(args.model)
        loaded = load_model(self.model_path, args.dtype, args.load_format, args.seed, platform=platform.name)
        self.model_config = cfg = loaded.config
        self.run = run = resolve(args, platform, layer_bytes=layer_bytes(loaded.params),
                                 max_position_embeddings=cfg.max_position_embeddings,
                                 compile_cache=envs.JAXPAGED_COMPILE_CACHE)
        logger.info("Run config: %s", run.summary())
        self.max_model_len, self.max_num_batched_tokens = run.max_model_len, run.max_num_batched_tokens
        self.max_num_seqs, self.num_scheduler_steps = run.max_num_seqs, run.num_scheduler_steps
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or self.model_path)
        tok_eos = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        self.eos_token_ids = tuple(sorted(set(cfg.eos_token_ids) | tok_eos))
        weights_gib = tree_bytes(loaded.params) / 2**30
        self._build_cache_and_scheduler(loaded, run)
        self.output_processor = OutputProcessor(self.tokenizer)
        prepare_detokenizer(self.tokenizer)
        self.stats = EngineStats()
        self._inflight: InFlight | None = None    # the launched step whose results are not processed yet
        self._rng = np.random.default_rng(args.seed)
        logger.info("Model %s (%s, %s) loaded: %.2f GiB of weights", self.model_path, cfg.architecture,
                    np.dtype(loaded.dtype).name, weights_gib)
        if run.compile_buckets:
            secs = self.runner.warmup(self.buckets.all_buckets(), num_steps=run.num_scheduler_steps)
            cache = self.runner.exec_cache
            logger.info("Compiled %d buckets in %.1f s%s", len(self.buckets.all_buckets()), secs,
                        f" ({cache.hits} loaded from {cache.dir}, {cache.load_s:.1f} s of it reading them)"
                        if cache is not None and cache.hits else "")
        # As vLLM after start-up: what exists now (weights' host objects, the tokenizer and its byte table,
        # JAX's caches) lives as long as the engine, so it leaves the collector's generations, and a full
        # collection then walks only the requests' objects.
        gc.collect()
        gc.freeze()
        self.startup_seconds = time.perf_counter() - t0

    def _build_cache_and_scheduler(self, loaded, run: RunConfig) -> None:
        """Size the KV pool from the memory left after the weights, then the runner, manager, scheduler."""
        from jaxpaged.runner.buckets import BucketPolicy
        from jaxpaged.runner.model_runner import ModelRunner
        args, cfg = self.args, loaded.config
        per_block = block_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, args.block_size, loaded.dtype)
        activations = self._activation_estimate(cfg, run.max_num_batched_tokens, run.max_num_seqs)
        size = size_kv_cache(per_block, tree_bytes(loaded.params), activations, args.gpu_memory_utilization,
                             args.num_gpu_blocks_override)
        num_cpu_blocks = int(args.swap_space * 2**30 // per_block) if args.preemption_mode == "swap" else 0
        self.num_blocks, self.block_size = size.num_blocks, args.block_size
        self.buckets = BucketPolicy(run.max_num_batched_tokens, run.max_num_seqs)
        exec_root = str(envs.JAXPAGED_CACHE_ROOT / "executables") if run.executable_cache else None
        self.runner = ModelRunner(loaded, run, size.num_blocks, args.block_size, self.buckets, num_cpu_blocks,
                                  exec_root)
        self.kv_manager = KVCacheManager(size.num_blocks, args.block_size, args.enable_prefix_caching,
                                         num_cpu_blocks)
        self.scheduler = Scheduler(SchedulerConfig(run.max_num_seqs, run.max_num_batched_tokens,
                                                   run.max_model_len, args.enable_chunked_prefill,
                                                   args.scheduling_policy, args.preemption_mode or "recompute",
                                                   run.num_scheduler_steps),
                                   self.kv_manager)
        self.kv_cache_tokens = tokens = (size.num_blocks - 1) * args.block_size
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB), %d tokens of context; maximum concurrency "
                    "for %d tokens per request: %.2fx", size.num_blocks - 1, args.block_size,
                    size.num_blocks * per_block / 2**30, tokens, run.max_model_len, tokens / run.max_model_len)

    @staticmethod
    def _activation_estimate(cfg, max_tokens: int, max_seqs: int) -> int:
        """Peak of the step's temporaries: the sampled rows' logits, one chunk of every-token logits (prompt
        logprobs, models/decoder.py PROMPT_HEAD_CHUNK), the widest MLP activations, slack for XLA."""
        from jaxpaged.models.decoder import PROMPT_HEAD_CHUNK
        logits = (max_seqs + min(max_tokens, PROMPT_HEAD_CHUNK)) * cfg.vocab_size * 4 * 3
        mlp = max_tokens * cfg.intermediate_size * 4 * 3
        return logits + mlp + (256 << 20)

    # ---- requests -----------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            return None, [int(t) for t in prompt]
        raise ValueError("a prompt must be a string, a list of token ids, or a dict with 'prompt' or "
                         "'prompt_token_ids'")

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("The prompt cannot be empty.")
        n = len(token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                             f"you requested {n + (params.max_tokens or 0)} tokens ({n} in the messages, "
                             f"{params.max_tokens or 0} in the completion). Please reduce the length of "
                             "the messages or completion.")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                             f"you requested {n + params.max_tokens} tokens ({n} in the messages, "
                             f"{params.max_tokens} in the completion). Please reduce the length of the "
                             "messages or completion.")
        # Refuse what could never run, rather than admit it to preempt itself forever: the whole
        # sequence (prompt + every token it may generate) must fit in the pool on its own.
        total = min(n + (params.max_tokens or self.max_model_len), self.max_model_len)
        if cdiv(total, self.block_size) > self.num_blocks - 1:
            raise ValueError(f"This request needs up to {total} tokens of context ({n} in the prompt), which "
                             f"needs more KV cache blocks than the pool holds ({self.num_blocks - 1} blocks of "
                             f"{self.block_size} tokens). Lower max_tokens, or raise gpu_memory_utilization.")
        for name, k in (("sample", params.logprobs), ("prompt", params.prompt_logprobs)):
            if k is not None and k > self.args.max_logprobs:
                raise ValueError(f"Requested {name} logprobs of {k}, which is greater than max allowed: "
                                 f"{self.args.max_logprobs}")
        vocab = self.model_config.vocab_size
        ids = np.asarray(token_ids)
        bad = ids[(ids < 0) | (ids >= vocab)]       # one vectorised pass, not a Python loop per token
        if bad.size:
            raise ValueError(f"Token id {int(bad[0])} is out of vocabulary (vocab size {vocab}).")
        bad = [t for t in (params.logit_bias or {}) if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token_id(s) {bad} in logit_bias contain out-of-vocab token ids (vocab size {vocab}).")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> list[str]:
        """Validate, tokenize and queue a request (n > 1 becomes n child requests sharing the prompt's
        blocks through the prefix cache). Raises ValueError for a request that could never run."""
        params = params or SamplingParams()
        text, token_ids = self.tokenize_prompt(prompt)
        self.validate_prompt(token_ids, params)
        return self.add_validated_request(request_id, text, token_ids, params, arrival_time, priority)

    def add_validated_request(self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams,
                              arrival_time: float | None = None, priority: int = 0) -> list[str]:
        """add_request for a prompt that tokenize_prompt and validate_prompt have already seen (LLM.generate
        checks a whole batch before it queues any), so it is not checked twice."""
        if request_id in self.output_processor.parents or request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        children = []
        for i in range(params.n):
            child_params = params.clone(n=1, best_of=None,
                                        seed=None if params.seed is None else params.seed + i)
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            seed = child_params.seed if child_params.seed is not None else int(self._rng.integers(0, 2**31))
            req = Request(child_id, token_ids, child_params, self.eos_token_ids, arrival_time, priority,
                          text, self.block_size, seed & 0xFFFFFFFF)
            children.append(req)
        self.output_processor.add(request_id, text, token_ids, params, children,
                                  [IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens,
                                                          cast(list[str], params.stop),  # a list after __post_init__
                                                          params.include_stop_str_in_output)
                                   for _ in children])
        for req in children:
            self.scheduler.add_request(req)
        self.stats.on_arrival(len(children))
        return [r.request_id for r in children]

    def abort_request(self, request_ids) -> None:
        for rid in ([request_ids] if isinstance(request_ids, str) else request_ids):
            for child in self.output_processor.children_of(rid):
                self.scheduler.finish_request(child, RequestStatus.FINISHED_ABORTED)
                self.stats.on_finish(child)
            self.output_processor.drop(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_running + self.scheduler.num_waiting

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch step N, then process step N-1's results while N runs on the device.

        Scheduling N before N-1's tokens are on the host is safe: each request that N-1 samples for
        holds a placeholder (scheduler.py), and N reads that token on the device. A request that N-1
        finishes has one wasted token computed in N, then is freed. Batches that need the exact token
        history on the host (penalties) run synchronously.
        """
        t0 = time.perf_counter()
        outputs: list[RequestOutput] = []
        if self._inflight is not None and self._needs_sync():
            outputs += self._finish_inflight()
        t1 = time.perf_counter()
        sched = self.scheduler.schedule()
        self.stats.on_schedule(sched, self.scheduler.requests)
        t2 = time.perf_counter()
        new = None if sched.is_empty else self.runner.dispatch(sched)
        t3 = time.perf_counter()
        try:
            outputs += self._finish_inflight()
        finally:
            self._inflight = new
        if new is not None:
            self.stats.prepare_inputs_s += new.prepared.prepare_s
            self.stats.launch_s += new.launch_s
        if self._inflight is None and not self.scheduler.has_unfinished():
            # idle: no next step will pass these ids to the runner, so release them now
            self.runner.release_finished(self.scheduler.finished_req_ids)
            self.scheduler.finished_req_ids = set()
        t4 = time.perf_counter()
        self.stats.on_step(self.scheduler, self.kv_manager, schedule_s=t2 - t1, execute_s=t3 - t2,
                           process_s=(t1 - t0) + (t4 - t3))
        return outputs

    def _needs_sync(self) -> bool:
        return any(r.needs_host_history for r in self.scheduler.running)

    def _finish_inflight(self) -> list[RequestOutput]:
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return []
        t0 = time.perf_counter()
        result = self.runner.fetch(inflight)
        self.stats.wait_s += time.perf_counter() - t0
        return self._process(result, inflight.prepared.sched.num_steps)

    def _record_prompt_logprobs(self, result: ModelRunnerOutput) -> None:
        """Append this step's prompt logprobs: token p's logits score prompt token p + 1."""
        requests = self.scheduler.requests
        for rid, chunk in result.prompt_logprobs.items():
            req = requests.get(rid)
            if req is None or req.is_finished:
                continue
            k = req.sampling_params.prompt_logprobs
            if chunk.first_index == 1:
                req.prompt_logprobs = [None]        # the first prompt token has no logprob
            for j in range(chunk.num_tokens):
                token = req.prompt_token_ids[chunk.first_index + j]
                req.prompt_logprobs.append(self.output_processor.logprob_entry(
                    token, float(chunk.logprobs[j]), int(chunk.ranks[j]), chunk.top_ids[j][:k],
                    chunk.top_logprobs[j][:k]))

    def _process(self, result: ModelRunnerOutput, steps: int) -> list[RequestOutput]:
        """Append step N-1's sampled tokens, check stops, detokenize, and build outputs.

        Per request and token this is the hottest host loop (1000+ running requests): what can be
        decided once per request (does anyone read its text or outputs before it finishes?) was, at
        arrival (Request.streams / .deferred_text, from its sampling params), and the stats calls are
        skipped when they record nothing.
        """
        now = time.time()
        touched = []
        if result.prompt_logprobs:
            self._record_prompt_logprobs(result)
        requests, settle = self.scheduler.requests, self.scheduler.settle
        stats, check_stop, detokenize = self.stats, self.scheduler.check_stop, self.output_processor.detokenize
        record = stats.record_latencies
        finished = []
        t_detok = 0.0
        num_tokens = 0
        for rid, tokens in result.sampled_token_ids.items():
            req = requests.get(rid)
            if req is None:
                continue      # finished (or aborted) while this step was in flight: wasted tokens
            settle(req, steps)
            status = None
            for token in tokens:       # after a stop, a multi-step row's later tokens are dropped
                req.append_output_token(token)
                num_tokens += 1
                if req.first_token_time is None:
                    req.first_token_time = now
                    if record:
                        stats.on_first_token(req, now)
                elif record:
                    stats.on_token(req, now)
                if req.sampling_params.logprobs is not None:     # single steps only (Request.multi_step_ok)
                    self.output_processor.record_logprobs(req, token, result.logprobs, result.rows[rid])
                status = check_stop(req)
                if not req.deferred_text:
                    t0 = time.perf_counter()
                    stop = detokenize(req)
                    t_detok += time.perf_counter() - t0
                    if stop is not None and status is None:
                        status = RequestStatus.FINISHED_STOPPED
                        req.stop_reason = stop
                if status is not None:
                    break
            req.last_token_time = now
            if status is not None:
                finished.append((req, status))
                touched.append(req)
            elif req.streams:
                touched.append(req)
        stats.generation_tokens += num_tokens
        stats.detokenize_s += t_detok
        for req, status in finished:
            self.scheduler.finish_request(req, status)
            stats.on_finish(req)
        return self.output_processor.make_outputs(touched)
