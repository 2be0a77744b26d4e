"""ModelRunner: execute(SchedulerOutput) -> ModelRunnerOutput.

It keeps its own per-request state (InputBatch, keyed by request id) from the scheduler's plain-data
hand-off, turns each step into padded inputs (inputs.py), launches the one jitted step (step.py) without
waiting, and fetches the sampled ids with one device_get, appending them to its own token lists.
"""
from __future__ import annotations

import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.config import RunConfig
from jaxpaged.engine.output import (LogprobsArrays, ModelRunnerOutput, PromptLogprobsChunk, SchedulerOutput)
from jaxpaged.models import LoadedModel, kv_cache_dtype, kv_cache_shape
from jaxpaged.runner.buckets import Bucket, BucketPolicy, _round_up_pow2
from jaxpaged.runner.input_batch import InputBatch
from jaxpaged.runner.inputs import PreparedInputs, PromptRows, prepare_inputs
from jaxpaged.runner.sampler import SamplerFlags
from jaxpaged.runner.step import StepPrograms


class PreparedStep(NamedTuple):
    """The host half of a step: its inputs, ready to launch."""
    sched: SchedulerOutput
    inputs: PreparedInputs
    req_ids: list[str]            # batch order
    sampled_rows: dict[str, int]  # request id -> row of its sample, for the requests that sample
    token_lists: list[list[int]]  # the sampling requests' token lists (InputBatch), in sampled_rows order
    prepare_s: float              # host time building the padded inputs


class InFlight(NamedTuple):
    """A launched step whose results have not been fetched."""
    prepared: PreparedStep
    result: tuple                 # device arrays from sample(), (+ prompt logprobs)
    launch_s: float               # host time packing the inputs and launching the step


