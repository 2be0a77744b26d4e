"""The FastAPI app: routes, OpenAI-shaped errors, the access checks (middleware.py) and CORS; and
`run_server`.

The engine core runs in its own process (AsyncLLM); handlers tokenize (on a worker thread), queue and
stream, so nothing here ever waits on an engine step. If the core dies, in-flight requests get an error,
/health answers 503, and the server exits with status 1 a few seconds later; SIGTERM ends every open
stream with finish_reason "abort", stops the core and exits 0.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import inspect
import logging
import multiprocessing
import os
import signal
import socket
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import jaxpaged
from jaxpaged import envs
from jaxpaged.server.metrics import ServerMetrics
from jaxpaged.server import openapi
from jaxpaged.server.middleware import APIKeyCheck, BodySizeLimit, is_public
from jaxpaged.server.protocol import (ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                      CompletionRequest, CompletionResponse, DetokenizeRequest, DetokenizeResponse,
                                      FieldError, ModelCard, ModelList, TokenizeRequest, TokenizeResponse,
                                      VersionResponse)
from jaxpaged.server.serving import HTTP_ERROR_TYPES, APIError, ServerState, error_for, logger
from jaxpaged.server.serving_chat import apply_chat_template, create_chat_completion
from jaxpaged.server.serving_completion import create_completion

def _version() -> str:
    # From the package metadata when `jaxpaged` resolves as a namespace (an editable install run outside
    # the repository root does that), so /version never depends on how the package was imported.
    try:
        return jaxpaged.__version__
    except AttributeError:
        from importlib.metadata import version
        return version("jaxpaged")


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """pydantic's errors -> one readable line, and the first offending field as `param`."""
    parts, param = [], None
    for e in exc.errors():
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            return f"Invalid JSON in the request body: {e.get('msg')}", None
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, FieldError):          # a check across fields: its own words, the field it names
            param = param or cause.param
            parts.append(str(cause))
            continue
        if param is None and loc:
            param = loc[0]
        parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg')}")
    return "; ".join(parts) or "invalid request", param


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return _error_response(APIError(message, 400, "BadRequestError", param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        err = APIError(str(exc.detail), exc.status_code, HTTP_ERROR_TYPES.get(exc.status_code, "Error"))
        return JSONResponse(err.body(), status_code=err.status_code, headers=exc.headers)   # (405: Allow)

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError):
        return _error_response(error_for(exc))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception):   # a bug: a plain 500, the traceback in the log
        return _error_response(error_for(exc))


def _api_keys(args: argparse.Namespace) -> list[str]:
    """--api-key, else JAXPAGED_API_KEY (as vLLM: the flag wins over its VLLM_API_KEY)."""
    return args.api_key or ([envs.JAXPAGED_API_KEY] if envs.JAXPAGED_API_KEY else [])


# Newer FastAPI traces every request with OpenTelemetry unless told not to, asking the global providers (and
# the environment) per request; jaxpaged's metrics are Prometheus's (/metrics), so the server turns it off.
_NO_NATIVE_TELEMETRY: dict[str, Any] = ({"telemetry": {"tracing": False, "metrics": False, "logs": False}}
                        if "telemetry" in inspect.signature(FastAPI).parameters else {})


# The collector's thresholds in an API process once it serves (Python's default: 700, 10, 10). A request
# allocates a few hundred container objects (parsing, validation, the ASGI stack, its stream), so at the
# default a 1000-request burst ran ~300 young collections and several full ones on the event loop. With these
# the API process spent 15% less CPU on a burst of one-chunk streams (bench/api_capacity.py --output-len 16, four
# alternating pairs on a 2-core CPU: 0.68 against 0.80 ms a request), which is admission; with 256-token streams
# the difference was within the noise (1.30 against 1.33 ms). The cyclic garbage of finished requests is
# collected a little later; what it holds meanwhile is small (a young generation of 50,000 objects).
API_GC_THRESHOLDS = (50_000, 20, 100)


def build_app(state: ServerState, args: argparse.Namespace | None = None) -> FastAPI:
    metrics = ServerMetrics(state.llm, state.model_name)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        state.llm.start()                        # read the core's outputs on this loop from now on
        # As vLLM's API server: what exists at start-up (tokenizer, app, imported libraries) lives as long
        # as the server, so it leaves the collector's generations. A full collection then walks only the
        # requests' objects, instead of pausing the event loop for every stream at each one.
        gc.collect()
        gc.freeze()
        gc.set_threshold(*API_GC_THRESHOLDS)
        task = asyncio.create_task(metrics.drain_forever())
        yield
        task.cancel()
        if state.owns_engine:       # the core stops with the app
            state.llm.shutdown()

    # --root-path goes to uvicorn (FastAPI's own root_path parameter is deprecated)
    app = FastAPI(title="jaxpaged OpenAI-compatible server", version=_version(), lifespan=lifespan,
                  **_NO_NATIVE_TELEMETRY)
    add_error_handlers(app)
    # The last added runs first: CORS (its headers on every answer, refusals too), the body limit, the key.
    keys = _api_keys(args) if args is not None else []
    if keys:
        app.add_middleware(APIKeyCheck, keys=keys)
    openapi.customize(app, guarded=(lambda path: not is_public(path)) if keys else None)
    if args is not None:
        app.add_middleware(BodySizeLimit, max_bytes=args.max_request_body_mib * 2**20,
                           flag="--max-request-body-mib")
    app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins if args else ["*"],
                       allow_credentials=True, allow_methods=["*"], allow_headers=["*"])
    app.state.server = state
    app.state.metrics = metrics
    _add_routes(app, state, metrics)
    return app


