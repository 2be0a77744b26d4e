"""Token-budget scheduler (vLLM v1 style). No jax.

The algorithm, once: there is no prefill or decode phase. Each request has num_computed_tokens (K/V in
the cache) and num_tokens (prompt + sampled), and each step hands out max_num_batched_tokens across
requests: running requests first, in order, each as many tokens as it lacks; then waiting requests, a
long prompt in chunks beside the running decodes. When blocks run out, the newest running request (the
lowest priority under the priority policy) is preempted: recomputed later, or swapped to host memory.

The placeholder protocol (async scheduling), also once, in this module: a step is scheduled before the
previous step's sampled tokens reach the host. Committing a request's tokens (_commit) advances
num_computed_tokens at once and, when its chunk reaches the end of its known tokens, reserves one
placeholder per decode step for the token it samples; the next step computes past the placeholder, the
runner reading that token on the device. settle() gives the placeholders back when the results arrive
(the engine then appends the tokens), _undo() when a request scheduled earlier in a step is preempted.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque

from jaxpaged.engine.kv_cache_manager import KVCacheManager, cdiv
from jaxpaged.engine.output import CachedRequestData, NewRequestData, SchedulerOutput
from jaxpaged.engine.request import Request, RequestStatus

logger = logging.getLogger("jaxpaged.scheduler")


@dataclasses.dataclass
class SchedulerConfig:
    max_num_seqs: int = 256                 # requests in one step, at most
    max_num_batched_tokens: int = 2048      # token budget of one step
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"                    # "fcfs" or "priority" (lower value first, as vLLM)
    preemption_mode: str = "recompute"      # or "swap"
    num_scheduler_steps: int = 1            # decode steps one step may run on the device (multi-step)


def max_kv_slots(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """The KV cache slots (token positions) a request must hold at once to finish: its prompt and every
    sampled token but the last, which is never fed back. A pool with fewer slots can never finish it: it
    waits for room forever, or preempts itself again and again.

        prompt 30, max_tokens 3:   positions 0..31 -> 32 slots
        prompt 30, max_tokens 1:   the prefill alone, positions 0..29 -> 30 slots

    A multi-step decode may compute past max_tokens and so want more (its tokens past the end are dropped),
    but it needs no more to finish: when the pool is short it preempts the request, whose recompute is a
    single step that samples a token.
    """
    max_new = max_model_len - num_prompt_tokens if max_tokens is None else max_tokens
    return min(num_prompt_tokens + max_new - 1, max_model_len)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager):
        self.config = config
        self.kv = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_req_ids: set[str] = set()     # since the last step: the runner drops them
        self._unsent: set[str] = set()              # running requests the runner does not hold (forks)
        self.num_preemptions = 0

    # ---- admission ----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_forked(self, parent: Request, child: Request) -> None:
        """Run `child` on from the parent's computed tokens, sharing all of its blocks (beam search).
        The child's first write into a shared partly filled block copies it (copy-on-write)."""
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        self.requests[child.request_id] = child
        self.running.append(child)
        self._unsent.add(child.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([], CachedRequestData(), {}, 0, set(), [], [], [], self.finished_req_ids, [],
                              num_steps=self._num_steps())
        self.finished_req_ids = set()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted_req_ids:
            self._schedule_waiting(out, budget)
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        out.blocks_to_copy = self.kv.take_blocks_to_copy()
        return out

    def _num_steps(self) -> int:
        """Decode steps for this step: num_scheduler_steps when nothing waits for admission and every
        running request decodes one token with the plain sampler (no logprobs, penalties, logit bias or
        min_tokens: those need the host between tokens), else 1. As vLLM's multi-step scheduling, a
        waiting request (a prefill) is never held back behind a multi-step batch."""
        k = self.config.num_scheduler_steps
        if k == 1 or self.waiting or not self.running:
            return 1
        headroom = self.config.max_model_len
        for r in self.running:
            if (r.num_tokens + r.num_output_placeholders - r.num_computed_tokens != 1 or not r.multi_step_ok):
                return 1
            headroom = min(headroom, self.config.max_model_len - r.num_computed_tokens)
        return k if headroom >= k else 1

    # ---- the placeholder protocol ---------------------------------------------------------------
    @staticmethod
    def _commit(out: SchedulerOutput, req: Request, num_new: int) -> None:
        """Put num_new tokens of req (per decode step) in this step and count them computed; a chunk that
        reaches the end of the known tokens samples the next one: a placeholder per decode step."""
        steps = out.num_steps
        out.num_scheduled_tokens[req.request_id] = num_new
        pending = req.num_output_placeholders
        req.num_computed_tokens += num_new * steps
        if req.num_computed_tokens >= req.num_tokens + pending:
            out.sampling_ids.add(req.request_id)
            req.num_output_placeholders = pending + steps

    @staticmethod
    def _undo(out: SchedulerOutput, req: Request) -> None:
        """_commit's inverse, for a request preempted after it was scheduled in this step."""
        steps = out.num_steps
        req.num_computed_tokens -= out.num_scheduled_tokens.pop(req.request_id) * steps
        if req.request_id in out.sampling_ids:
            out.sampling_ids.discard(req.request_id)
            req.num_output_placeholders -= steps

    @staticmethod
    def settle(req: Request, num_steps: int) -> None:
        """A dispatched step's results for req arrived: its placeholders are tokens now (or discarded)."""
        req.num_output_placeholders -= num_steps

    # ---- running requests -----------------------------------------------------------------------
    def _num_new_tokens(self, req: Request, budget: int) -> int:
        pending = req.num_output_placeholders
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None and req.num_output_tokens + pending >= max_tokens:
            return 0          # its last token is already in flight
        n = min(req.num_tokens + pending - req.num_computed_tokens, budget,
                self.config.max_model_len - req.num_computed_tokens)
        return max(n, 0)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running requests first. Each one's tokens are committed as soon as it is scheduled; _preempt
        undoes that for a victim that was already scheduled this step."""
        running, cached, unsent = self.running, out.scheduled_cached_reqs, self._unsent
        commit, append_in_place = self._commit, self.kv.append_in_place
        max_model_len = self.config.max_model_len
        steps = out.num_steps       # > 1: every running request decodes (_num_steps), one token per step
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            # _num_new_tokens, inlined: this loop runs once per running request every step
            pending, computed = req.num_output_placeholders, req.num_computed_tokens
            max_tokens = req.sampling_params.max_tokens
            if max_tokens is not None and req.num_output_tokens + pending >= max_tokens:
                i += 1            # its last token is already in flight
                continue
            num_new = min(req.num_tokens + pending - computed, budget, max_model_len - computed)
            if num_new <= 0:
                i += 1
                continue
            rid = req.request_id
            new_blocks = None
            # The common decode case first: the tokens fit in blocks the request already owns (no
            # copy-on-write). Multi-step: slots for all `steps` tokens this request computes on the device.
            if not append_in_place(req, computed + num_new * steps):
                num_running = len(running)
                new_blocks = self._allocate_or_preempt(req, num_new * steps, out)
                if new_blocks is None:
                    continue      # req itself was preempted: it left running, so index i holds the next one
                if len(running) < num_running:     # a priority victim may have sat before req
                    i = running.index(req)
                if self.kv.take_replaced(rid) and rid not in unsent:    # a copy-on-write changed an earlier id
                    cached.replaced_block_ids.add(rid)
                    new_blocks = self.kv.get_block_ids(rid)
            commit(out, req, num_new)
            budget -= num_new
            if rid in unsent:
                unsent.discard(rid)
                out.scheduled_new_reqs.append(self._new_request_data(req, computed))
            else:
                cached.req_ids.append(rid)
                cached.new_block_ids.append(new_blocks or None)
                cached.num_computed_tokens.append(computed)
            i += 1
        return budget

    def _allocate_or_preempt(self, req: Request, num_new: int, out: SchedulerOutput) -> list[int] | None:
        """Slots for req's num_new tokens, preempting until they fit: the ids of the blocks it got, or
        None when req itself was preempted."""
        while (blocks := self.kv.allocate_slots(req, num_new)) is None:
            victim = self._pick_victim()
            self._preempt(victim, out)
            if victim is req:
                return None
        return [b.block_id for b in blocks]

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        rid = victim.request_id
        if rid in out.num_scheduled_tokens:   # already given tokens this step: undo
            self._undo(out, victim)
            cached = out.scheduled_cached_reqs
            if rid in cached.req_ids:
                j = cached.req_ids.index(rid)
                for column in (cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
                    del column[j]
                cached.replaced_block_ids.discard(rid)
            else:
                out.scheduled_new_reqs = [r for r in out.scheduled_new_reqs if r.req_id != rid]
        if self.config.preemption_mode == "swap" and self.kv.can_swap_out(victim):
            out.blocks_to_swap_out.extend(self.kv.swap_out(victim))
            victim.status = RequestStatus.SWAPPED
        else:
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.PREEMPTED
        self._unsent.discard(rid)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted_req_ids.append(rid)
        logger.warning("Request %s preempted by %s (total preemptions %d): not enough KV cache blocks",
                       rid, "swap" if victim.status == RequestStatus.SWAPPED else "recompute",
                       self.num_preemptions)
        self.waiting.appendleft(victim)

    # ---- waiting requests -----------------------------------------------------------------------
    def _next_waiting(self) -> Request:
        if self.config.policy == "priority":
            return min(self.waiting, key=lambda r: (r.priority, r.arrival_time))
        return self.waiting[0]

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self._next_waiting()
            if req.status == RequestStatus.SWAPPED:
                if not self._swap_in(req, out, budget):
                    break
                budget -= out.num_scheduled_tokens.get(req.request_id, 0)
                continue
            computed = self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - computed.num_tokens
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if self.kv.allocate_slots(req, num_new, computed.blocks) is None:
                break
            self.waiting.remove(req)
            req.num_computed_tokens = computed.num_tokens
            if req.num_cached_tokens < 0:           # its first admission (not one after a preemption)
                req.num_cached_tokens = computed.num_tokens
                self.kv.count_prefix_lookup(req, computed.num_tokens)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
            self._admit(out, req, num_new)
            budget -= num_new

    def _swap_in(self, req: Request, out: SchedulerOutput, budget: int) -> bool:
        mapping = self.kv.swap_in(req)
        if mapping is None:
            return False
        out.blocks_to_swap_in.extend(mapping)
        self.waiting.remove(req)
        num_new = self._num_new_tokens(req, budget)
        if num_new and self.kv.allocate_slots(req, num_new) is not None:
            self._admit(out, req, num_new)
        else:     # running again with nothing to compute this step: the runner hears of it when it has
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._unsent.add(req.request_id)
        return True

    def _admit(self, out: SchedulerOutput, req: Request, num_new: int) -> None:
        """A waiting request joins the running ones with num_new tokens this step; the runner gets all of it."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        computed = req.num_computed_tokens
        self._commit(out, req, num_new)
        out.scheduled_new_reqs.append(self._new_request_data(req, computed))

    def _new_request_data(self, req: Request, num_computed: int) -> NewRequestData:
        return NewRequestData(req.request_id, req.prompt_token_ids, req.output_token_ids[:], req.sampling_params,
                              req.sample_seed, req.eos_token_ids, self.kv.get_block_ids(req.request_id),
                              num_computed)

    # ---- results ------------------------------------------------------------------------------
    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Finish (stop, length, abort): free the blocks now, whatever state the request is in."""
        if req.is_finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        self._unsent.discard(req.request_id)
        self.finished_req_ids.add(req.request_id)

    def check_stop(self, req: Request) -> RequestStatus | None:
        """Stop conditions that need no text: EOS, stop token ids, max_tokens, max_model_len."""
        sp = req.sampling_params
        last = req.output_token_ids[-1]
        num_output = req.num_output_tokens
        if num_output >= sp.min_tokens:
            if last in req.eos_stop_ids:          # EOS, unless ignore_eos
                return RequestStatus.FINISHED_STOPPED
            if last in req.stop_ids:
                req.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if sp.max_tokens is not None and num_output >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def max_blocks_per_req(self, block_size: int) -> int:
        return cdiv(self.config.max_model_len, block_size)
