"""What the endpoints share: the server state, errors in OpenAI's shape, prompt checks, SSE framing, merging
the output streams of several prompts, cancelling on client disconnect, and logprob formatting."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Awaitable

import msgspec
from fastapi import Request
from fastapi.responses import StreamingResponse

from jaxpaged.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream
from jaxpaged.outputs import Logprob
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.server.protocol import ErrorInfo, ErrorResponse, PromptLogprob, PromptLogprobs
from jaxpaged.engine.detokenizer import bytes_to_unicode

logger = logging.getLogger("jaxpaged.server")


class APIError(Exception):
    """An error the client sees as {"error": {"message", "type", "param", "code"}} with this status."""

    def __init__(self, message: str, status_code: int = 400, err_type: str = "BadRequestError",
                 param: str | None = None):
        super().__init__(message)
        self.message, self.status_code, self.err_type, self.param = message, status_code, err_type, param

    def body(self) -> dict:
        return error_body(self.message, self.err_type, self.status_code, self.param)


# The error `type` of each status the server answers with (the openai client's exception names).
HTTP_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                    405: "MethodNotAllowed", 413: "RequestTooLargeError", 422: "BadRequestError",
                    503: "ServiceUnavailableError"}
# What a client sees of an unexpected exception: never its text or traceback, which stay in the log.
INTERNAL_ERROR_MESSAGE = "The server had an error while processing the request; its log has the details."


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict:
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=code)).model_dump()


def error_for(exc: BaseException) -> APIError:
    """Map an exception from the engine or the request checks to the error the client gets."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return APIError(str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(str(exc), 503, "ServiceUnavailableError")
    logger.error("request failed", exc_info=exc)
    return APIError(INTERNAL_ERROR_MESSAGE, 500, "InternalServerError")


