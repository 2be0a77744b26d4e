"""Turns per-child engine progress into vLLM's RequestOutputs: detokenizes, applies stop strings, gathers
the n samples of a parent request, and computes streaming deltas."""
from __future__ import annotations

import dataclasses

from jaxpaged.engine.detokenizer import IncrementalDetokenizer
from jaxpaged.engine.request import Request
from jaxpaged.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams


@dataclasses.dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request]
    detoks: list[IncrementalDetokenizer]
    sent_text: list[int]              # characters already streamed, per child (DELTA mode)
    sent_tokens: list[int]
    sent_logprobs: list[int]
    finished_sent: list[bool]
    prompt_logprobs_sent: bool = False


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        self.child_to_parent: dict[str, tuple[_Parent, int]] = {}

    def add(self, request_id, prompt, prompt_token_ids, params, children, detoks) -> None:
        n = len(children)
        parent = _Parent(request_id, prompt, prompt_token_ids, params, children, detoks,
                         [0] * n, [0] * n, [0] * n, [False] * n)
        self.parents[request_id] = parent
        for i, c in enumerate(children):
            self.child_to_parent[c.request_id] = (parent, i)

    def children_of(self, request_id: str) -> list[Request]:
        parent = self.parents.get(request_id)
        return list(parent.children) if parent else []

    def drop(self, request_id: str) -> None:
        parent = self.parents.pop(request_id, None)
        if parent:
            for c in parent.children:
                self.child_to_parent.pop(c.request_id, None)

    def detokenize(self, req: Request) -> str | None:
        """Feed the newest token to the child's detokenizer; returns a completed stop string or None."""
        parent, i = self.child_to_parent[req.request_id]
        match = parent.detoks[i].add_tokens(req.output_token_ids[-1:])
        return None if match is None else match.stop

    def record_logprobs(self, req: Request, token: int, result, row: int) -> None:
        k = req.sampling_params.logprobs
        lp = float(result.logprobs[row])
        req.logprobs.append(self.logprob_entry(token, lp, int(result.ranks[row]), result.top_ids[row][:k],
                                               result.top_logprobs[row][:k]))
        req.cumulative_logprob += lp

    def logprob_entry(self, token: int, logprob: float, rank: int, top_ids, top_logprobs) -> dict:
        """{token: Logprob} for the chosen token plus the top-k, ranks 1..k in order (as vLLM)."""
        entry = {token: Logprob(logprob, rank, self._piece(token))}
        for r, (tid, tlp) in enumerate(zip(top_ids.tolist(), top_logprobs.tolist()), start=1):
            if tid == token:
                entry[tid].rank = r
            else:
                entry[tid] = Logprob(float(tlp), r, self._piece(tid))
        return entry

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def make_outputs(self, touched: list[Request]) -> list[RequestOutput]:
        seen: dict[str, _Parent] = {}
        for req in touched:
            if req.request_id in self.child_to_parent:
                parent, _ = self.child_to_parent[req.request_id]
                seen[parent.request_id] = parent      # (FINAL_ONLY requests come only once finished)
        outputs = []
        for parent in seen.values():
            out = self._output(parent)
            if out is not None:
                outputs.append(out)
            if out is not None and out.finished:
                self.drop(parent.request_id)
        return outputs

    def _output(self, parent: _Parent) -> RequestOutput | None:
        kind = parent.params.output_kind
        finished = all(c.is_finished for c in parent.children)
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completions = []
        for i, (child, detok) in enumerate(zip(parent.children, parent.detoks)):
            done = child.is_finished
            if child.deferred_text:
                detok.add_tokens(child.output_token_ids[len(detok.token_ids):])
            if kind == RequestOutputKind.DELTA:
                if parent.finished_sent[i]:
                    continue
                text_end = detok.releasable_len(done)
                text = detok.output_text[parent.sent_text[i]:text_end]
                tokens = child.output_token_ids[parent.sent_tokens[i]:]
                logprobs = (child.logprobs[parent.sent_logprobs[i]:]
                            if child.sampling_params.logprobs is not None else None)
                if not text and not tokens and not done:
                    continue
                parent.sent_text[i] = max(parent.sent_text[i], text_end)
                parent.sent_tokens[i] = child.num_output_tokens
                parent.sent_logprobs[i] = len(child.logprobs)
                parent.finished_sent[i] = done
            else:
                text = detok.output_text
                tokens = list(child.output_token_ids)
                logprobs = list(child.logprobs) if child.sampling_params.logprobs is not None else None
            completions.append(CompletionOutput(
                index=i, text=text, token_ids=tokens,
                cumulative_logprob=child.cumulative_logprob if child.sampling_params.logprobs is not None else None,
                logprobs=logprobs, finish_reason=child.status.finish_reason, stop_reason=child.stop_reason))
        if not completions and not finished:
            return None
        first = parent.children[0]
        metrics = RequestMetrics(first.arrival_time, first.first_scheduled_time, first.first_token_time,
                                 first.last_token_time, first.last_token_time if finished else None)
        prompt_lps = None
        if parent.params.prompt_logprobs is not None and first.prompt_logprobs:
            if kind != RequestOutputKind.DELTA or not parent.prompt_logprobs_sent:
                prompt_lps = list(first.prompt_logprobs)
                parent.prompt_logprobs_sent = True
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, prompt_lps, completions,
                             finished, max(first.num_cached_tokens, 0), metrics)