class ModelRunner:
    def __init__(self, model: LoadedModel, run: RunConfig, num_blocks: int, block_size: int,
                 buckets: BucketPolicy, num_cpu_blocks: int = 0, exec_cache_root: str | None = None):
        self.cfg, self.dtype, self.run = model.config, model.dtype, run
        self.block_size, self.num_blocks = block_size, num_blocks
        self.max_blocks_per_req = -(-run.max_model_len // block_size)
        self.buckets = buckets
        self.max_rows = buckets.max_rows
        self._pool_shape = kv_cache_shape(self.cfg, num_blocks, block_size)
        self.pool_dtype = kv_cache_dtype(self.cfg, self.dtype, run.platform)
        self.programs = StepPrograms(model.params, self.cfg, self.dtype, run, self._pool_shape,
                                     self.max_blocks_per_req, self.max_rows, exec_cache_root)
        # The pool and the sampled-token buffer are made committed to the device, as the step's outputs that
        # replace them are: else the first bucket compiled at warm-up (uncommitted arguments) would not be
        # the program later steps look up, and would compile again.
        self._device = jax.devices()[0]
        self.reset_buffers()
        # Host memory for swapped-out blocks: [L, 2, num_cpu_blocks, K, S, D].
        self.cpu_cache = (np.zeros(kv_cache_shape(self.cfg, num_cpu_blocks, block_size), jnp.dtype(self.pool_dtype))
                          if num_cpu_blocks else None)
        self.batch = InputBatch(self.max_blocks_per_req)
        self.prev_rows: dict[str, int] = {}      # rows of the last launched step's samples
        self.compiled_keys: set = set()          # (bucket, sampler flags, decode steps) run so far

    @property
    def exec_cache(self):
        return self.programs.exec_cache

    def reset_buffers(self) -> None:
        """A zeroed KV pool and sampled-token buffer on the device."""
        self.kv_cache = jnp.zeros(self._pool_shape, self.pool_dtype, device=self._device)
        self.prev_sampled = jnp.zeros((self.max_rows,), jnp.int32, device=self._device)   # donated to each step

    # ---- one step -----------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.fetch(self.dispatch(sched))

    def dispatch(self, sched: SchedulerOutput) -> InFlight:
        """Prepare and launch one step without waiting for it (JAX dispatch is asynchronous)."""
        return self.launch(self.prepare(sched))

    def prepare(self, sched: SchedulerOutput) -> PreparedStep:
        """The host half: update the per-request state from the hand-off, then build the padded inputs."""
        t0 = time.perf_counter()
        batch = self.batch
        batch.apply(sched)
        self._apply_block_moves(sched)
        req_ids = sched.req_ids
        rows = batch.rows_of(req_ids)
        inputs = prepare_inputs(batch, sched, req_ids, rows, self.buckets, self.prev_rows, self.block_size,
                                self.cfg.vocab_size)
        sampling = sched.sampling_ids
        if len(sampling) == len(req_ids):      # every request samples a token (decode steps)
            sampled_rows = dict(zip(req_ids, range(len(req_ids))))
        else:
            sampled_rows = {rid: i for i, rid in enumerate(req_ids) if rid in sampling}
            rows = rows[list(sampled_rows.values())]
        batch.num_sampled[rows] += sched.num_steps
        token_lists = list(map(batch.token_ids.__getitem__, rows.tolist()))
        self.compiled_keys.add((inputs.bucket, inputs.flags, sched.num_steps))
        return PreparedStep(sched, inputs, req_ids, sampled_rows, token_lists, time.perf_counter() - t0)

    def launch(self, prepared: PreparedStep) -> InFlight:
        """The device half: pack and launch the step."""
        t0 = time.perf_counter()
        inputs = prepared.inputs
        options = self.programs.options(inputs.bucket, prepared.sched.num_steps)
        self.kv_cache, self.prev_sampled, result = self.programs(
            self.kv_cache, self.prev_sampled, inputs.model_input, inputs.sampling, options=options,
            flags=inputs.flags, bucket=inputs.bucket)
        self.prev_rows = prepared.sampled_rows
        return InFlight(prepared, result, time.perf_counter() - t0)

    def fetch(self, inflight: InFlight) -> ModelRunnerOutput:
        """Block on a launched step's results (one device_get); append the sampled tokens to the requests'
        own token lists (a request removed meanwhile keeps its old list: nothing else sees it)."""
        ids, lp, rank, top_ids, top_lp, prompt = jax.device_get(inflight.result)
        # a multi-step batch run one step at a time (step.StepPrograms) hands back each step's arrays: stacked
        # here, as a multi-step program's leading steps axis
        ids, lp, rank, top_ids, top_lp = map(np.asarray, (ids, lp, rank, top_ids, top_lp))
        prepared = inflight.prepared
        steps = prepared.sched.num_steps
        # [R][steps]: each row's tokens in order; one conversion, not one numpy scalar per token
        per_row = ids.reshape(steps, -1).T.tolist()
        sampled = {rid: per_row[row] for rid, row in prepared.sampled_rows.items()}
        for tokens, new in zip(prepared.token_lists, sampled.values()):
            tokens.extend(new)
        flags = prepared.inputs.flags
        logprobs = LogprobsArrays(lp, rank, top_ids, top_lp) if flags.num_logprobs >= 0 else None
        return ModelRunnerOutput(prepared.req_ids, sampled, logprobs,
                                 _prompt_chunks(prompt, prepared.inputs.prompt_rows), prepared.sampled_rows)

    def device_memory_in_use(self) -> int:
        """Bytes the device's allocator holds now (XLA's `bytes_in_use`: the pool, the weights, the live
        temporaries); 0 where the backend keeps no count (the CPU)."""
        stats = self._device.memory_stats()
        return int(stats.get("bytes_in_use", 0)) if stats else 0

    def release_finished(self, req_ids) -> None:
        """Drop the state of finished requests now (the engine calls this when it goes idle; otherwise the
        next step's finished_req_ids do it)."""
        self.batch.remove(req_ids)

    # ---- warm-up ------------------------------------------------------------------------------
    def warmup(self, buckets: list[Bucket], progress: bool = True, num_steps: int = 1) -> float:
        """Compile the step for every bucket (default sampler variant) before serving; with num_steps > 1
        (multi-step scheduling) also each decode bucket's multi-step program."""
        t0 = time.perf_counter()
        variants = [(b, 1) for b in buckets] + [(b, num_steps) for b in buckets if b.decode_only and num_steps > 1]
        self.programs.warmup(self, variants, progress)
        self.compiled_keys.update((b, SamplerFlags(), steps) for b, steps in variants)
        return time.perf_counter() - t0

    # ---- block moves --------------------------------------------------------------------------
    def _apply_block_moves(self, sched: SchedulerOutput) -> None:
        if sched.blocks_to_swap_out or sched.blocks_to_swap_in:
            cpu = self.cpu_cache
            assert cpu is not None, "swapping needs host blocks (preemption_mode='swap')"
            if sched.blocks_to_swap_out:
                dev = np.array([d for d, _ in sched.blocks_to_swap_out])
                host = np.array([h for _, h in sched.blocks_to_swap_out])
                cpu[:, :, host] = np.asarray(jax.device_get(self.kv_cache[:, :, dev]))
            if sched.blocks_to_swap_in:
                host = np.array([h for h, _ in sched.blocks_to_swap_in])
                dev = np.array([d for _, d in sched.blocks_to_swap_in])
                self.kv_cache = _set_blocks(self.kv_cache, *_pad_pair(dev, cpu[:, :, host]))
        if sched.blocks_to_copy:
            src = np.array([s for s, _ in sched.blocks_to_copy])
            dst = np.array([d for _, d in sched.blocks_to_copy])
            self.kv_cache = _copy_blocks(self.kv_cache, *_pad_ids(src, dst))


def _prompt_chunks(prompt, prompt_rows: dict[str, PromptRows]) -> dict[str, PromptLogprobsChunk]:
    """Each prompt_logprobs request's rows of the every-token outputs (lp, rank, top ids, top logprobs)."""
    if not prompt_rows:
        return {}
    lp, rank, top_ids, top_lp = prompt
    return {rid: PromptLogprobsChunk(r.first_index, *(a[r.first_token:r.first_token + r.num_tokens]
                                                      for a in (lp, rank, top_ids, top_lp)))
            for rid, r in prompt_rows.items()}


def _pad_ids(src: np.ndarray, dst: np.ndarray):
    """Pad block-id lists to a power of two (fewer compiles); padding copies null block onto itself."""
    n = _round_up_pow2(len(src))
    return np.pad(src, (0, n - len(src))), np.pad(dst, (0, n - len(dst)))


def _pad_pair(dst: np.ndarray, data: np.ndarray):
    n = _round_up_pow2(len(dst))
    pad = [(0, 0)] * data.ndim
    pad[2] = (0, n - len(dst))
    # padding rows write zeros into the null block, which holds nothing real
    return np.pad(dst, (0, n - len(dst))), np.pad(data, pad)


@functools.partial(jax.jit, donate_argnums=0)
def _copy_blocks(kv_cache, src, dst):
    return kv_cache.at[:, :, dst].set(kv_cache[:, :, src])


@functools.partial(jax.jit, donate_argnums=0)
def _set_blocks(kv_cache, dst, data):
    return kv_cache.at[:, :, dst].set(data.astype(kv_cache.dtype))
