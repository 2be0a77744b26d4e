"""Sampling on the device, vectorised over requests: per-request parameters are arrays, and the rarely
used paths (top-k/top-p/min-p sort, penalties, logit bias, logprobs) are compiled in only when a batch
needs them (static `SamplerFlags`), so a plain greedy or temperature batch pays for none of them.

Legend: R requests (padded), V vocab, P padded prompt length, O padded output length, E bias entries,
X top logprobs.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.models.row_chunks import map_row_chunks, rows_within

_NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplerFlags:
    """Static choices: each distinct value compiles its own variant of the step."""
    top_k_p: bool = False          # some request uses top_k, top_p or min_p
    penalties: bool = False        # some request uses presence/frequency/repetition penalties
    logit_bias: bool = False       # some request has a logit bias or tokens banned by min_tokens
    num_logprobs: int = -1         # top logprobs to return (-1: none; 0: only the sampled token's)
    num_prompt_logprobs: int = -1  # top logprobs at every prompt position (-1: none), see prompt_logprobs()


# Host (NumPy, as the runner builds them) or device (inside the step) arrays.
Arr = jax.Array | np.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingInputs:
    temperature: Arr         # f32[R]   0 = greedy
    top_k: Arr               # i32[R]   0 = all
    top_p: Arr               # f32[R]
    min_p: Arr               # f32[R]
    seeds: Arr               # u32[R]   per-request seed
    positions: Arr           # i32[R]   output index of the token being sampled (folded into the key)
    presence_penalty: Arr    # f32[R]
    frequency_penalty: Arr   # f32[R]
    repetition_penalty: Arr  # f32[R]
    output_ids: Arr          # i32[R, O]  tokens generated so far, padded with -1 (penalties only)
    prompt_ids: Arr          # i32[R, P]  prompt tokens, padded with -1 (repetition penalty only)
    bias_ids: Arr            # i32[R, E]  token ids, padded with -1
    bias_values: Arr         # f32[R, E]  added to the logits (-inf bans a token)


def _token_counts(ids, vocab: int):
    """ids i32[R, O] padded with -1 -> f32[R, V] occurrence counts."""
    rows = jnp.broadcast_to(jnp.arange(ids.shape[0])[:, None], ids.shape)
    valid = ids >= 0
    return jnp.zeros((ids.shape[0], vocab), jnp.float32).at[rows, jnp.where(valid, ids, 0)].add(
        valid.astype(jnp.float32))


def apply_penalties(logits, inp: SamplingInputs):
    vocab = logits.shape[-1]
    out_counts = _token_counts(inp.output_ids, vocab)
    prompt_seen = _token_counts(inp.prompt_ids, vocab) > 0
    seen = prompt_seen | (out_counts > 0)
    rep = inp.repetition_penalty[:, None]
    # CTRL / HF repetition penalty: shrink positive logits, grow negative ones, for any token seen.
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - inp.frequency_penalty[:, None] * out_counts
    logits = logits - inp.presence_penalty[:, None] * (out_counts > 0).astype(jnp.float32)
    return logits


def apply_logit_bias(logits, inp: SamplingInputs):
    rows = jnp.broadcast_to(jnp.arange(logits.shape[0])[:, None], inp.bias_ids.shape)
    valid = inp.bias_ids >= 0
    return logits.at[rows, jnp.where(valid, inp.bias_ids, 0)].add(jnp.where(valid, inp.bias_values, 0.0))


def _mask_top_k_p(logits, inp: SamplingInputs):
    """Sort once; keep the top_k, the top_p nucleus and tokens with p >= min_p * p_max."""
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = jax.lax.sort_key_val(-logits, jnp.broadcast_to(jnp.arange(vocab), logits.shape))
    sorted_logits = -sorted_logits                                          # descending
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(inp.top_k > 0, inp.top_k, vocab)[:, None]
    keep = rank < k
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, _NEG_INF), axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= cum_before < inp.top_p[:, None]
    keep &= probs >= inp.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)
    masked_sorted = jnp.where(keep, sorted_logits, _NEG_INF)
    # back to vocabulary order
    return jnp.zeros_like(logits).at[jnp.arange(logits.shape[0])[:, None], sorted_idx].set(masked_sorted)


def _row_keys(seeds, positions):
    """u32[R, 2]: two key words per (seed, output position), from JAX's threefry (R draws, not R * V)."""
    def one(seed, pos):
        return jax.random.bits(jax.random.fold_in(jax.random.PRNGKey(seed), pos), (2,), jnp.uint32)
    return jax.vmap(one)(seeds, positions)


