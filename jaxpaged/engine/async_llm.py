"""AsyncLLM: the engine loop on its own thread; callers on an asyncio loop stream outputs per request.

The loop never waits on a client: each step's outputs are handed to the asyncio loop in one
`call_soon_threadsafe` call (one wake-up per step, not one per request), which puts them into
per-request queues, so a slow or vanished client cannot stall the batch. A consumer that falls behind
takes what has queued up as one output (deltas concatenated, or the latest cumulative one), as vLLM's
output collector does, so its per-chunk cost does not grow with the backlog. `abort` frees a request's
blocks on the engine thread's next turn (before its next step).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator

from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine, PromptType
from jaxpaged.outputs import CompletionOutput, RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("jaxpaged.async_llm")

# The engine thread shares the GIL with the HTTP event loop: how long a thread may hold it while another
# waits. Python's 5 ms is longer than a small model's whole step, so the engine thread would sit idle
# behind request handling; 0.5 ms lets it take the GIL back within a fraction of a step.
GIL_SWITCH_INTERVAL_S = 0.0005


class EngineDeadError(RuntimeError):
    pass


class AsyncLLM:
    def __init__(self, engine: LLMEngine):
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self.dead_error: BaseException | None = None
        self._stopped = False
        self.last_progress = time.time()
        self._thread = threading.Thread(target=self._loop, name="jaxpaged-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "AsyncLLM":
        return cls(LLMEngine(args))

    # ---- health -------------------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        return self.dead_error is not None or not self._thread.is_alive()

    def is_healthy(self, stall_seconds: float = 120.0) -> bool:
        """False when the loop died, or has work waiting but made no progress for stall_seconds."""
        if self.errored:
            return False
        busy = self.engine.has_unfinished_requests()
        return not busy or time.time() - self.last_progress < stall_seconds

    # ---- requests -----------------------------------------------------------------------------
    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yields RequestOutputs as tokens arrive (deltas when sampling_params.output_kind is DELTA).
        Raises ValueError for invalid requests before anything is queued."""
        if self.errored:
            raise EngineDeadError(f"the engine loop has stopped: {self.dead_error!r}")
        # Validation is read-only, so it runs here, and a bad request never reaches the engine thread.
        text, token_ids = self.engine.tokenize_prompt(prompt)
        self.engine.validate_prompt(token_ids, sampling_params)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (loop, q)
        self._commands.put(("add", request_id, (text, token_ids), sampling_params, priority))
        self._wakeup.set()
        finished = False
        delta = sampling_params.output_kind == RequestOutputKind.DELTA
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                while not item.finished and not q.empty():      # behind: take the backlog as one output
                    nxt = q.get_nowait()
                    if isinstance(nxt, BaseException):
                        q.put_nowait(nxt)       # an error ends the stream: raised after what came before it
                        break
                    item = merge_delta(item, nxt) if delta else nxt
                finished = item.finished
                yield item
                if finished:
                    break
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))   # client went away or cancelled
                self._wakeup.set()

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wakeup.set()

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)

    # ---- the engine thread --------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        try:
            while not self._stopped:
                self._drain_commands()
                if not engine.has_unfinished_requests():
                    self.last_progress = time.time()
                    self._wakeup.wait(timeout=1.0)
                    self._wakeup.clear()
                    continue
                outputs = engine.step()
                self.last_progress = time.time()
                if outputs:
                    self._push_all([(out.request_id, out) for out in outputs])
        except BaseException as e:  # the loop is dead: fail every waiting stream, /health turns 503
            logger.exception("engine loop died")
            self.dead_error = e
            with self._lock:
                streams = list(self._streams)
            for rid in streams:
                self._push(rid, EngineDeadError(f"engine loop died: {e!r}"))

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, (text, token_ids), params, priority = cmd
                with self._lock:
                    alive = rid in self._streams
                if not alive:
                    continue          # cancelled before it reached the engine
                try:         # validated in generate(), on the caller's loop: not checked twice
                    self.engine.add_validated_request(rid, text, token_ids, params, priority=priority)
                except ValueError as e:
                    self._push(rid, e)
            elif cmd[0] == "abort":
                self.engine.abort_request(cmd[1])

    def _push(self, request_id: str, item) -> None:
        self._push_all([(request_id, item)])

    def _push_all(self, items: list[tuple[str, object]]) -> None:
        """Hand (request id, output or error) pairs to their callers' event loops: one call per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            streams = self._streams
            for rid, item in items:
                target = streams.get(rid)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:
                pass          # the caller's loop is closed


def _deliver(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in batch:
        q.put_nowait(item)


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
