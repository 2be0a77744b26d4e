"""POST /v1/completions: one engine request per prompt, n samples each; streamed as SSE or returned whole."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from jaxpaged.outputs import CompletionOutput, Logprob
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.server.protocol import (CompletionChoice, CompletionLogProbs, CompletionRequest, CompletionResponse,
                                      UsageInfo)
from jaxpaged.server.serving import (APIError, EngineStreamingResponse, ServerState, clamp, close_streams,
                                     format_prompt_logprobs, merge_outputs, sse, sse_with_errors, token_name,
                                     top_entries, with_cancellation)


def _prompts(request: CompletionRequest) -> list[str | list[int]]:
    """OpenAI's four prompt shapes -> a list of prompts (text or token ids)."""
    p = request.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise APIError("prompt cannot be empty", param="prompt")
    if isinstance(p[0], int):
        return [p]
    return list(p)


class _Prepared:
    """One prompt, tokenized and checked, with its sampling params."""

    def __init__(self, state: ServerState, request: CompletionRequest, prompt: str | list[int]):
        text, token_ids = state.llm.input_processor.tokenize_prompt(prompt, request.add_special_tokens)
        self.token_ids = request.truncate(token_ids, state.llm.max_model_len)
        if len(self.token_ids) < len(token_ids):
            text = None                        # what runs (and what echo shows) is the kept tail
        self.params: SamplingParams = request.to_sampling_params(
            state.default_max_tokens(request.max_tokens, len(self.token_ids)), state.default_sampling)
        state.check_prompt(self.token_ids, self.params, request.priority)
        # token prompts' text is read only to echo it (as vLLM, the output's prompt is None otherwise), and
        # only once their ids are known to be in the vocabulary
        self.text = text if text is not None or not request.echo else state.tokenizer.decode(self.token_ids)
        if request.echo and request.logprobs is not None:     # echo scores the prompt tokens too
            self.params.prompt_logprobs = max(request.logprobs, request.prompt_logprobs or 0)


def format_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, Logprob] | None], k: int,
                    offset: int, as_ids: bool = False) -> CompletionLogProbs:
    """OpenAI completions logprobs; `offset` is where these tokens' text starts in the choice's text. A None
    entry (the prompt's first token under echo) gets null logprobs, as OpenAI's legacy API. as_ids:
    return_tokens_as_token_ids (text offsets still count the tokens' text)."""
    out = CompletionLogProbs()
    for tid, entry in zip(token_ids, logprobs):
        lp = entry[tid] if entry is not None else None
        text = token_name(tokenizer, tid, lp)
        token = token_name(tokenizer, tid, lp, as_ids=True) if as_ids else text
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(text)
        if lp is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(clamp(lp.logprob))
        top = {token: clamp(lp.logprob)}
        for top_id, top_lp in top_entries(entry, k):
            top.setdefault(token_name(tokenizer, top_id, top_lp, as_ids), clamp(top_lp.logprob))
        out.top_logprobs.append(top)
    return out


def _with_prompt(prompt_lps: CompletionLogProbs, completion: CompletionLogProbs) -> CompletionLogProbs:
    return CompletionLogProbs(
        text_offset=prompt_lps.text_offset + completion.text_offset,
        token_logprobs=prompt_lps.token_logprobs + completion.token_logprobs,
        tokens=prompt_lps.tokens + completion.tokens,
        top_logprobs=prompt_lps.top_logprobs + completion.top_logprobs)


async def create_completion(state: ServerState, request: CompletionRequest, raw: Request):
    state.check_model(request.model)
    prompts = _prompts(request)
    try:      # long prompts are tokenized (token prompts' text decoded) on a worker thread: the loop streams on
        prepared = await state.llm.off_loop(sum(map(len, prompts)),
                                            lambda: [_Prepared(state, request, p) for p in prompts])
    except ValueError as e:
        raise APIError(str(e)) from None
    engine_id, request_id = request.ids("cmpl")
    # Each prompt reaches the engine here, in this handler's turn of the event loop: a burst's first requests are
    # then in the engine while the rest are still being parsed (a stream read lazily would send its request only
    # after every handler queued before it had run).
    streams = []
    try:
        for i, prep in enumerate(prepared):
            rid = engine_id if len(prepared) == 1 else f"{engine_id}-{i}"
            state.log_request(rid, len(prep.token_ids), prep.params)
            streams.append(state.llm.submit({"prompt": prep.text, "prompt_token_ids": prep.token_ids},
                                            prep.params, rid, priority=request.priority))
    except BaseException:
        close_streams(streams)
        raise
    if request.stream:
        return EngineStreamingResponse(sse_with_errors(_stream(state, request, request_id, prepared, streams)),
                                       streams)
    try:
        response = await with_cancellation(_full(state, request, request_id, prepared, streams), raw)
    finally:
        close_streams(streams)
    return JSONResponse(response.model_dump())


