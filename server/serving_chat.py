"""POST /v1/chat/completions: the chat template turns messages into one prompt; n samples; SSE or whole."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from jaxpaged.outputs import Logprob
from jaxpaged.server.protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
                                      ChatMessage, ChatResponseMessage, ChatTokenLogprob, TopLogprob, UsageInfo,
                                      random_id)
from jaxpaged.server.serving import (APIError, ServerState, clamp, merge_outputs, sse, sse_with_errors,
                                     token_bytes, top_entries, with_cancellation)


def apply_chat_template(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool = True,
                        template: str | None = None, kwargs: dict | None = None) -> str:
    """messages -> prompt text with the request's template, else --chat-template, else the tokenizer's."""
    template = template or state.chat_template
    tok = state.tokenizer
    if template is None and not getattr(tok, "chat_template", None):
        raise APIError("This model's tokenizer has no chat template: start the server with --chat-template.")
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        return tok.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                       add_generation_prompt=add_generation_prompt, **(kwargs or {}))
    except Exception as e:           # a Jinja error in a user-supplied template is the client's to fix
        raise APIError(f"could not apply the chat template: {e}") from None


def chat_prompt_ids(state: ServerState, prompt: str) -> list[int]:
    # the template already holds any BOS: don't add special tokens twice (as LLM.chat does)
    return state.tokenizer.encode(prompt, add_special_tokens=False)


def format_chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, Logprob]],
                         k: int) -> ChatLogprobs:
    content = []
    for tid, entry in zip(token_ids, logprobs):
        lp = entry[tid]
        token = lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([tid])
        top = [TopLogprob(token=t.decoded_token or "", logprob=clamp(t.logprob),
                          bytes=token_bytes(tokenizer, top_id, t.decoded_token or ""))
               for top_id, t in top_entries(entry, k)]
        content.append(ChatTokenLogprob(token=token, logprob=clamp(lp.logprob),
                                        bytes=token_bytes(tokenizer, tid, token), top_logprobs=top))
    return ChatLogprobs(content=content)


def _template_and_tokenize(state: ServerState, request: ChatCompletionRequest) -> tuple[str, list[int]]:
    prompt = apply_chat_template(state, request.messages, request.add_generation_prompt, request.chat_template,
                                 request.chat_template_kwargs)
    return prompt, chat_prompt_ids(state, prompt)


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
        params = request.to_sampling_params(state.default_max_tokens(requested, len(token_ids)))
        state.check_prompt(token_ids, params, request.priority)
    except ValueError as e:
        raise APIError(str(e)) from None
    request_id = random_id("chatcmpl")
    state.log_request(request_id, len(token_ids), params)
    gen = state.llm.generate({"prompt": prompt, "prompt_token_ids": token_ids}, params, request_id,
                             priority=request.priority)
    if request.stream:
        chunks = _stream(state, request, request_id, len(token_ids), gen)
        return StreamingResponse(sse_with_errors(chunks), media_type="text/event-stream")
    response = await with_cancellation(_full(state, request, request_id, len(token_ids), gen), raw)
    return JSONResponse(response.model_dump())


def _top_k(request: ChatCompletionRequest) -> int:
    return request.top_logprobs or 0


async def _full(state: ServerState, request: ChatCompletionRequest, request_id: str, num_prompt: int,
                gen) -> ChatCompletionResponse:
    final = None
    async for _, out in merge_outputs([gen]):
        if out.finished:
            final = out
    choices = []
    for comp in sorted(final.outputs, key=lambda c: c.index):
        logprobs = None
        if request.logprobs:
            logprobs = format_chat_logprobs(state.tokenizer, comp.token_ids, comp.logprobs or [], _top_k(request))
        choices.append(ChatChoice(index=comp.index, message=ChatResponseMessage(content=comp.text),
                                  logprobs=logprobs, finish_reason=comp.finish_reason,
                                  stop_reason=comp.stop_reason))
    num_gen = sum(len(c.token_ids) for c in final.outputs)
    return ChatCompletionResponse(id=request_id, model=state.model_name, choices=choices,
                                  usage=UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_gen,
                                                  total_tokens=num_prompt + num_gen))


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

    # The first delta of every choice carries the role (as OpenAI and vLLM send it).
    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for i in range(request.n)])
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
                                                _top_k(request)).model_dump()
            delta = {"content": comp.text} if comp.text or comp.finish_reason is None else {}
            choices.append({"index": comp.index, "delta": delta, "logprobs": logprobs,
                            "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason})
        if choices:
            yield chunk(choices, usage_now() if continuous else None)
    if request.include_usage:
        yield chunk([], usage_now())
