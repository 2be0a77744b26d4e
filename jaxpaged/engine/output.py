"""What crosses the scheduler -> runner boundary: plain data, as vLLM v1's SchedulerOutput.

A request reaches the runner once as NewRequestData (its tokens, sampling parameters and blocks), when it
is first scheduled and again whenever it comes back after a preemption or a swap. While it stays running,
each step sends only what changed (CachedRequestData: blocks appended, tokens computed). The runner keeps
its own per-request state keyed by request id (runner/input_batch.py) and appends the tokens it samples
itself, so nothing here is shared or mutated after it is handed over.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jaxpaged.sampling_params import SamplingParams


@dataclasses.dataclass
class NewRequestData:
    """A request the runner does not hold: everything it needs, once."""
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]        # tokens sampled before (a request resumed after preemption, a beam)
    sampling_params: SamplingParams
    sample_seed: int                   # the request's PRNG seed (params.seed, or drawn by the engine)
    eos_token_ids: tuple[int, ...]     # min_tokens bans these (unless ignore_eos) with the stop token ids
    block_ids: list[int]               # the whole block table after this step's allocation
    num_computed_tokens: int           # tokens whose K/V is in the cache before this step


@dataclasses.dataclass
class CachedRequestData:
    """The per-step diff of requests the runner already holds, in batch order (parallel lists)."""
    req_ids: list[str] = dataclasses.field(default_factory=list)
    # Blocks appended this step (None: none). For a request in replaced_block_ids, its whole table.
    new_block_ids: list[list[int] | None] = dataclasses.field(default_factory=list)
    num_computed_tokens: list[int] = dataclasses.field(default_factory=list)   # before this step
    # Requests whose earlier block ids changed (a copy-on-write of a shared partly filled block).
    replaced_block_ids: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class SchedulerOutput:
    """What one engine step computes. Batch order: the cached requests, then the new ones."""
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]          # request id -> tokens computed this step (per decode step)
    total_num_scheduled_tokens: int
    sampling_ids: set[str]                        # requests whose sample this step is a new token
    blocks_to_copy: list[tuple[int, int]]         # (src, dst) device block copies, before the step
    blocks_to_swap_out: list[tuple[int, int]]     # (device, host), before the step
    blocks_to_swap_in: list[tuple[int, int]]      # (host, device), before the step
    # Requests the runner drops before this step: finished since the last step, preempted or swapped out.
    finished_req_ids: set[str]
    preempted_req_ids: list[str]
    # Multi-step: the device runs this many decode steps back to back, each request's sampled token
    # feeding its next one (one token each per step); tokens after a request's stop are discarded.
    num_steps: int = 1

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    @property
    def dropped_req_ids(self) -> set[str]:
        """The requests the runner drops at this hand-off (finished or preempted), launched or not."""
        return self.finished_req_ids | set(self.preempted_req_ids)

    @functools.cached_property
    def req_ids(self) -> list[str]:
        """The batch's request ids in batch order (read once scheduling is done: stats and the runner)."""
        return self.scheduled_cached_reqs.req_ids + [r.req_id for r in self.scheduled_new_reqs]


@dataclasses.dataclass
class ModelRunnerOutput:
    """Host-side results of one step (lists and NumPy), rows in SchedulerOutput.req_ids order."""
    req_ids: list[str]
    # request id -> its new tokens (num_steps of them), for the requests in sampling_ids
    sampled_token_ids: dict[str, list[int]]
    # Sample logprobs, only when a request asked (else None): per batch row
    logprobs: LogprobsArrays | None
    # request id -> prompt logprobs of the prompt tokens this step scored (prompt_logprobs requests)
    prompt_logprobs: dict[str, PromptLogprobsChunk]
    rows: dict[str, int]                          # request id -> row of logprobs


@dataclasses.dataclass
class LogprobsArrays:
    """Per batch row: the sampled token's logprob and rank and the top-X alternatives."""
    logprobs: np.ndarray      # f32[R]
    ranks: np.ndarray         # i32[R]
    top_ids: np.ndarray       # i32[R, X]
    top_logprobs: np.ndarray  # f32[R, X]


@dataclasses.dataclass
class PromptLogprobsChunk:
    """Scores of prompt tokens first_index .. first_index + len - 1, each from the token before it."""
    first_index: int          # index in the prompt of the first token scored (>= 1)
    logprobs: np.ndarray      # f32[n]
    ranks: np.ndarray         # i32[n]
    top_ids: np.ndarray       # i32[n, P]
    top_logprobs: np.ndarray  # f32[n, P]

    @property
    def num_tokens(self) -> int:
        return len(self.logprobs)