async def _full(state: ServerState, request: CompletionRequest, request_id: str, prepared: list[_Prepared],
                gens: list) -> CompletionResponse:
    finals = {}
    async for i, out in merge_outputs(gens):
        if out.finished:
            finals[i] = out
    n, as_ids = request.n, request.return_tokens_as_token_ids
    choices = []
    for i, prep in enumerate(prepared):
        prompt_lps = None
        if request.prompt_logprobs is not None:
            prompt_lps = format_prompt_logprobs(state.tokenizer, prep.token_ids, finals[i].prompt_logprobs,
                                                request.prompt_logprobs)
        for comp in sorted(finals[i].outputs, key=lambda c: c.index):
            prefix = prep.text if request.echo else ""
            logprobs = None
            if request.logprobs is not None:
                logprobs = format_logprobs(state.tokenizer, comp.token_ids, comp.logprobs or [],
                                           request.logprobs, len(prefix), as_ids)
                if request.echo:
                    echoed = finals[i].prompt_logprobs or [None] * len(prep.token_ids)
                    logprobs = _with_prompt(format_logprobs(state.tokenizer, prep.token_ids, echoed,
                                                            request.logprobs, 0, as_ids), logprobs)
            choices.append(CompletionChoice(index=i * n + comp.index, text=prefix + comp.text, logprobs=logprobs,
                                            finish_reason=comp.finish_reason, stop_reason=comp.stop_reason,
                                            prompt_logprobs=prompt_lps))
    num_prompt = sum(len(p.token_ids) for p in prepared)
    num_gen = sum(len(c.token_ids) for out in finals.values() for c in out.outputs)
    return CompletionResponse(id=request_id, model=state.model_name, choices=choices,
                              usage=UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_gen,
                                              total_tokens=num_prompt + num_gen))


async def _stream(state: ServerState, request: CompletionRequest, request_id: str, prepared: list[_Prepared],
                  gens: list) -> AsyncIterator[bytes]:
    created = int(time.time())
    n = request.n
    text_len: dict[int, int] = {}          # choice index -> characters sent so far (for text_offset)
    num_gen = 0
    num_prompt = sum(len(p.token_ids) for p in prepared)

    def chunk(choices: list[dict], usage: UsageInfo | None = None) -> bytes:
        body = {"id": request_id, "object": "text_completion", "created": created, "model": state.model_name,
                "choices": choices}
        if usage is not None:
            body["usage"] = usage.model_dump()
        return sse(body)

    async for i, out in merge_outputs(gens):
        choices = []
        for comp in out.outputs:
            index = i * n + comp.index
            text = comp.text
            if index not in text_len:                  # the first piece of this choice: echo the prompt
                text_len[index] = 0
                if request.echo:
                    text = prepared[i].text + text
            choices.append(_stream_choice(state, request, index, comp, text, text_len))
            num_gen += len(comp.token_ids)
        if choices:
            usage = None
            if request.include_usage and request.stream_options.continuous_usage_stats:
                usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_gen,
                                  total_tokens=num_prompt + num_gen)
            yield chunk(choices, usage)
    if request.include_usage:
        yield chunk([], UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_gen,
                                  total_tokens=num_prompt + num_gen))


def _stream_choice(state: ServerState, request: CompletionRequest, index: int, comp: CompletionOutput,
                   text: str, text_len: dict[int, int]) -> dict:
    logprobs = None
    if request.logprobs is not None:
        logprobs = format_logprobs(state.tokenizer, comp.token_ids, comp.logprobs or [], request.logprobs,
                                   text_len[index] + len(text) - len(comp.text),
                                   request.return_tokens_as_token_ids).model_dump()
    text_len[index] += len(text)
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": comp.finish_reason,
            "stop_reason": comp.stop_reason}
