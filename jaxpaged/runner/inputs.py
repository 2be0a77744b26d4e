"""SchedulerOutput + the runner's InputBatch -> one step's padded host inputs (NumPy, vectorised, bucketed).

Legend: T tokens (padded), R request rows (padded), M blocks per request, X / P logprob widths.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import numpy as np

from jaxpaged.engine.output import SchedulerOutput
from jaxpaged.models import AttentionMetadata
from jaxpaged.runner.buckets import Bucket, BucketPolicy, _round_up_pow2
from jaxpaged.runner.input_batch import NEEDS_BIAS_COLUMN, PROMPT_LOGPROBS_COLUMN, InputBatch
from jaxpaged.runner.sampler import Arr, SamplerFlags, SamplingInputs


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelInput:
    token_ids: Arr          # i32[T]
    meta: AttentionMetadata       # positions, slot_mapping, block_tables, seq_lens, query_start_loc
    logits_indices: Arr     # i32[R]  last scheduled token of each request
    # Async scheduling: tokens sampled by the previous step are not on the host yet. Token
    # fill_token_idx[i] of this batch takes prev_sampled[fill_src_row[i]] (index T: nothing to fill).
    fill_token_idx: Arr     # i32[R]
    fill_src_row: Arr       # i32[R]
    # prompt_logprobs only (else shape [0]): the next prompt token after each token of the batch, -1: none
    prompt_target_ids: Arr  # i32[T] or i32[0]


class PromptRows(NamedTuple):
    """Where a request's prompt logprobs sit in the step's every-token outputs."""
    first_token: int              # first row of the batch's tokens
    num_tokens: int               # prompt tokens scored
    first_index: int              # index in the prompt of the first token scored


class PreparedInputs(NamedTuple):
    model_input: ModelInput
    sampling: SamplingInputs
    flags: SamplerFlags
    bucket: Bucket
    prompt_rows: dict[str, PromptRows]    # prompt_logprobs requests only


def prepare_inputs(batch: InputBatch, out: SchedulerOutput, req_ids: list[str], rows: np.ndarray,
                   buckets: BucketPolicy, prev_rows: dict[str, int], block_size: int,
                   vocab_size: int) -> PreparedInputs:
    """The step's padded inputs. rows: the requests' rows of `batch`, in req_ids (batch) order;
    prev_rows: request id -> its row of the previous step's sampled-token buffer (still on the device)."""
    num_reqs = len(req_ids)
    n_sched = np.fromiter(map(out.num_scheduled_tokens.__getitem__, req_ids), np.int32, num_reqs)
    cached = out.scheduled_cached_reqs
    starts = np.array(cached.num_computed_tokens + [r.num_computed_tokens for r in out.scheduled_new_reqs],
                      np.int32)
    num_tokens = int(n_sched.sum())
    decode_only = bool((n_sched == 1).all())
    bucket = buckets.pick(num_tokens, num_reqs, decode_only)
    T, R = bucket.padded_num_tokens, bucket.padded_num_reqs

    qsl = np.full(R + 1, num_tokens, np.int32)
    qsl[0] = 0
    np.cumsum(n_sched, out=qsl[1:num_reqs + 1])
    positions = np.zeros(T, np.int32)
    if decode_only:
        req_of_token = np.arange(num_reqs)
        positions[:num_tokens] = starts
    else:
        # token -> request row: n_sched [2, 5, 3] -> [0, 0, 1, 1, 1, 1, 1, 2, 2, 2]
        req_of_token = np.repeat(np.arange(num_reqs), n_sched)
        positions[:num_tokens] = starts[req_of_token] + (np.arange(num_tokens) - qsl[req_of_token])
    token_ids, fill_idx, fill_src = _input_tokens(batch, req_ids, rows, starts, n_sched, qsl, T, R, prev_rows)
    table_rows = np.zeros(R, np.intp)       # padding rows gather row 0: all null blocks
    table_rows[:num_reqs] = rows
    tables = batch.block_table[table_rows]
    slots = np.zeros(T, np.int32)      # padding tokens write into the null block
    pos = positions[:num_tokens]
    slots[:num_tokens] = tables[req_of_token, pos // block_size] * block_size + pos % block_size
    seq_lens = np.zeros(R, np.int32)
    seq_lens[:num_reqs] = starts + n_sched
    logits_idx = np.zeros(R, np.int32)
    logits_idx[:num_reqs] = qsl[1:num_reqs + 1] - 1
    meta = AttentionMetadata(positions, slots, tables, seq_lens, qsl)
    static = batch.sampling[table_rows]
    targets, prompt_rows = _prompt_targets(batch, req_ids, rows, starts, n_sched, qsl, T, static)
    model_input = ModelInput(token_ids, meta, logits_idx, fill_idx, fill_src, targets)
    sampling, flags = prepare_sampling(batch, rows, static, out.num_steps, vocab_size, bool(prompt_rows))
    return PreparedInputs(model_input, sampling, flags, bucket, prompt_rows)


def _input_tokens(batch: InputBatch, req_ids, rows, starts, n_sched, qsl, T: int, R: int, prev_rows):
    """(token_ids i32[T], fill_token_idx i32[R], fill_src_row i32[R]). Input tokens already on the host are
    token_ids[start:start + known]; the rest (at most the last one) was sampled by the previous step and
    is still on the device: the step reads it there. After a multi-step batch the host lags by several
    tokens, but only the last one is an input (the others' K/V is in the cache already): known is 0."""
    num_reqs = len(req_ids)
    token_lists = [batch.token_ids[r] for r in rows.tolist()]
    host_tokens = np.fromiter(map(len, token_lists), np.int32, num_reqs)
    known = np.clip(host_tokens - starts, 0, n_sched)
    if (known < n_sched - 1).any():
        raise ValueError("more than one input token of a request is not on the host")
    token_ids = np.zeros(T, np.int32)
    fill_idx = np.full(R, T, np.int32)
    fill_src = np.zeros(R, np.int32)
    missing = np.flatnonzero(known < n_sched)
    if missing.size:
        fill_idx[missing] = qsl[missing + 1] - 1
        if missing.size == num_reqs:       # decode steps under async scheduling: every row
            fill_src[:num_reqs] = np.fromiter(map(prev_rows.__getitem__, req_ids), np.int32, num_reqs)
        else:
            fill_src[missing] = [prev_rows[req_ids[i]] for i in missing.tolist()]
    single = np.flatnonzero(known == 1)
    if single.size:
        token_ids[qsl[single]] = [token_lists[i][s] for i, s in zip(single.tolist(), starts[single].tolist())]
    for i in np.flatnonzero(known > 1).tolist():
        s, k, q = int(starts[i]), int(known[i]), int(qsl[i])
        token_ids[q:q + k] = token_lists[i][s:s + k]
    return token_ids, fill_idx, fill_src


def _prompt_targets(batch: InputBatch, req_ids, rows, starts, n_sched, qsl, T: int, static):
    """prompt_logprobs: the next prompt token after each scheduled prompt token (token p scores prompt
    token p + 1), and where each request's scores land; no targets (shape [0]) where no token is scored."""
    prompt_rows: dict[str, PromptRows] = {}
    num_reqs = len(req_ids)
    if not num_reqs or static[:num_reqs, PROMPT_LOGPROBS_COLUMN].max() < 0:
        return np.zeros(0, np.int32), prompt_rows
    targets = np.full(T, -1, np.int32)
    for i in np.flatnonzero(static[:num_reqs, PROMPT_LOGPROBS_COLUMN] >= 0).tolist():
        row, s, n = int(rows[i]), int(starts[i]), int(n_sched[i])
        count = min(s + n, int(batch.num_prompt[row]) - 1) - s
        if count > 0:
            targets[qsl[i]:qsl[i] + count] = batch.token_ids[row][s + 1:s + 1 + count]
            prompt_rows[req_ids[i]] = PromptRows(int(qsl[i]), count, s + 1)
    return (targets if prompt_rows else np.zeros(0, np.int32)), prompt_rows


def prepare_sampling(batch: InputBatch, rows: np.ndarray, static: np.ndarray, num_steps: int,
                     vocab_size: int, scores_prompt: bool) -> tuple[SamplingInputs, SamplerFlags]:
    """The sampler's inputs: each request's static row (gathered once above), the index of the output
    token being sampled, and the per-token extras (penalty histories, logit bias) when any row needs them.
    scores_prompt: whether the step scores any prompt token. A step that scores none (the prompts of the requests
    that asked are done, or a one-token prompt) is the variant without prompt logprobs, as it would be without
    those requests, so their decode steps share its programs instead of scoring every token for nothing."""
    R, n = len(static), len(rows)
    temperature, top_p, min_p = (static[:, c].astype(np.float32) for c in (0, 2, 3))
    pres, freq, rep = (static[:, c].astype(np.float32) for c in (4, 5, 6))
    top_k = static[:, 1].astype(np.int32)
    seeds = static[:, 10].astype(np.uint32)
    positions = np.zeros(R, np.int32)      # output index of the token being sampled (the first step's)
    positions[:n] = batch.num_sampled[rows]
    penalties = bool((pres != 0).any() or (freq != 0).any() or (rep != 1).any())
    flags = SamplerFlags(
        top_k_p=bool((top_k > 0).any() or (top_p < 1).any() or (min_p > 0).any()),
        penalties=penalties,
        num_logprobs=_logprobs_width(static[:, 7].max()),
        num_prompt_logprobs=_logprobs_width(static[:, PROMPT_LOGPROBS_COLUMN].max(), 1) if scores_prompt else -1,
    )
    out_ids = prompt_ids = np.full((R, 0), -1, np.int32)
    if penalties:
        lists = [batch.token_ids[r] for r in rows.tolist()]
        prompts = batch.num_prompt[rows].tolist()
        out_ids = _pad_rows([t[p:] for t, p in zip(lists, prompts)], R)
        prompt_ids = _pad_rows([t[:p] for t, p in zip(lists, prompts)], R)
    bias_rows = {i: _bias_entries(batch, int(rows[i]), vocab_size)
                 for i in np.flatnonzero(static[:n, NEEDS_BIAS_COLUMN]).tolist()}
    bias_rows = {i: row for i, row in bias_rows.items() if row}
    if bias_rows:
        flags = dataclasses.replace(flags, logit_bias=True)
        width = _pow2(max(len(b) for b in bias_rows.values()), 4)
        bias_ids = np.full((R, width), -1, np.int32)
        bias_vals = np.zeros((R, width), np.float32)
        for i, entries in bias_rows.items():
            bias_ids[i, :len(entries)] = [t for t, _ in entries]
            bias_vals[i, :len(entries)] = [v for _, v in entries]
    else:
        bias_ids, bias_vals = np.full((R, 0), -1, np.int32), np.zeros((R, 0), np.float32)
    inputs = SamplingInputs(temperature, top_k, top_p, min_p, seeds, positions, pres, freq, rep,
                            out_ids, prompt_ids, bias_ids, bias_vals)
    return inputs, flags


def _bias_entries(batch: InputBatch, row: int, vocab_size: int) -> list[tuple[int, float]]:
    """logit_bias, plus min_tokens: EOS and stop tokens may not be sampled before min_tokens outputs."""
    sp = batch.params[row]
    assert sp is not None, "a free row"
    entries = list((sp.logit_bias or {}).items())
    if batch.num_sampled[row] < sp.min_tokens:
        banned = set(sp.stop_token_ids or ()) | (set() if sp.ignore_eos else set(batch.eos_token_ids[row]))
        entries += [(t, -np.inf) for t in sorted(banned)]
    return [(t, v) for t, v in entries if 0 <= t < vocab_size]


# The top-logprobs width of a step is at least this: requests of 1 to 8 top logprobs (OpenAI's completions allow
# 5) share one sampler variant, which the warm-up compiles ahead (runner/step.py WARM_SAMPLER_VARIANTS).
MIN_LOGPROBS_WIDTH = 8


def _logprobs_width(most: float, lo: int = MIN_LOGPROBS_WIDTH) -> int:
    """Static top-k width for the largest request: -1 none asked, 0 only the chosen token's, else a power of 2
    of at least lo."""
    return -1 if most < 0 else (_pow2(int(most), lo) if most > 0 else 0)


def _pow2(n: int, lo: int = 1) -> int:
    """The smallest power of two >= n, at least lo (a power of two)."""
    return max(lo, _round_up_pow2(n))


def _pad_rows(rows: list[list[int]], num_rows: int) -> np.ndarray:
    width = _pow2(max((len(r) for r in rows), default=1), 16)
    out = np.full((num_rows, width), -1, np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out
