"""A request as the scheduler sees it: token ids, progress counters and its status. No jax."""
from __future__ import annotations

import enum
import time

from jaxpaged.engine.block_pool import BlockHash, hash_block_tokens
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2          # recompute: waiting again with no blocks
    SWAPPED = 3            # blocks copied to host memory, waiting to come back
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), arrival_time: float | None = None, priority: int = 0,
                 prompt: str | None = None, block_size: int = 16, sample_seed: int = 0):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self._status = RequestStatus.WAITING
        self.is_finished = False                          # status.finished, kept as a plain attribute
        # Read by the engine's per-token loop: FINAL_ONLY requests produce nothing until they finish, and
        # without stop strings nobody reads their text before the end, so it is decoded once then (a join
        # over the byte table), not token by token.
        self.streams = sampling_params.output_kind != RequestOutputKind.FINAL_ONLY
        self.deferred_text = not self.streams and not sampling_params.stop
        self.stop_reason: int | str | None = None
        self.all_token_ids = list(prompt_token_ids)      # prompt + output
        self.output_token_ids: list[int] = []
        # len(prompt_token_ids), len(all_token_ids), len(output_token_ids): plain attributes, read several
        # times per request per step; append_output_token keeps them (the only writer of the lists)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_tokens = self.num_prompt_tokens
        self.num_output_tokens = 0
        self.num_computed_tokens = 0                      # tokens whose K/V are in the cache
        # Tokens sampled by a dispatched step whose ids the host has not seen yet (async scheduling):
        # the next step already computes past them, reading the ids from the device.
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1                       # prompt tokens served by the prefix cache (first schedule)
        self.num_preemptions = 0
        self.sample_seed = sample_seed                    # the per-request PRNG seed (params.seed or drawn)
        self.block_size = block_size
        self.block_hashes: list[BlockHash] = []           # of every full block of all_token_ids
        self.cumulative_logprob = 0.0
        self.logprobs: list = []                          # per output token: {token_id: Logprob}
        self.prompt_logprobs: list = []                   # filled chunk by chunk when asked for
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        sp = sampling_params
        needs_bias = bool(sp.logit_bias) or sp.min_tokens > 0
        # penalties need the exact token history on the host, so such batches run synchronously
        self.needs_host_history = bool(sp.presence_penalty or sp.frequency_penalty
                                       or sp.repetition_penalty != 1.0)
        # may run several decode steps on the device between host visits (multi-step scheduling): nothing
        # the sampler needs per token from the host, and no logprobs to return per token (prompt logprobs are
        # scored in the prompt's chunks, before the decode steps that multi-step batches are made of)
        self.multi_step_ok = not (self.needs_host_history or needs_bias or sp.logprobs is not None)
        # check_stop's token sets, built once: EOS (unless ignored) and the stop token ids
        self.eos_stop_ids = frozenset(() if sp.ignore_eos else eos_token_ids)
        self.stop_ids = frozenset(sp.stop_token_ids or ())
        self._next_full_block_at = block_size                # num_tokens that fills the next unhashed block
        self._update_block_hashes()

    @property
    def status(self) -> RequestStatus:
        return self._status

    @status.setter
    def status(self, status: RequestStatus) -> None:
        self._status = status
        self.is_finished = status >= RequestStatus.FINISHED_STOPPED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.num_output_tokens += 1
        self.num_tokens += 1
        if self.num_tokens >= self._next_full_block_at:
            self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        """Hash every newly full block: hash(parent_hash, block_token_ids)."""
        s = self.block_size
        while (len(self.block_hashes) + 1) * s <= len(self.all_token_ids):
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if i else None
            self.block_hashes.append(hash_block_tokens(parent, self.all_token_ids[i * s:(i + 1) * s]))
        self._next_full_block_at = (len(self.block_hashes) + 1) * s

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.name})")
