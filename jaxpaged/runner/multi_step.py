"""Multi-step decoding (vLLM's multi-step scheduling): several decode steps in one program, each request's
sampled token the next step's input. The scheduler decides when (Scheduler._num_steps) and allocates the
blocks; the engine drops the tokens after a stop."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpaged.models import AttentionMetadata
from jaxpaged.runner.sampler import SamplerFlags, SamplingInputs, sample
from jaxpaged.runner.step_inputs import fill_input_tokens


def decode_steps(forward, kv_cache, prev_sampled, model_input, sampling: SamplingInputs, num_steps: int,
                 flags: SamplerFlags):
    """Multi-step decoding: `num_steps` decode steps in one program, each request's sampled token the next
    step's input. model_input describes the first step of a decode-only batch (token i is request i);
    each further step advances every live request's position and length by one and writes its K/V into
    the slot its block table gives (the scheduler allocated blocks for all the steps). Padding rows stay
    on the null block. forward(tokens, kv_cache, meta) -> (logits, kv_cache).

    Returns the step's usual (kv_cache, sampled-token buffer, results), each result with a leading
    num_steps axis; the buffer holds the last step's tokens, which the next step's inputs read."""
    meta = model_input.meta
    num_rows = meta.seq_lens.shape[0]
    live = meta.seq_lens > 0                                       # i32[R] real requests (decode: T == R)
    block_size = kv_cache.shape[4]
    rows = jnp.arange(num_rows)

    def one_step(carry, k):
        kv, tokens, positions, seq_lens = carry
        blocks = meta.block_tables[rows, positions // block_size]
        slots = jnp.where(live, blocks * block_size + positions % block_size, 0)
        step_meta = AttentionMetadata(positions, slots, meta.block_tables, seq_lens, meta.query_start_loc)
        logits, kv = forward(tokens, kv, step_meta)
        result = sample(logits, dataclasses.replace(sampling, positions=sampling.positions + k), flags)
        step = live.astype(jnp.int32)
        return (kv, result[0], positions + step, seq_lens + step), result

    tokens = fill_input_tokens(model_input, prev_sampled)
    (kv_cache, last, _, _), results = jax.lax.scan(
        one_step, (kv_cache, tokens, meta.positions, meta.seq_lens), jnp.arange(num_steps, dtype=jnp.int32))
    sampled_buf = jnp.zeros_like(prev_sampled).at[:num_rows].set(last)
    return kv_cache, sampled_buf, (*results, None)
