"""POST /v1/chat/completions: the chat template turns messages into one prompt; n samples; SSE or whole."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from jaxpaged.outputs import Logprob
from jaxpaged.server.protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
                                      ChatMessage, ChatResponseMessage, ChatTokenLogprob, TopLogprob, UsageInfo)
from jaxpaged.server.serving import (APIError, EngineStreamingResponse, ServerState, clamp, format_prompt_logprobs,
                                     merge_outputs, sse, sse_with_errors, token_bytes, token_name, top_entries,
                                     with_cancellation)


def apply_chat_template(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool = True,
                        template: str | None = None, kwargs: dict | None = None,
                        continue_final_message: bool = False) -> str:
    """messages -> prompt text with the request's template, else --chat-template, else the tokenizer's.
    continue_final_message: the text ends inside the last message (no end-of-turn after it, and so no
    generation prompt, whatever add_generation_prompt says)."""
    template = template or state.chat_template
    tok = state.tokenizer
    if template is None and not getattr(tok, "chat_template", None):
        raise APIError("This model's tokenizer has no chat template: start the server with --chat-template.")
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    kwargs = {**(kwargs or {}), **({"continue_final_message": True} if continue_final_message else {})}
    try:
        return tok.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                       add_generation_prompt=add_generation_prompt and not continue_final_message,
                                       **kwargs)
    except Exception as e:           # a Jinja error in a user-supplied template is the client's to fix
        raise APIError(f"could not apply the chat template: {e}") from None


def chat_prompt_ids(state: ServerState, prompt: str, add_special_tokens: bool = False) -> list[int]:
    # the template already holds any BOS: don't add special tokens twice (as LLM.chat does), unless asked
    return state.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)


def format_chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, Logprob]],
                         k: int, as_ids: bool = False) -> ChatLogprobs:
    """as_ids: return_tokens_as_token_ids ("token_id:<id>", and that string's bytes, as vLLM)."""
    def entry_of(tid: int, lp: Logprob) -> tuple[str, list[int]]:
        token = token_name(tokenizer, tid, lp, as_ids)
        return token, list(token.encode("utf-8")) if as_ids else token_bytes(tokenizer, tid, token)

    content = []
    for tid, entry in zip(token_ids, logprobs):
        lp = entry[tid]
        token, raw = entry_of(tid, lp)
        top = []
        for top_id, t in top_entries(entry, k):
            name, name_bytes = entry_of(top_id, t)
            top.append(TopLogprob(token=name, logprob=clamp(t.logprob), bytes=name_bytes))
        content.append(ChatTokenLogprob(token=token, logprob=clamp(lp.logprob), bytes=raw, top_logprobs=top))
    return ChatLogprobs(content=content)


def response_role(request: ChatCompletionRequest) -> str:
    """As vLLM: the reply is the assistant's after a generation prompt, else it goes on in the last
    message's role (continue_final_message, or a template left open)."""
    return "assistant" if _generation_prompt(request) else request.messages[-1].role


def _generation_prompt(request: ChatCompletionRequest) -> bool:
    return request.add_generation_prompt and not request.continue_final_message


def echo_prefix(request: ChatCompletionRequest) -> str:
    """echo: the last message's text starts each reply when that message is in the reply's role."""
    last = request.messages[-1]
    return last.text() if request.echo and last.role == response_role(request) else ""


def _template_and_tokenize(state: ServerState, request: ChatCompletionRequest) -> tuple[str, list[int]]:
    prompt = apply_chat_template(state, request.messages, request.add_generation_prompt, request.chat_template,
                                 request.chat_template_kwargs, request.continue_final_message)
    token_ids = chat_prompt_ids(state, prompt, request.add_special_tokens)
    kept = request.truncate(token_ids, state.llm.max_model_len)
    return (prompt if len(kept) == len(token_ids) else state.tokenizer.decode(kept)), kept


async def create_chat_completion(state: ServerState, request: ChatCompletionRequest, raw: Request):
    state.check_model(request.model)
    kwargs = request.chat_template_kwargs or {}
    if not state.trust_request_chat_template and (request.chat_template or kwargs.get("chat_template")):
        # a template is code the server runs: one line of Jinja can hold the API process for minutes or
        # take all its memory, so only a server started to trust its clients runs theirs (as vLLM)
        raise APIError("Chat template is passed with request, but --trust-request-chat-template is not set. "
                       "Refused request with untrusted chat template.", param="chat_template")
    try:      # templating and tokenizing long conversations on a worker thread: the event loop streams on
        size = sum(len(m.text()) for m in request.messages)
        prompt, token_ids = await state.llm.off_loop(size, lambda: _template_and_tokenize(state, request))
        requested = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        params = request.to_sampling_params(state.default_max_tokens(requested, len(token_ids)),
                                            state.default_sampling)
        state.check_prompt(token_ids, params, request.priority)
    except ValueError as e:
        raise APIError(str(e)) from None
    engine_id, request_id = request.ids("chatcmpl")
    state.log_request(engine_id, len(token_ids), params)
    # in the engine from here (serving_completion.py says why)
    stream = state.llm.submit({"prompt": prompt, "prompt_token_ids": token_ids}, params, engine_id,
                              priority=request.priority)
    if request.stream:
        return EngineStreamingResponse(sse_with_errors(_stream(state, request, request_id, len(token_ids), stream)),
                                       [stream])
    try:
        response = await with_cancellation(_full(state, request, request_id, token_ids, stream), raw)
    finally:
        stream.close()
    return JSONResponse(response.model_dump())


def _top_k(request: ChatCompletionRequest) -> int:
    return request.top_logprobs or 0


async def _full(state: ServerState, request: ChatCompletionRequest, request_id: str, prompt_ids: list[int],
                gen) -> ChatCompletionResponse:
    final = None
    async for _, out in merge_outputs([gen]):
        if out.finished:
            final = out
    role, prefix = response_role(request), echo_prefix(request)
    choices = []
    for comp in sorted(final.outputs, key=lambda c: c.index):
        logprobs = None
        if request.logprobs:
            logprobs = format_chat_logprobs(state.tokenizer, comp.token_ids, comp.logprobs or [], _top_k(request),
                                            request.return_tokens_as_token_ids)
        choices.append(ChatChoice(index=comp.index, message=ChatResponseMessage(role=role, content=prefix + comp.text),
                                  logprobs=logprobs, finish_reason=comp.finish_reason,
                                  stop_reason=comp.stop_reason))
    prompt_lps = None
    if request.prompt_logprobs is not None:
        prompt_lps = format_prompt_logprobs(state.tokenizer, prompt_ids, final.prompt_logprobs,
                                            request.prompt_logprobs)
    num_prompt, num_gen = len(prompt_ids), sum(len(c.token_ids) for c in final.outputs)
    return ChatCompletionResponse(id=request_id, model=state.model_name, choices=choices,
                                  usage=UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_gen,
                                                  total_tokens=num_prompt + num_gen), prompt_logprobs=prompt_lps)


