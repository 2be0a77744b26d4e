"""AsyncLLM: the server's engine. The API half runs here, on the asyncio loop; the engine core runs in its
own process (core_client.py), so its loop never waits on this process's GIL.

Per request: tokenize off the event loop (a thread: a huge prompt never stalls other streams), check
(InputProcessor), send the core one EngineCoreRequest per sample, and stream RequestOutputs from a
per-request queue. One task per loop reads the core's per-step messages and runs them through the
OutputProcessor (detokenization, stop strings: the core is told to abort a sample a stop string ended), in
chunks with a yield between, so streaming never waits on a whole large step. A consumer that falls behind
takes what has queued up as one output (deltas concatenated, or the latest cumulative one), as vLLM's
output collector does.

If the core process dies, every in-flight request gets EngineDeadError, `errored` turns true (/health 503)
and `on_dead` is called (the server exits non-zero).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

from jaxpaged.config import EngineArgs
from jaxpaged.engine.model_path import resolve_model_path
from jaxpaged.engine.generation_config import default_sampling_fields
from jaxpaged.engine.core_client import CoreChannel, CoreProcClient, EngineDeadError, run_core_process
from jaxpaged.engine.detokenizer import prepare as prepare_detokenizer
from jaxpaged.engine.input_processor import InputProcessor, PromptType
from jaxpaged.engine.messages import CoreFailure, CoreStats, EngineCoreOutputs
from jaxpaged.engine.output_processor import OutputProcessor
from jaxpaged.outputs import CompletionOutput, RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("jaxpaged.async_llm")

__all__ = ["AsyncLLM", "EngineDeadError", "RequestStream", "merge_delta"]

# Core outputs processed between two yields to the event loop (vLLM's VLLM_V1_OUTPUT_PROC_CHUNK_SIZE).
OUTPUT_CHUNK = 128
# Prompts longer than this (characters) are tokenized on a worker thread, not on the event loop.
OFFLOAD_CHARS = 2048


class AsyncLLM:
    def __init__(self, args: EngineArgs, core_target=run_core_process, client: CoreChannel | None = None):
        """client: this process's end of the core connection; by default a CoreProcClient, which starts the
        core (running core_target). An extra API process (--api-server-count) passes its CoreChannel."""
        self.args = args
        # A GGUF file converts here, once, before the core reads its folder (both converting it would hold
        # the dequantized weights twice); for a folder this returns at once.
        model_path = resolve_model_path(args.model, args.quantization)
        # The core starts first: it loads and compiles while this process imports transformers (seconds:
        # it brings torch) and loads the tokenizer.
        self.client = CoreProcClient(args, core_target) if client is None else client
        try:
            from jaxpaged.engine.tokenizer import load_tokenizer
            self.tokenizer = load_tokenizer(args.tokenizer or model_path)
            prepare_detokenizer(self.tokenizer)
            self.info = self.client.wait_ready()
        except BaseException:
            self.client.shutdown()
            raise
        self.input_processor = InputProcessor(self.tokenizer, self.info, args.seed, self.client.client_index)
        # the model's sampling defaults (--generation-config), for the fields a request leaves unset
        self.default_sampling = default_sampling_fields(self.info.model_path, args.generation_config,
                                                        args.override_generation_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.request_stats = self.output_processor.stats
        self.core_stats = CoreStats(num_free_blocks=self.info.num_blocks - 1)   # until the first step's
        self.dead_error: BaseException | None = None
        self.on_dead: Callable[[], None] | None = None
        self.last_progress = time.time()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._output_task: asyncio.Task | None = None
        self._workers = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="jaxpaged-tokenize")
        self._watcher = threading.Thread(target=self._watch_core, name="jaxpaged-core-watch", daemon=True)
        self._watcher.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "AsyncLLM":
        return cls(args)

    # what the server shows of the core
    @property
    def model_path(self) -> str:
        return self.info.model_path

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop reading the core's outputs (start())."""
        return self._loop

    # ---- health -------------------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def is_healthy(self, stall_seconds: float = 120.0) -> bool:
        """False when the core died, or has requests in flight but sent nothing for stall_seconds."""
        if self.errored:
            return False
        return not self._streams or time.time() - self.last_progress < stall_seconds

    def _watch_core(self) -> None:
        why = self.client.wait_lost()
        if not self.client.shutting_down:
            err = EngineDeadError(why)
            loop = self._loop
            if loop is not None and not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(self._fail, err)
                    return
                except RuntimeError:
                    pass         # the loop closed in between
            self._fail(err)

    def _fail(self, err: BaseException) -> None:
        if self.dead_error is not None:
            return
        logger.error("engine core failed: %s", err)
        self.dead_error = err
        for q in self._streams.values():
            q.put_nowait(EngineDeadError(str(err)))
        if self.on_dead is not None:
            self.on_dead()

    # ---- the output task ----------------------------------------------------------------------
    def start(self) -> None:
        """Read the core's outputs on the running loop (called by generate; the server calls it at start-up)."""
        loop = asyncio.get_running_loop()
        if self._output_task is not None and self._loop is loop and not self._output_task.done():
            return
        self._loop = loop
        self._output_task = loop.create_task(self._read_outputs(), name="jaxpaged-core-outputs")

    async def _read_outputs(self) -> None:
        sock = self.client.output_socket()
        decode = self.client.decode
        op, streams = self.output_processor, self._streams
        try:
            while True:
                msg = decode(await sock.recv())
                if isinstance(msg, CoreFailure):
                    self._fail(EngineDeadError(f"the engine core failed: {msg.error}"))
                    return
                if not isinstance(msg, EngineCoreOutputs):
                    continue
                self.last_progress = time.time()
                if msg.stats is not None:
                    self.core_stats = msg.stats
                outs = msg.outputs
                for i in range(0, len(outs), OUTPUT_CHUNK):
                    request_outputs, to_abort = op.process(outs[i:i + OUTPUT_CHUNK])
                    self.client.abort_requests(to_abort)
                    for out in request_outputs:
                        q = streams.get(out.request_id)
                        if q is not None:
                            q.put_nowait(out)
                    if i + OUTPUT_CHUNK < len(outs):
                        await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except BaseException as e:   # a bug here is as fatal as the core dying: fail loudly, not hang
            logger.exception("reading the engine core's outputs failed")
            self._fail(EngineDeadError(f"reading the engine core's outputs failed: {e!r}"))

    # ---- requests -----------------------------------------------------------------------------
    async def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """InputProcessor.tokenize_prompt, on a worker thread for long text."""
        text = prompt.get("prompt") if isinstance(prompt, dict) and "prompt_token_ids" not in prompt else prompt
        size = len(text) if isinstance(text, str) else 0
        return await self.off_loop(size, lambda: self.input_processor.tokenize_prompt(prompt))

    async def off_loop(self, size: int, fn):
        """fn() on a worker thread when its input is large (size: characters or tokens), else here: a thread
        hop costs more than tokenizing a short prompt, and a long one must not stall the event loop."""
        if size > OFFLOAD_CHARS:
            return await self.run_blocking(fn)
        return fn()

    async def run_blocking(self, fn, *args):
        """fn(*args) on a worker thread (tokenizing, chat templating), so the event loop keeps streaming."""
        return await asyncio.get_running_loop().run_in_executor(self._workers, fn, *args)

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yields RequestOutputs as tokens arrive (deltas when sampling_params.output_kind is DELTA).
        Raises ValueError for invalid requests before anything is sent to the core. The request reaches the
        core at this generator's first iteration; submit() sends it at once."""
        self._check_alive()
        text, token_ids = await self.tokenize(prompt)
        async with contextlib.aclosing(self._add(text, token_ids, sampling_params, request_id, priority)) as stream:
            async for out in stream:
                yield out

    def submit(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str,
               priority: int = 0) -> "RequestStream":
        """generate() for a prompt tokenized already ({"prompt_token_ids": ..., "prompt": its text}), sent to the
        core now, in the caller's turn of the event loop, rather than when its stream is first read: a server's
        handler submits while a burst's other requests still wait to be parsed, where a lazy generator's first
        read waits behind all of them. The caller owns the returned stream: read it to its end or aclose() it,
        also if it is never read (close() is the same, synchronous). Raises as generate() does."""
        self._check_alive()
        text, token_ids = self.input_processor.tokenize_prompt(prompt)
        return self._add(text, token_ids, sampling_params, request_id, priority)

    def _check_alive(self) -> None:
        self.start()
        if self.errored:
            raise EngineDeadError(f"the engine core is gone: {self.dead_error}")

    def _add(self, text: str | None, token_ids: list[int], sampling_params: SamplingParams, request_id: str,
             priority: int) -> "RequestStream":
        token_ids = self.input_processor.truncate(token_ids, sampling_params)
        self.input_processor.validate_prompt(token_ids, sampling_params)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        reqs = self.input_processor.make_requests(request_id, token_ids, sampling_params, priority=priority)
        self.client.add_requests(reqs)       # raises EngineDeadError if the core is gone; outputs come later,
        q: asyncio.Queue = asyncio.Queue()   # on this loop, so registering the request after it is safe
        self._streams[request_id] = q
        self.output_processor.add(request_id, text, token_ids, sampling_params, [r.request_id for r in reqs],
                                  reqs[0].arrival_time)
        return RequestStream(self, request_id, q, sampling_params.output_kind == RequestOutputKind.DELTA)

    def _release(self, request_id: str, finished: bool) -> None:
        """A stream's end: its queue goes; unless the request finished, the core aborts it (the client went away,
        cancelled, or never read it)."""
        self._streams.pop(request_id, None)
        if not finished:
            self.client.abort_requests(self.output_processor.abort(request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request: its stream ends with finish_reason "abort", its blocks are freed in the core."""
        self._abort(request_id)

    def abort_all(self) -> None:
        """Abort every request in flight (a draining shutdown's end): each stream ends with "abort"."""
        for rid in list(self._streams):
            self._abort(rid)

    def _abort(self, request_id: str) -> None:
        op = self.output_processor
        sample_ids = op.sample_ids(request_id)
        out = op.finish_aborted(request_id)
        q = self._streams.get(request_id)
        if out is not None and q is not None:
            q.put_nowait(out)
        self.client.abort_requests(sample_ids)

    def shutdown(self) -> None:
        if self._output_task is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._output_task.cancel)
        self.client.shutdown()
        self._workers.shutdown(wait=False, cancel_futures=True)


class RequestStream:
    """One submitted request's RequestOutputs (AsyncLLM.submit), an async iterator. A consumer that falls behind
    takes what has queued up as one output (deltas concatenated, or the latest cumulative one), as vLLM's output
    collector does. Ending it early (aclose(), close(), or cancelling its reader, whose `aclosing` closes it)
    aborts the request in the core; so does closing a stream that was never read."""

    def __init__(self, llm: AsyncLLM, request_id: str, queue: asyncio.Queue, delta: bool):
        self.request_id = request_id
        self._llm, self._queue, self._delta = llm, queue, delta
        self._closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        q = self._queue
        item = await q.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        while not item.finished and not q.empty():      # behind: take the backlog as one output
            nxt = q.get_nowait()
            if isinstance(nxt, BaseException):
                q.put_nowait(nxt)       # an error ends the stream: raised after what came before it
                break
            item = merge_delta(item, nxt) if self._delta else nxt
        if item.finished:
            self._closed = True
            self._llm._release(self.request_id, finished=True)
        return item

    def close(self) -> None:
        """End the stream; the request is aborted unless it finished. Idempotent."""
        if not self._closed:
            self._closed = True
            self._llm._release(self.request_id, finished=False)

    async def aclose(self) -> None:
        self.close()


def merge_delta(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive DELTA outputs of one request as one: each sample's new text, tokens and logprobs
    concatenated; b's finish state, cumulative logprob and metrics."""
    mine = {c.index: c for c in a.outputs}
    outputs = []
    for c in b.outputs:
        p = mine.pop(c.index, None)
        if p is None:
            outputs.append(c)
            continue
        logprobs = None if p.logprobs is None or c.logprobs is None else p.logprobs + c.logprobs
        outputs.append(CompletionOutput(c.index, p.text + c.text, p.token_ids + c.token_ids,
                                        c.cumulative_logprob, logprobs, c.finish_reason, c.stop_reason))
    outputs.extend(mine.values())                 # samples with nothing new in b keep a's delta
    outputs.sort(key=lambda c: c.index)
    return RequestOutput(b.request_id, b.prompt, b.prompt_token_ids,
                         a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
                         outputs, b.finished, b.num_cached_tokens, b.metrics)