@dataclasses.dataclass
class ServerState:
    llm: AsyncLLM
    served_model_names: list[str]
    chat_template: str | None = None        # --chat-template (file contents or the text)
    trust_request_chat_template: bool = False   # --trust-request-chat-template: a request's own template runs
    log_requests: bool = True
    owns_engine: bool = False               # shut the engine down with the app (run_server)

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        if model and model not in self.served_model_names:
            raise APIError(f"The model `{model}` does not exist.", 404, "NotFoundError", "model")

    def check_prompt(self, token_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """The engine's own checks (vLLM's wording for over-long prompts), run before anything streams."""
        if priority and self.llm.args.scheduling_policy != "priority":
            raise ValueError("priority is only supported with --scheduling-policy priority.")
        self.llm.input_processor.validate_prompt(token_ids, params)
        vocab = self.llm.vocab_size
        for tid in list(params.logit_bias or ()) + list(params.stop_token_ids or ()):
            if not 0 <= tid < vocab:
                raise ValueError(f"token id {tid} in logit_bias or stop_token_ids is out of vocabulary "
                                 f"(vocab size {vocab}).")

    def default_max_tokens(self, requested: int | None, num_prompt_tokens: int) -> int | None:
        """As vLLM: no max_tokens means up to the context length, here also no more than the KV cache holds
        (a pool smaller than max_model_len, which vLLM refuses at start-up), so such a request runs rather
        than being refused; at least 1, so an over-long prompt still gets the engine's check and message.
        The model's generation config's max_new_tokens (--generation-config) caps either."""
        tokens = requested if requested is not None else max(1, self.llm.input_processor.max_new_tokens(
            num_prompt_tokens))
        cap = self.default_sampling.get("max_tokens")
        return tokens if cap is None else min(tokens, cap)

    @property
    def default_sampling(self) -> dict:
        """The model's sampling defaults for the fields a request leaves unset (engine/generation_config.py)."""
        return self.llm.default_sampling

    def log_request(self, request_id: str, num_prompt_tokens: int, params: SamplingParams) -> None:
        if self.log_requests:
            logger.info("Received request %s: %d prompt tokens, n=%d, max_tokens=%s, temperature=%s",
                        request_id, num_prompt_tokens, params.n, params.max_tokens, params.temperature)


def load_chat_template(value: str | None) -> str | None:
    """--chat-template is a file path or the template text itself (as in vLLM)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


# ---- streams -----------------------------------------------------------------------------------
_encode_json = msgspec.json.Encoder().encode


def sse(payload: dict) -> bytes:
    """One server-sent event, `data: <JSON>`. msgspec writes UTF-8 as is (json.dumps' ensure_ascii=False) in a
    tenth of json.dumps' time: a server at full speed sends about ten thousand of these a second."""
    return b"data: " + _encode_json(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def sse_with_errors(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Frame a stream for the client: a failure after the 200 header sends an error chunk, and every
    stream that was not cut by the client ends with `data: [DONE]`."""
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk
    except Exception as exc:          # CancelledError (client gone) is not an Exception: it propagates
        err = error_for(exc)
        logger.warning("stream failed: %s", err.message)
        yield sse(err.body())
    yield SSE_DONE


_END = object()


class EngineStreamingResponse(StreamingResponse):
    """A streamed answer that owns its requests' engine streams (AsyncLLM.submit): however the response ends
    (its last chunk, the client gone, or never started because the client left first), every stream is closed,
    which aborts its request in the engine unless it finished."""

    def __init__(self, content: AsyncIterator[bytes], streams: list[RequestStream]):
        super().__init__(content, media_type="text/event-stream")
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close_streams(self.streams)


def close_streams(streams: list[RequestStream]) -> None:
    """Close engine streams (finished ones: nothing to do; the others' requests are aborted)."""
    for stream in streams:
        stream.close()


async def merge_outputs(gens: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Yield (prompt index, output) from several engine streams as they arrive. Closing this generator
    (or cancelling its consumer) closes every stream, which aborts their requests in the engine."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0]) as gen:
            async for item in gen:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def drain(i: int, gen: AsyncIterator) -> None:
        try:
            async with contextlib.aclosing(gen):
                async for item in gen:
                    queue.put_nowait((i, item))
            queue.put_nowait((i, _END))
        except Exception as exc:
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(drain(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def with_cancellation(work: Awaitable, request: Request):
    """Run a non-streaming handler, cancelling it (and so aborting its requests) if the client leaves.
    FastAPI has read the body already, so the next ASGI message is the disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        logger.info("client disconnected: request aborted")
        raise APIError("client disconnected", 499, "ClientClosedRequest")
    try:
        return task.result()
    except APIError:
        raise
    except Exception as exc:      # the engine's errors become OpenAI-shaped ones (503 for a dead loop)
        raise error_for(exc) from exc


# ---- logprobs ----------------------------------------------------------------------------------
def clamp(logprob: float) -> float:
    return max(logprob, -9999.0)      # -inf is not valid JSON; vLLM clamps the same way


def top_entries(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens of one position, by rank."""
    ranked = sorted(((tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k),
                    key=lambda item: item[1].rank)
    return ranked[:k]


def token_name(tokenizer, token_id: int, lp: Logprob | None, as_ids: bool = False) -> str:
    """A token as logprobs name it: its text (the detokenizer's piece, else decoded here), or vLLM's
    "token_id:<id>" under return_tokens_as_token_ids (for tokens whose text is no valid string alone)."""
    if as_ids:
        return f"token_id:{token_id}"
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id])


def format_prompt_logprobs(tokenizer, token_ids: list[int], prompt_logprobs: list[dict[int, Logprob] | None] | None,
                           k: int) -> PromptLogprobs:
    """vLLM's prompt_logprobs from the engine's: each prompt token's own entry and its top k by rank (the
    engine may hold more, when echo asked for more), -inf clamped; null for the first token."""
    out: PromptLogprobs = []
    for tid, entry in zip(token_ids, prompt_logprobs or [None] * len(token_ids)):
        if entry is None:
            out.append(None)
            continue
        keep = {tid: entry[tid], **dict(top_entries(entry, k))}
        out.append({str(t): PromptLogprob(logprob=clamp(lp.logprob), rank=lp.rank,
                                          decoded_token=token_name(tokenizer, t, lp))
                    for t, lp in keep.items()})
    return out


_BYTE_DECODER = bytes_to_unicode()   # printable stand-in character -> byte


def token_bytes(tokenizer, token_id: int, decoded: str) -> list[int]:
    """A token's raw UTF-8 bytes: exact for byte-level BPE (a token may hold part of a character),
    else the bytes of its decoded text."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str) and piece and all(ch in _BYTE_DECODER for ch in piece):
        return [_BYTE_DECODER[ch] for ch in piece]
    return list(decoded.encode("utf-8"))
