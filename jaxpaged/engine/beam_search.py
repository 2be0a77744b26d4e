"""Beam search, as vLLM's `LLM.beam_search`: each step extends every live beam by one token, keeps the
`beam_width` best candidates (by cumulative logprob) per prompt, and moves candidates that end in EOS to
the finished list; at the end the finished and live beams are ranked by the length-penalised score.

Unlike vLLM (which resubmits each beam as a new prompt and leans on the prefix cache), beams here are
requests that stay in the scheduler: a chosen candidate is a fork of its parent beam that shares every
block (`Scheduler.add_forked` -> `KVCacheManager.fork`), and the shared partly filled last block is copied
on write when two beams diverge in it. The engine must be idle while it runs (offline use).

A pool too small for every beam at once still finishes, as vLLM's does: beams preempt each other, and when
the beams that hold blocks have all given their candidates while the others wait for room (nothing can be
scheduled), those beams are parked: their blocks are freed, their candidates kept, and a parked beam's
children recompute its tokens as new requests instead of forking its blocks (the prefix cache serves what
is still cached). One beam (the prompt and max_tokens) fits whatever the pool: validate_prompt refuses a
prompt for which it would not.
"""
from __future__ import annotations

import dataclasses
import itertools

from jaxpaged.engine.request import Request, RequestStatus
from jaxpaged.sampling_params import BeamSearchParams, SamplingParams


@dataclasses.dataclass
class BeamSearchSequence:
    tokens: list[int]                     # prompt + generated tokens, as vLLM's
    logprobs: list[dict[int, float]]      # per generated token: {candidate id: logprob}
    cum_logprob: float = 0.0
    text: str | None = None               # the decoded tokens (prompt included), set at the end
    finish_reason: str | None = None      # "stop" (EOS) or "length"
    request: Request | None = dataclasses.field(default=None, repr=False)   # live beams only


@dataclasses.dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]   # best first


def beam_search_score(tokens: list[int], cum_logprob: float, eos_token_ids, length_penalty: float) -> float:
    """vLLM's get_beam_search_score: cum_logprob / len ** length_penalty, the EOS not counted."""
    seq_len = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    return cum_logprob / (seq_len ** length_penalty)


def _live(beam: BeamSearchSequence) -> Request:
    """A live beam's request."""
    assert beam.request is not None, "a finished beam"
    return beam.request


class _Instance:
    def __init__(self, prompt_ids: list[int]):
        self.prompt_ids = prompt_ids
        self.beams: list[BeamSearchSequence] = []
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0


