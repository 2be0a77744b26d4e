"""The API process's side of a request: EngineCoreOutputs in, vLLM's RequestOutputs out.

It detokenizes, finds stop strings (cutting a multi-step program's tokens after one, and asking the core
to abort the request), builds logprob entries, gathers the n samples of a parent request, computes
streaming deltas, and records what clients received (RequestStats). It keeps its own per-sample state and
never touches the core's objects, so it runs the same beside an in-process core and a core process.
"""
from __future__ import annotations

import dataclasses
import time
from typing import cast

from jaxpaged.engine.detokenizer import IncrementalDetokenizer
from jaxpaged.engine.messages import EngineCoreOutput, PromptLogprobs
from jaxpaged.engine.stats import RequestStats
from jaxpaged.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams


@dataclasses.dataclass(slots=True)
class _Sample:
    """One of a request's n samples (one core request)."""
    request_id: str
    detok: IncrementalDetokenizer
    logprobs_k: int | None              # sample logprobs asked for (None: none)
    # Stop strings need the text token by token; without them a FINAL_ONLY request's text is decoded once,
    # at the end, and nobody reads it before.
    deferred_text: bool
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)      # per token: {token_id: Logprob}
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # DELTA streaming: what was sent already
    sent_text: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0
    finished_sent: bool = False


@dataclasses.dataclass(slots=True)
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    samples: list[_Sample]
    num_unfinished: int
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None     # from sample 0, chunk by chunk, when asked for
    prompt_logprobs_sent: bool = False


