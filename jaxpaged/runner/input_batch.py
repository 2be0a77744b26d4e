"""The runner's own per-request state, keyed by request id: built from NewRequestData once, kept up to date
from each step's CachedRequestData, and extended with the tokens the runner samples itself. The scheduler's
objects are never held here.

Each request owns a row of persistent tables (block ids, sampler parameters, counters), so a step gathers
its whole batch with one fancy index per table. Row 0 is the padding row: its block table is all null
blocks and its sampler row greedy with nothing extra.
"""
from __future__ import annotations

import numpy as np

from jaxpaged.engine.output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxpaged.sampling_params import SamplingParams

# Columns of the per-request sampler table.
SAMPLING_COLUMNS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "logprobs", "prompt_logprobs", "needs_bias", "seed")
PROMPT_LOGPROBS_COLUMN = SAMPLING_COLUMNS.index("prompt_logprobs")
NEEDS_BIAS_COLUMN = SAMPLING_COLUMNS.index("needs_bias")
# The table is float32 and top_k an int32 on the device: values past these bounds sample as the bounds do
# (uniformly, with the most extreme penalty, with no top-k cut), and 1e308 or 2**62 would overflow.
MAX_FLOAT = 1e30
MAX_TOP_K = 2**31 - 1
PADDING_SAMPLING_ROW = (0.0, 0, 1.0, 0.0, 0.0, 0.0, 1.0, -1, -1, 0, 0)      # greedy, nothing extra


def sampling_row(sp: SamplingParams, seed: int) -> tuple:
    """A request's row of the sampler table (SAMPLING_COLUMNS); -1: no logprobs asked."""
    needs_bias = bool(sp.logit_bias) or sp.min_tokens > 0
    repetition_penalty = min(max(sp.repetition_penalty, 1 / MAX_FLOAT), MAX_FLOAT)
    return (min(sp.temperature, MAX_FLOAT), min(sp.top_k, MAX_TOP_K), sp.top_p, sp.min_p, sp.presence_penalty,
            sp.frequency_penalty, repetition_penalty, -1 if sp.logprobs is None else sp.logprobs,
            -1 if sp.prompt_logprobs is None else sp.prompt_logprobs, needs_bias, seed)


class InputBatch:
    def __init__(self, max_blocks_per_req: int, capacity: int = 64):
        self.rows: dict[str, int] = {}                    # request id -> its row
        self.block_table = np.zeros((capacity, max_blocks_per_req), np.int32)
        self.num_blocks = np.zeros(capacity, np.int32)
        self.sampling = np.zeros((capacity, len(SAMPLING_COLUMNS)), np.float64)
        self.sampling[0] = PADDING_SAMPLING_ROW
        # Output tokens sampled so far, the ones still in flight included: the index of the next one.
        self.num_sampled = np.zeros(capacity, np.int32)
        self.num_prompt = np.zeros(capacity, np.int32)
        # By row: prompt + output token ids on the host (the runner appends what it fetches), sampling
        # parameters, EOS ids.
        self.token_ids: list[list[int]] = [[] for _ in range(capacity)]
        self.params: list[SamplingParams | None] = [None] * capacity
        self.eos_token_ids: list[tuple[int, ...]] = [()] * capacity
        self._free_rows = list(range(capacity - 1, 0, -1))

    def apply(self, sched: SchedulerOutput) -> None:
        """Bring the state up to a step's hand-off: drop finished and preempted requests, add the new
        ones, record the blocks the others got."""
        self.remove(sched.dropped_req_ids)
        for new in sched.scheduled_new_reqs:
            self.add(new)
        self.update(sched.scheduled_cached_reqs)

    def add(self, new: NewRequestData) -> None:
        """A request the runner did not hold (or holds no longer: a resumed one replaces its old row)."""
        self.remove((new.req_id,))
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self.rows[new.req_id] = row
        n = len(new.block_ids)
        self.block_table[row, :n] = new.block_ids
        self.num_blocks[row] = n
        self.sampling[row] = sampling_row(new.sampling_params, new.sample_seed)
        self.num_sampled[row] = len(new.output_token_ids)
        self.num_prompt[row] = len(new.prompt_token_ids)
        self.token_ids[row] = new.prompt_token_ids + new.output_token_ids
        self.params[row] = new.sampling_params
        self.eos_token_ids[row] = new.eos_token_ids

    def update(self, cached: CachedRequestData) -> None:
        """Blocks appended (or, for a copy-on-write, replaced) since the last step."""
        rows, table, num_blocks = self.rows, self.block_table, self.num_blocks
        replaced = cached.replaced_block_ids
        for req_id, block_ids in zip(cached.req_ids, cached.new_block_ids):
            if block_ids:
                row = rows[req_id]
                start = 0 if req_id in replaced else num_blocks[row]
                table[row, start:start + len(block_ids)] = block_ids
                num_blocks[row] = start + len(block_ids)

    def remove(self, req_ids) -> None:
        for req_id in req_ids:
            row = self.rows.pop(req_id, None)
            if row is not None:
                self.block_table[row] = 0
                self.num_blocks[row] = 0
                self.token_ids[row] = []
                self.params[row] = None
                self._free_rows.append(row)

    def rows_of(self, req_ids: list[str]) -> np.ndarray:
        """intp[n]: the rows of the requests, in order."""
        return np.fromiter(map(self.rows.__getitem__, req_ids), np.intp, len(req_ids))

    def _grow(self) -> None:
        cap = len(self.num_blocks)
        self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
        self.sampling = np.concatenate([self.sampling, np.zeros_like(self.sampling)])
        for name in ("num_blocks", "num_sampled", "num_prompt"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(cap, np.int32)]))
        self.token_ids += [[] for _ in range(cap)]
        self.params += [None] * cap
        self.eos_token_ids += [()] * cap
        self._free_rows.extend(range(2 * cap - 1, cap - 1, -1))