def _add_routes(app: FastAPI, state: ServerState, metrics: ServerMetrics) -> None:
    @app.post("/v1/completions", response_model=CompletionResponse,
              responses=openapi.generates(CompletionResponse))
    async def completions(request: CompletionRequest, raw: Request):
        """OpenAI completions (with vLLM's sampling extras)."""
        return await create_completion(state, request, raw)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses=openapi.generates(ChatCompletionChunk))
    async def chat_completions(request: ChatCompletionRequest, raw: Request):
        """OpenAI chat completions, through the model's chat template."""
        return await create_chat_completion(state, request, raw)

    @app.get("/v1/models", response_model=ModelList, responses=openapi.REFUSED)
    async def models():
        return ModelList(data=[ModelCard(id=name, root=state.llm.model_path, max_model_len=state.llm.max_model_len)
                               for name in state.served_model_names])

    @app.get("/health", response_class=Response, responses=openapi.ENGINE_GONE)
    async def health():
        """200 (no body) while the engine core is alive and making progress; 503 when it died or stalled."""
        if state.llm.is_healthy():
            return Response(status_code=200)
        reason = f"engine core died: {state.llm.dead_error}" if state.llm.errored else "engine core stalled"
        return _error_response(APIError(reason, 503, "ServiceUnavailableError"))

    for method in ("GET", "POST"):          # vLLM's (and SageMaker's) other name for /health
        app.add_api_route("/ping", health, methods=[method], operation_id=f"ping_{method.lower()}",
                          response_class=Response, responses=openapi.ENGINE_GONE)

    prometheus_text: openapi.Responses = {200: {"description": "Prometheus text exposition",
                                                "content": {"text/plain": {"schema": {"type": "string"}}}}}

    @app.get("/metrics", response_class=Response, responses=prometheus_text)
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version", response_model=VersionResponse)
    async def version():
        return VersionResponse(version=_version())

    @app.post("/tokenize", response_model=TokenizeResponse, responses=openapi.REFUSED)
    async def tokenize(request: TokenizeRequest):
        state.check_model(request.model)
        tok = state.tokenizer

        def run() -> list[int]:
            if request.messages is not None:
                text = apply_chat_template(state, request.messages, request.add_generation_prompt,
                                           continue_final_message=request.continue_final_message)
                return tok.encode(text, add_special_tokens=False)
            if request.prompt is not None:
                return tok.encode(request.prompt, add_special_tokens=request.add_special_tokens)
            raise APIError("give either `prompt` or `messages`", param="prompt")

        ids = await state.llm.run_blocking(run)
        strs = tok.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=state.llm.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=openapi.REFUSED)
    async def detokenize(request: DetokenizeRequest):
        state.check_model(request.model)
        vocab = state.llm.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"Token id {bad[0]} is out of vocabulary (vocab size {vocab}).", param="tokens")
        return DetokenizeResponse(prompt=await state.llm.run_blocking(state.tokenizer.decode, request.tokens))


# After the engine core dies: how long /health answers 503 (and requests get 503s) before the server exits,
# so a probe or load balancer sees why.
DEAD_EXIT_DELAY_S = 5.0
# SIGTERM: how long uvicorn waits for open connections to close after every stream was ended. With the
# engine core's own stop (a second or two) the process exits within 10 s.
GRACEFUL_SHUTDOWN_S = 5