class OutputProcessor:
    def __init__(self, tokenizer, stats: RequestStats | None = None):
        self.tokenizer = tokenizer
        self.stats = stats or RequestStats()
        self.parents: dict[str, _Parent] = {}
        self._samples: dict[str, tuple[_Parent, _Sample, int]] = {}   # core request id -> (parent, sample, index)

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            sample_ids: list[str], arrival_time: float) -> None:
        streams = params.output_kind != RequestOutputKind.FINAL_ONLY
        stop = cast(list[str], params.stop)               # a list after SamplingParams.__post_init__
        samples = [_Sample(sid, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                                                       stop, params.include_stop_str_in_output),
                           params.logprobs, deferred_text=not streams and not stop)
                   for sid in sample_ids]
        parent = _Parent(request_id, prompt, prompt_token_ids, params, arrival_time, samples, len(samples))
        if params.prompt_logprobs is not None and len(prompt_token_ids) == 1:
            parent.prompt_logprobs = [None]      # no later prompt token to score: the list is its first entry alone
        self.parents[request_id] = parent
        for i, s in enumerate(samples):
            self._samples[s.request_id] = (parent, s, i)

    def sample_ids(self, request_id: str) -> list[str]:
        """The core request ids of a parent's unfinished samples (what an abort sends to the core)."""
        parent = self.parents.get(request_id)
        return [s.request_id for s in parent.samples if s.finish_reason is None] if parent else []

    def drop(self, request_id: str) -> None:
        """Forget a parent request (aborted, or finished and sent)."""
        parent = self.parents.pop(request_id, None)
        if parent is not None:
            for s in parent.samples:
                self._samples.pop(s.request_id, None)

    def abort(self, request_id: str) -> list[str]:
        """Drop a parent request; returns its unfinished samples' core request ids (to abort there)."""
        ids = self.sample_ids(request_id)
        self.finish_aborted(request_id)
        return ids

    def finish_aborted(self, request_id: str) -> RequestOutput | None:
        """End a parent request as aborted (its unfinished samples' finish_reason "abort") and return its
        last output, for a stream that must end cleanly; the caller aborts sample_ids() in the core first."""
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        now = time.time()
        for s in parent.samples:
            if s.finish_reason is None:
                s.finish_reason = "abort"
                parent.num_unfinished -= 1
                self.stats.on_finish("abort", parent.arrival_time, now)
        out = self._output(parent)
        self.drop(request_id)
        return out

    # ---- one step's outputs -------------------------------------------------------------------
    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """One engine step's outputs -> (RequestOutputs to hand to callers, core request ids to abort:
        samples a stop string finished, which the core does not know of)."""
        now = time.time()
        stats = self.stats
        record = stats.record_latencies
        touched: dict[str, _Parent] = {}
        to_abort: list[str] = []
        generated = 0
        t_detok = 0.0
        for co in core_outputs:
            entry = self._samples.get(co.request_id)
            if entry is None:
                continue                      # aborted or dropped here while the core was still running it
            parent, sample, index = entry
            if sample.finish_reason is not None:
                continue                      # finished by a stop string: the core's later tokens are dropped
            if co.num_cached_tokens and index == 0:
                parent.num_cached_tokens = co.num_cached_tokens
            if co.new_prompt_logprobs is not None and index == 0:
                self._record_prompt_logprobs(parent, co.new_prompt_logprobs)
            tokens = co.new_token_ids
            generated += len(tokens)          # vLLM counts what the core sent, before a stop string cuts it
            stop = None
            if tokens:
                if sample.first_token_time is None:
                    sample.first_token_time = now
                    if record:
                        stats.ttft.append(now - parent.arrival_time)
                elif record and sample.last_token_time is not None:
                    stats.itl.append(now - sample.last_token_time)
                sample.last_token_time = now
                if not sample.deferred_text:
                    t0 = time.perf_counter()
                    before = len(sample.detok.token_ids)
                    match = sample.detok.add_tokens(tokens)
                    t_detok += time.perf_counter() - t0
                    if match is not None:       # tokens after the one that completed the stop string: dropped
                        stop = match.stop
                        tokens = tokens[:len(sample.detok.token_ids) - before]
                sample.token_ids.extend(tokens)
                if co.new_logprobs is not None:
                    self._record_logprobs(sample, tokens, co)
            if stop is not None:
                sample.finish_reason, sample.stop_reason = "stop", stop
                if co.finish_reason is None:
                    to_abort.append(co.request_id)
            elif co.finish_reason is not None:
                sample.finish_reason, sample.stop_reason = co.finish_reason.text, co.stop_reason
            if sample.finish_reason is not None:
                parent.num_unfinished -= 1
                stats.on_finish(sample.finish_reason, parent.arrival_time, now)
                touched[parent.request_id] = parent
            elif tokens or co.new_prompt_logprobs is not None:
                if parent.params.output_kind != RequestOutputKind.FINAL_ONLY:
                    touched[parent.request_id] = parent
        stats.generation_tokens += generated
        stats.detokenize_s += t_detok
        outputs = []
        for parent in touched.values():
            out = self._output(parent)
            if out is not None:
                outputs.append(out)
                if out.finished:
                    self.drop(parent.request_id)
        return outputs, to_abort

    def _record_logprobs(self, sample: _Sample, tokens: list[int], co: EngineCoreOutput) -> None:
        lp = co.new_logprobs
        assert lp is not None and sample.logprobs_k is not None
        for j, token in enumerate(tokens):
            sample.logprobs.append(self.logprob_entry(token, lp.logprobs[j], lp.ranks[j], lp.top_ids[j],
                                                      lp.top_logprobs[j]))
            sample.cumulative_logprob += lp.logprobs[j]

    def _record_prompt_logprobs(self, parent: _Parent, chunk: PromptLogprobs) -> None:
        """Append a chunk of prompt logprobs: token p's logits score prompt token p + 1."""
        if chunk.first_index == 1 or parent.prompt_logprobs is None:
            parent.prompt_logprobs = [None]       # the first prompt token has no logprob
        for j in range(len(chunk.logprobs)):
            token = parent.prompt_token_ids[chunk.first_index + j]
            parent.prompt_logprobs.append(self.logprob_entry(token, chunk.logprobs[j], chunk.ranks[j],
                                                             chunk.top_ids[j], chunk.top_logprobs[j]))

    def logprob_entry(self, token: int, logprob: float, rank: int, top_ids: list[int],
                      top_logprobs: list[float]) -> dict:
        """{token: Logprob} for the chosen token plus the top-k, ranks 1..k in order (as vLLM)."""
        entry = {token: Logprob(logprob, rank, self._piece(token))}
        for r, (tid, tlp) in enumerate(zip(top_ids, top_logprobs), start=1):
            if tid == token:
                entry[tid].rank = r
            else:
                entry[tid] = Logprob(tlp, r, self._piece(tid))
        return entry

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _output(self, parent: _Parent) -> RequestOutput | None:
        kind = parent.params.output_kind
        finished = parent.num_unfinished == 0
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completions = []
        for i, s in enumerate(parent.samples):
            done = s.finish_reason is not None
            detok = s.detok
            if s.deferred_text:
                detok.add_tokens(s.token_ids[len(detok.token_ids):])
            with_logprobs = s.logprobs_k is not None
            if kind == RequestOutputKind.DELTA:
                if s.finished_sent:
                    continue
                text_end = detok.releasable_len(done)
                text = detok.output_text[s.sent_text:text_end]
                tokens = s.token_ids[s.sent_tokens:]
                logprobs = s.logprobs[s.sent_logprobs:] if with_logprobs else None
                if not text and not tokens and not done:
                    continue
                s.sent_text = max(s.sent_text, text_end)
                s.sent_tokens = len(s.token_ids)
                s.sent_logprobs = len(s.logprobs)
                s.finished_sent = done
            else:
                text = detok.output_text
                tokens = list(s.token_ids)
                logprobs = list(s.logprobs) if with_logprobs else None
            completions.append(CompletionOutput(
                index=i, text=text, token_ids=tokens,
                cumulative_logprob=s.cumulative_logprob if with_logprobs else None,
                logprobs=logprobs, finish_reason=s.finish_reason, stop_reason=s.stop_reason))
        if not completions and not finished:
            return None
        first = parent.samples[0]
        metrics = RequestMetrics(parent.arrival_time, None, first.first_token_time, first.last_token_time,
                                 first.last_token_time if finished else None)
        prompt_lps = None
        if parent.params.prompt_logprobs is not None and parent.prompt_logprobs:
            if kind != RequestOutputKind.DELTA or not parent.prompt_logprobs_sent:
                prompt_lps = list(parent.prompt_logprobs)
                parent.prompt_logprobs_sent = True
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, prompt_lps, completions,
                             finished, parent.num_cached_tokens, metrics)