async def _stream(state: ServerState, request: ChatCompletionRequest, request_id: str, num_prompt: int,
                  gen) -> AsyncIterator[bytes]:
    created = int(time.time())
    num_gen = 0

    def chunk(choices: list[dict], usage: UsageInfo | None = None) -> bytes:
        body = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": state.model_name, "choices": choices}
        if usage is not None:
            body["usage"] = usage.model_dump()
        return sse(body)

    def usage_now() -> UsageInfo:
        return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_gen, total_tokens=num_prompt + num_gen)

    # The first delta of every choice carries the role (as OpenAI and vLLM send it), then echo's text.
    yield chunk([{"index": i, "delta": {"role": response_role(request), "content": ""}, "logprobs": None,
                  "finish_reason": None} for i in range(request.n)])
    prefix = echo_prefix(request)
    if prefix:
        yield chunk([{"index": i, "delta": {"content": prefix}, "logprobs": None, "finish_reason": None}
                     for i in range(request.n)])
    continuous = request.include_usage and request.stream_options.continuous_usage_stats
    async for _, out in merge_outputs([gen]):
        choices = []
        for comp in out.outputs:
            num_gen += len(comp.token_ids)
            if not comp.text and not comp.token_ids and comp.finish_reason is None:
                continue
            logprobs = None
            if request.logprobs:
                logprobs = format_chat_logprobs(state.tokenizer, comp.token_ids, comp.logprobs or [],
                                                _top_k(request), request.return_tokens_as_token_ids).model_dump()
            delta = {"content": comp.text} if comp.text or comp.finish_reason is None else {}
            choices.append({"index": comp.index, "delta": delta, "logprobs": logprobs,
                            "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason})
        if choices:
            yield chunk(choices, usage_now() if continuous else None)
    if request.include_usage:
        yield chunk([], usage_now())