def _fmix32(h):
    """MurmurHash3's 32-bit finalizer: a bijection of uint32 in which every input bit flips each output bit
    with probability about 1/2."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _gumbel(seeds, positions, vocab: int):
    """f32[R, V] standard Gumbel noise from (seed, output position): the same seed gives the same tokens in
    any batch. Each row's two key words (threefry) are mixed with the vocabulary index by two rounds of a
    32-bit finalizer: about a dozen integer operations an element, where threefry for each element costs
    about sixty, and at large batches this noise is a visible part of a decode step. The top 24 bits give u
    in (0, 1), then -log(-log u)."""
    keys = _row_keys(seeds, positions)
    idx = jnp.arange(vocab, dtype=jnp.uint32)[None, :]
    bits = _fmix32(_fmix32(idx ^ keys[:, :1]) + keys[:, 1:])
    u = ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))
    return -jnp.log(-jnp.log(u))


# A variant's sampler (a sort for top-k/p, occurrence counts for penalties, the log-softmax for logprobs) holds
# several [rows, V] float32 arrays at once: at 1,024 rows of a 256k vocabulary about 7 GiB, which the KV pool would
# have to leave free (engine/cache_sizing.py activation_reserve). Such a sampler runs over the rows in turn, at most
# this many bytes of logits at a time (a power of two of rows; 0: all rows at once). The plain sampler (greedy,
# temperature) is one fused reduction over the logits and runs whole.
SAMPLER_CHUNK_BYTES = 128 << 20


def sampler_chunk_rows(rows: int, vocab: int, flags: SamplerFlags) -> int:
    """Rows of logits the sampler of `flags` takes at once."""
    plain = not (flags.top_k_p or flags.penalties or flags.logit_bias or flags.num_logprobs >= 0)
    if plain or not SAMPLER_CHUNK_BYTES:
        return rows
    return rows_within(SAMPLER_CHUNK_BYTES, vocab * 4, rows)


def sample(logits, inp: SamplingInputs, flags: SamplerFlags):
    """logits f32[R, V] -> (token_ids i32[R], sampled logprob f32[R], rank i32[R],
    top ids i32[R, X], top logprobs f32[R, X]); logprobs are of the model's raw distribution, as vLLM's.
    Rows are independent (each its own seed and parameters), so a variant's sampler takes them
    sampler_chunk_rows at a time with the same results."""
    rows, vocab = logits.shape
    chunk = sampler_chunk_rows(rows, vocab, flags)
    if chunk >= rows:
        return _sample_rows(logits, inp, flags)
    return map_row_chunks(lambda a: _sample_rows(a[0], a[1], flags), (logits, inp), chunk)


def _sample_rows(logits, inp: SamplingInputs, flags: SamplerFlags):
    """sample() over all the given rows at once."""
    raw = logits
    if flags.penalties:
        logits = apply_penalties(logits, inp)
    if flags.logit_bias:
        logits = apply_logit_bias(logits, inp)
    # Greedy rows take the argmax of the logits, the others that of the Gumbel-perturbed ones: one select
    # and one reduction, no runtime branch (a conditional costs a device->host sync per step on GPUs) and
    # no second compiled variant.
    temp = jnp.where(inp.temperature > 0, inp.temperature, 1.0)[:, None]
    scaled = logits / temp
    if flags.top_k_p:
        scaled = _mask_top_k_p(scaled, inp)
    noisy = scaled + _gumbel(inp.seeds, inp.positions, logits.shape[-1])
    ids = jnp.argmax(jnp.where(inp.temperature[:, None] > 0, noisy, logits), axis=-1).astype(jnp.int32)
    if flags.num_logprobs < 0:
        empty = jnp.zeros((logits.shape[0], 0))
        return ids, jnp.zeros(ids.shape, jnp.float32), jnp.zeros(ids.shape, jnp.int32), empty.astype(jnp.int32), empty
    logprobs = jax.nn.log_softmax(raw, axis=-1)
    chosen = jnp.take_along_axis(logprobs, ids[:, None], axis=-1)[:, 0]
    rank = jnp.sum(logprobs > chosen[:, None], axis=-1).astype(jnp.int32) + 1
    top_lp, top_ids = jax.lax.top_k(logprobs, max(flags.num_logprobs, 0))
    return ids, chosen, rank, top_ids.astype(jnp.int32), top_lp


def prompt_logprobs(logits, target_ids, *, k: int):
    """Logprobs of the prompt's own next tokens, for `prompt_logprobs`.

    logits f32[T, V] at every token of the batch; target_ids i32[T] the next prompt token (-1: none).
    Returns (logprob f32[T], rank i32[T], top ids i32[T, k], top logprobs f32[T, k]).
    """
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    target = jnp.take_along_axis(logprobs, jnp.maximum(target_ids, 0)[:, None], axis=-1)[:, 0]
    rank = jnp.sum(logprobs > target[:, None], axis=-1).astype(jnp.int32) + 1
    top_lp, top_ids = jax.lax.top_k(logprobs, k)
    return target, rank, top_ids.astype(jnp.int32), top_lp


def prompt_head(flags: SamplerFlags):
    """The prompt-logprob head the model applies to every token's logits in bounded chunks, or None."""
    return (functools.partial(prompt_logprobs, k=flags.num_prompt_logprobs)
            if flags.num_prompt_logprobs >= 0 else None)


def sample_and_keep(logits, prompt, sampling: SamplingInputs, flags: SamplerFlags, prev_sampled):
    """(sampled ids in a fixed-size device buffer for the next step's inputs, the step's results)."""
    result = sample(logits, sampling, flags)
    sampled_buf = jnp.zeros_like(prev_sampled).at[:logits.shape[0]].set(result[0])
    return sampled_buf, (*result, prompt)