def run_server(args: argparse.Namespace, core_target=None) -> int:
    """Serve until SIGTERM or SIGINT (-> 0) or the engine core's death (-> 1); the exit status. With
    --api-server-count N, this is the first of N API processes (api_workers.py). core_target: the engine
    core process's entry point (bench/api_capacity.py swaps in a core without a model)."""
    from jaxpaged.engine.async_llm import AsyncLLM
    from jaxpaged.engine.core_client import CoreProcClient, run_core_process
    from jaxpaged.server.api_workers import APIServerProcesses, listen_socket
    from jaxpaged.server.cli import engine_args_from
    from jaxpaged.server.metrics import multiprocess_mode

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    count = args.api_server_count
    if count > 1 and not multiprocess_mode():
        raise RuntimeError("several API processes need PROMETHEUS_MULTIPROC_DIR set before prometheus_client is "
                           "imported (api_workers.multiprocess_metrics_dir)")
    engine_args = engine_args_from(args)
    sock = listen_socket(args.host or "0.0.0.0", args.port) if count > 1 else None
    client = CoreProcClient(engine_args, core_target or run_core_process, num_clients=count)
    workers = None
    try:
        if sock is not None:
            workers = APIServerProcesses(args, sock, client.channels, run_api_server_process)
        llm = AsyncLLM(engine_args, client=client)
        if workers is not None:
            workers.wait_ready()
    except BaseException:
        if workers is not None:
            workers.stop()
        client.shutdown()
        raise
    return serve(args, llm, sock, workers)


def serve(args: argparse.Namespace, llm, sock=None, workers=None) -> int:
    """Run the app over this engine until a signal or the core's death; the exit status. sock: the shared
    listening socket (several API processes), else uvicorn binds --host and --port. workers: the other API
    processes, when this is the first of several."""
    from jaxpaged.server.serving import load_chat_template

    names = args.served_model_name or [args.model or "SmolLM2-135M-Instruct"]
    state = ServerState(llm, names, load_chat_template(args.chat_template), args.trust_request_chat_template,
                        log_requests=not args.disable_log_requests, owns_engine=True)
    app = build_app(state, args)
    if llm.client.client_index == 0:
        logger.info("Serving %s on http://%s:%d (engine core ready in %.1f s: %s%s)", names[0],
                    args.host or "0.0.0.0", args.port, llm.info.startup_seconds, llm.info.run_summary,
                    f"; {args.api_server_count} API server processes" if workers is not None else "")
    config = uvicorn.Config(app, host=args.host or "0.0.0.0", port=args.port, log_level=args.uvicorn_log_level,
                            root_path=args.root_path or "", timeout_keep_alive=5,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    server = _Server(config, llm, workers)
    try:
        server.run(sockets=None if sock is None else [sock])
    finally:
        if workers is not None:
            workers.stop()              # they drain first: the core they stream from stops after them
        llm.shutdown()
    if llm.errored or server.lost_worker is not None:
        logger.error("exiting: %s", llm.dead_error if llm.errored else server.lost_worker)
        return 1
    return 0


class _Server(uvicorn.Server):
    """uvicorn's server, tied to the engine: a signal ends every open stream (finish_reason "abort") so
    shutdown never waits on a long generation and no client sees a cut connection, and the process then
    exits 0; the core's death stops the server after DEAD_EXIT_DELAY_S."""

    def __init__(self, config, llm, workers=None):
        super().__init__(config)
        self.llm, self.workers = llm, workers
        self.lost_worker: str | None = None       # why another API process exited on its own
        llm.on_dead = self._engine_died
        if workers is not None:
            workers.watch(self._worker_lost)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, less its re-raising of the caught signal once shut down (which makes the process
        die by SIGTERM): SIGTERM and SIGINT ask for this drain, so finishing it is a clean exit, status 0."""
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        if self.workers is not None:
            self.workers.drain()                # each ends its own streams, as this one does
        loop = self.llm.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.llm.abort_all)   # (a signal handler: hand it to the loop)

    def _engine_died(self) -> None:
        loop = self.llm.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.call_later, DEAD_EXIT_DELAY_S, setattr, self, "should_exit", True)
        else:
            self.should_exit = True

    def _worker_lost(self, why: str) -> None:
        """Another API process died (its clients' connections with it): the server is broken, so it stops,
        ending this process's streams as a shutdown does, and exits 1 for a supervisor to restart it."""
        logger.error("%s: the server stops", why)
        self.lost_worker = why
        loop = self.llm.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.llm.abort_all)
        self.should_exit = True


def run_api_server_process(args, index: int, sock: socket.socket, channel, ready) -> None:
    """An extra API process's entry point: the app over its pipe pair to the core, on the shared socket."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    from jaxpaged.engine.async_llm import AsyncLLM
    from jaxpaged.engine.core_client import CoreChannel, EngineDeadError
    from jaxpaged.server.cli import engine_args_from

    try:
        llm = AsyncLLM(engine_args_from(args),
                       client=CoreChannel(channel, index, watch=multiprocessing.parent_process()))
    except EngineDeadError as e:
        logger.error("API server process %d: %s", index, e)
        os._exit(1)
    logger.info("API server process %d of %d ready", index, args.api_server_count)
    ready.send_bytes(b"ready")
    ready.close()
    code = serve(args, llm, sock)
    logging.shutdown()
    os._exit(code)          # (as the first process: nothing left that needs the interpreter's teardown)