def beam_search(llm, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        raise RuntimeError("beam_search needs an idle engine: finish or abort the running requests first")
    prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
    width = params.beam_width
    if width > engine.max_num_seqs:
        raise ValueError(f"beam_width {width} exceeds max_num_seqs {engine.max_num_seqs}: every beam is a "
                         "running sequence")
    token_ids = []
    for p in prompts:                 # all validated before any is searched
        _, tok = engine.tokenize_prompt(p)
        engine.validate_prompt(tok, SamplingParams(max_tokens=params.max_tokens))
        token_ids.append(tok)
    # Forked beams join the running set directly, so the prompts go in waves whose beams all fit in
    # max_num_seqs (the step's row buffers are sized for it).
    wave, ids = engine.max_num_seqs // width, itertools.count()
    return [out for i in range(0, len(token_ids), wave)
            for out in _search(engine, token_ids[i:i + wave], params, ids)]


def _search(engine, prompt_ids: list[list[int]], params: BeamSearchParams, ids) -> list[BeamSearchOutput]:
    sched = engine.scheduler
    width = params.beam_width
    beam_params = SamplingParams(temperature=0.0, logprobs=2 * width, max_tokens=None, ignore_eos=True)
    instances: list[_Instance] = []
    for token_ids in prompt_ids:
        inst = _Instance(token_ids)
        req = Request(f"beam-{next(ids)}", token_ids, beam_params, (), block_size=engine.block_size)
        inst.beams = [BeamSearchSequence(list(token_ids), [], 0.0, request=req)]
        sched.add_request(req)
        instances.append(inst)
    pending: dict[str, list[tuple[int, float]]] = {}        # request id -> its top candidates
    try:
        while any(inst.beams for inst in instances):
            got = _step(engine, 2 * width)
            if got is None:
                _park(engine, instances, pending)
                continue
            pending.update(got)
            for inst in instances:
                if inst.beams and all(_live(b).request_id in pending for b in inst.beams):
                    _select(engine, inst, params, pending, ids)
    finally:
        for inst in instances:   # on error: free whatever is still held
            for b in inst.beams:
                sched.finish_request(b.request, RequestStatus.FINISHED_ABORTED)
        engine.core.release_finished()       # the engine is idle again
    return [_finish(engine, inst, params) for inst in instances]


def _step(engine, k: int) -> dict[str, list[tuple[int, float]]] | None:
    """One synchronous engine step over the beams; returns the top-k candidates of each sampled beam, or None
    when nothing could be scheduled."""
    sched = engine.scheduler
    out = sched.schedule()
    if out.is_empty:
        engine.runner.release_finished(out.dropped_req_ids)
        return None
    result = engine.runner.execute(out)
    got = {}
    for rid, row in result.rows.items():
        # The sample is not appended: the beam picks its own token (a fork of this one).
        sched.settle(sched.requests[rid], out.num_steps)
        got[rid] = list(zip(result.logprobs.top_ids[row][:k].tolist(),
                            result.logprobs.top_logprobs[row][:k].tolist()))
    return got


def _park(engine, instances: list[_Instance], pending) -> None:
    """Nothing could be scheduled: the beams whose candidates are in hold the blocks that the waiting (preempted)
    beams need. Free those blocks; each parked beam keeps its candidates, and its children recompute."""
    sched = engine.scheduler
    parked = [_live(b) for inst in instances for b in inst.beams
              if _live(b).request_id in pending and not _live(b).is_finished]
    if not parked or not sched.waiting:
        raise RuntimeError("beam search stalled: nothing could be scheduled")
    for req in parked:
        sched.finish_request(req, RequestStatus.FINISHED_ABORTED)


def _select(engine, inst: _Instance, params: BeamSearchParams, pending, ids) -> None:
    sched, eos = engine.scheduler, engine.eos_token_ids
    candidates = []
    for beam in inst.beams:
        top = pending.pop(_live(beam).request_id)
        for token, lp in top:
            new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [dict(top)], beam.cum_logprob + lp)
            new.request = beam.request     # the parent, until forked
            if token in eos and not params.ignore_eos:
                new.finish_reason, new.request = "stop", None
                inst.completed.append(new)
            else:
                candidates.append((new, token))
    candidates.sort(key=lambda c: c[0].cum_logprob, reverse=True)
    inst.steps += 1
    keep = candidates[:params.beam_width] if inst.steps < params.max_tokens else []
    for new, token in keep:
        parent = _live(new)
        child = Request(f"beam-{next(ids)}", inst.prompt_ids, parent.sampling_params, (),
                        block_size=engine.block_size)
        for t in new.tokens[len(inst.prompt_ids):]:
            child.append_output_token(t)
        if parent.is_finished:           # parked (_park): recompute its tokens
            sched.add_request(child)
        else:
            sched.add_forked(parent, child)
        new.request = child
    if inst.steps >= params.max_tokens:
        for new, _ in candidates[:params.beam_width]:
            new.finish_reason, new.request = "length", None
            inst.completed.append(new)
    for beam in inst.beams:          # parents go; their blocks live on in the children
        sched.finish_request(beam.request, RequestStatus.FINISHED_ABORTED)
    inst.beams = [new for new, _ in keep]


def _finish(engine, inst: _Instance, params: BeamSearchParams) -> BeamSearchOutput:
    done = inst.completed + inst.beams
    done.sort(key=lambda b: beam_search_score(b.tokens, b.cum_logprob, engine.eos_token_ids,
                                              params.length_penalty), reverse=True)
    best = done[:params.beam_width]
    for b in best:
        b.request = None
        b.text = engine.tokenizer.decode(b.tokens, skip_special_tokens=True)
    return BeamSearchOutput(best)
