"""Server pieces that need no model: the flags, and the app over a stub engine for the failure paths a
healthy real engine never takes (an engine that dies mid-stream, a stalled loop)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

from jaxpaged.engine.async_llm import AsyncLLM, EngineDeadError
from jaxpaged.engine.messages import CoreStats
from jaxpaged.engine.stats import RequestStats
from jaxpaged.outputs import CompletionOutput, RequestOutput
from jaxpaged.server.api_server import build_app
from jaxpaged.server.cli import engine_args_from, make_parser, validate_args
from jaxpaged import envs
from jaxpaged.server.serving import INTERNAL_ERROR_MESSAGE, ServerState, merge_outputs

FLAGS = ["--model", "--tokenizer", "--served-model-name", "--host", "--port", "--api-key", "--dtype",
         "--load-format", "--max-model-len", "--gpu-memory-utilization", "--block-size", "--max-num-seqs",
         "--max-num-batched-tokens", "--enable-prefix-caching", "--no-enable-prefix-caching",
         "--enable-chunked-prefill", "--swap-space", "--preemption-mode", "--num-gpu-blocks-override", "--seed",
         "--chat-template", "--tensor-parallel-size", "--allowed-origins", "--uvicorn-log-level",
         "--disable-log-requests", "--root-path", "--max-request-body-mib", "--trust-request-chat-template",
         "--generation-config", "--override-generation-config"]


# ---- flags ---------------------------------------------------------------------------------------
def test_help_documents_every_flag():
    out = subprocess.run([sys.executable, "-m", "jaxpaged.server", "-h"], capture_output=True, text=True,
                         check=True).stdout
    documented = {}
    for action in make_parser()._actions:
        for opt in action.option_strings:
            documented[opt] = action.help or ""
    for flag in FLAGS:
        assert flag in out, flag
        assert len(documented[flag].split()) >= 3, (flag, documented[flag])


def test_tensor_parallel_above_one_is_a_clear_error():
    r = subprocess.run([sys.executable, "-m", "jaxpaged.server", "--tensor-parallel-size", "2"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--tensor-parallel-size 2 is not supported" in r.stderr


def test_api_server_count_defaults_by_host_cores():
    """Two API processes where the host has cores to spare (a GPU host), one on small hosts such as CI's."""
    from jaxpaged.server.cli import default_api_server_count
    assert [default_api_server_count(n) for n in (None, 1, 2, 7, 8, 16, 128)] == [1, 1, 1, 1, 2, 2, 2]
    p = make_parser()
    for argv, expected in (([], default_api_server_count(os.cpu_count())), (["--api-server-count", "3"], 3)):
        args = p.parse_args(argv)
        validate_args(p, args)
        assert args.api_server_count == expected


def test_flags_map_to_engine_args():
    p = make_parser()
    args = p.parse_args(["--no-enable-prefix-caching", "--max-model-len", "512", "--max-num-seqs", "8",
                         "--block-size", "32", "--preemption-mode", "swap", "--swap-space", "1",
                         "--served-model-name", "a", "b", "--num-gpu-blocks-override", "100", "--seed", "3",
                         "--load-format", "dummy", "--dtype", "float32", "--no-enable-chunked-prefill",
                         "--max-num-batched-tokens", "1024", "--allowed-origins", '["http://x"]',
                         "--layer-dispatch", "per_layer"])
    validate_args(p, args)
    e = engine_args_from(args)
    assert (e.enable_prefix_caching, e.max_model_len, e.max_num_seqs, e.block_size) == (False, 512, 8, 32)
    assert (e.preemption_mode, e.swap_space, e.num_gpu_blocks_override, e.seed) == ("swap", 1.0, 100, 3)
    assert ((e.load_format, e.dtype, e.enable_chunked_prefill, e.max_num_batched_tokens)
            == ("dummy", "float32", False, 1024))
    assert e.served_model_name == "a" and args.served_model_name == ["a", "b"]
    assert e.layer_dispatch == "per_layer"
    assert args.allowed_origins == ["http://x"]
    defaults = p.parse_args([])
    assert defaults.enable_prefix_caching and defaults.port == 8000 and defaults.model is None
    # batch limits and steps per program left to config.resolve, which gives the server LLM's program
    d = engine_args_from(defaults)
    assert ((d.max_num_seqs, d.max_num_batched_tokens, d.num_scheduler_steps, d.layer_dispatch, d.usage_context)
            == (None, None, None, None, "openai_api_server"))
    for bad in (["--max-num-seqs", "0"], ["--block-size", "7"], ["--dtype", "int4"], ["--allowed-origins", "x"],
                ["--layer-dispatch", "cuda_graph"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)


# ---- the app over a stub engine ------------------------------------------------------------------
class _Tok:
    chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 100 for c in text]

    def decode(self, ids, **_):
        return "".join(chr(97 + i % 26) for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [self.decode([i]) for i in ids] if isinstance(ids, list) else self.decode([ids])

    def apply_chat_template(self, conversation, chat_template=None, tokenize=False, add_generation_prompt=True):
        return "".join(m["content"] for m in conversation)


class _Namespace:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _StubLLM:
    """AsyncLLM's surface for the app: streams one delta, then fails with `failure` (as a dying engine core
    does, by default)."""

    def __init__(self):
        self.tokenizer = _Tok()
        self.info = _Namespace(num_blocks=10)
        self.model_path, self.max_model_len, self.vocab_size = "/stub", 64, 100
        self.default_sampling: dict = {}          # no generation config
        self.core_stats, self.request_stats = CoreStats(num_free_blocks=9), RequestStats()
        self.input_processor = _Namespace(
            tokenize_prompt=lambda p, add_special_tokens=True: ((p, _Tok().encode(p)) if isinstance(p, str)
                                                                else (None, p)),
            validate_prompt=lambda ids, params: None, max_new_tokens=lambda n: self.max_model_len - n)
        self.healthy, self.errored, self.dead_error = True, False, None
        self.aborted = []
        self.failure: Exception = EngineDeadError("the engine core failed: RuntimeError: boom")

    def start(self):
        pass

    async def run_blocking(self, fn, *args):
        return fn(*args)

    off_loop = AsyncLLM.off_loop          # the real rule: large inputs go through run_blocking

    def is_healthy(self):
        return self.healthy

    async def generate(self, prompt, params, request_id, priority=0):
        try:
            yield RequestOutput(request_id, prompt.get("prompt"), prompt["prompt_token_ids"], None,
                                [CompletionOutput(0, "ab", [1, 2], None, None)], False)
            raise self.failure
        finally:
            self.aborted.append(request_id)

    def submit(self, prompt, params, request_id, priority=0):
        return _StubStream(self.generate(prompt, params, request_id, priority))


class _StubStream:
    """AsyncLLM.submit's stream (RequestStream's surface) over the stub's generator, which records its own end."""

    def __init__(self, gen):
        self.gen = gen

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.gen.__anext__()

    async def aclose(self):
        await self.gen.aclose()

    def close(self):
        pass


PATHS = [("/v1/completions", {"prompt": "hi"}),
         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]


@pytest.fixture
def stub():
    llm = _StubLLM()
    with TestClient(build_app(ServerState(llm, ["stub"], log_requests=False))) as client:
        yield llm, client


def _events(resp) -> list:
    return [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("path,body", PATHS)
def test_failure_inside_a_stream_sends_error_chunk_then_done(stub, path, body):
    llm, client = stub
    with client.stream("POST", path, json={**body, "stream": True, "max_tokens": 4}) as r:
        assert r.status_code == 200
        events = _events(r)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "boom" in error["message"] and error["type"] == "ServiceUnavailableError"
    text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                   for e in events[:-2] for c in json.loads(e)["choices"])
    assert text == "ab"
    # the same failure without streaming is a 503 in OpenAI's shape
    r = client.post(path, json={**body, "max_tokens": 4})
    assert r.status_code == 503 and r.json()["error"]["code"] == 503


@pytest.mark.parametrize("path,body", PATHS)
def test_unexpected_errors_are_plain_500s(path, body):
    """A bug (an exception no check expected) reaches the client as a 500 in OpenAI's schema with a plain
    message: neither its text nor a traceback leaves the server. In a handler, while generating, and after
    a stream has started."""
    llm = _StubLLM()
    llm.failure = RuntimeError("secret /internal/path")
    with TestClient(build_app(ServerState(llm, ["stub"], log_requests=False)), raise_server_exceptions=False) as client:
        plain = {"message": INTERNAL_ERROR_MESSAGE, "type": "InternalServerError", "param": None, "code": 500}
        r = client.post(path, json={**body, "max_tokens": 4})
        assert r.status_code == 500 and r.json() == {"error": plain}
        with client.stream("POST", path, json={**body, "stream": True, "max_tokens": 4}) as r:
            events = _events(r)
        assert events[-1] == "[DONE]" and json.loads(events[-2]) == {"error": plain}

        def broken_encode(*_, **__):
            raise KeyError("secret /internal/path")

        llm.tokenizer.encode = broken_encode
        r = client.post(path, json={**body, "max_tokens": 4})
        assert r.status_code == 500 and r.json() == {"error": plain}
        assert "secret" not in r.text and "Traceback" not in r.text


def test_api_keys_from_the_flag_else_the_environment(monkeypatch):
    """--api-key takes one or more keys; without it JAXPAGED_API_KEY is the key (as vLLM's VLLM_API_KEY)."""
    monkeypatch.setattr(envs, "JAXPAGED_API_KEY", "from-env")
    for argv, good, bad in ((["--api-key", "a", "b"], ["a", "b"], ["from-env", "ab", ""]),
                            ([], ["from-env"], ["a", "from-env2"])):
        app = build_app(ServerState(_StubLLM(), ["stub"], log_requests=False), make_parser().parse_args(argv))
        with TestClient(app) as client:
            for key in good:
                assert client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
            for key in bad:
                r = client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 401 and r.json()["error"]["code"] == 401
            assert client.options("/v1/models", headers={"Origin": "http://x", "Access-Control-Request-Method":
                                                         "GET"}).status_code == 200          # CORS preflight


def test_body_limit_answers_413_in_openai_schema_on_every_route():
    """Also where the route never reads the body (Starlette's own limit answers those in plain text)."""
    args = make_parser().parse_args(["--max-request-body-mib", "1"])
    with TestClient(build_app(ServerState(_StubLLM(), ["stub"], log_requests=False), args)) as client:
        big = b"x" * (2**20 + 1)
        for method, path in (("GET", "/v1/models"), ("POST", "/tokenize"), ("GET", "/health")):
            r = client.request(method, path, content=big)
            error = r.json()["error"]
            assert r.status_code == 413 and error["type"] == "RequestTooLargeError", path
            assert "limit of 1048576 bytes" in error["message"]
        assert client.post("/tokenize", json={"prompt": "x" * (2**20 - 100)}).status_code == 200


def test_health_is_503_when_engine_dead_or_stalled(stub):
    llm, client = stub
    assert client.get("/health").status_code == 200
    llm.healthy = False
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["error"]["message"] == "engine core stalled"
    llm.errored, llm.dead_error = True, RuntimeError("boom")
    assert "boom" in client.get("/health").json()["error"]["message"]


def test_a_streamed_response_closes_its_engine_streams_however_it_ends():
    """EngineStreamingResponse owns the streams its handler submitted (they are in the engine already): read to
    the end, or the client gone before the first chunk (never read), each stream is closed after the response,
    which aborts an unfinished request in the engine."""
    import asyncio
    from jaxpaged.server.serving import EngineStreamingResponse

    class Stream:
        closed = 0

        def close(self):
            self.closed += 1

    async def body():
        yield b"data: 1\n\n"

    async def respond(send):
        streams = [Stream(), Stream()]
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        with contextlib.suppress(Exception):
            await EngineStreamingResponse(body(), streams)(scope, None, send)
        return [s.closed for s in streams]

    sent = []

    async def ok(message):
        sent.append(message["type"])

    async def gone(message):
        raise OSError("the client went away")

    assert asyncio.run(respond(ok)) == [1, 1] and "http.response.body" in sent
    assert asyncio.run(respond(gone)) == [1, 1]


def test_merge_outputs_closes_every_stream():
    closed = []

    async def gen(i, n):
        try:
            for k in range(n):
                await asyncio.sleep(0)
                yield (i, k)
        finally:
            closed.append(i)

    async def main():
        got = []
        merged = merge_outputs([gen(0, 3), gen(1, 100)])
        async for i, item in merged:
            got.append(item)
            if len(got) == 4:
                break
        await merged.aclose()
        return got

    got = asyncio.run(main())
    assert len(got) == 4 and sorted(closed) == [0, 1]


def test_root_path_and_api_key_scope():
    args = make_parser().parse_args(["--root-path", "/api", "--api-key", "k"])
    app = build_app(ServerState(_StubLLM(), ["stub"], log_requests=False), args)
    with TestClient(app, root_path="/api") as client:      # as uvicorn --root-path sets the scope
        for path in ("/v1/models", "/api/v1/models"):
            r = client.get(path)
            assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
            assert client.get(path, headers={"Authorization": "Bearer k"}).json()["data"][0]["id"] == "stub"
        assert client.get("/api/health").status_code == 200 and client.get("/version").status_code == 200
        assert "/api/openapi.json" in client.get("/docs").text


LONG = "slow " * 1000          # past AsyncLLM's OFFLOAD_CHARS: tokenized off the loop


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": LONG}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}),
                                       ("/tokenize", {"prompt": LONG})])
def test_tokenizing_never_blocks_the_event_loop(path, body):
    """While a long prompt's tokenization (or chat templating) is in progress, the server answers others:
    it runs on a worker thread (AsyncLLM.run_blocking), not on the event loop. The tokenizer here holds
    until the other request has been answered; on the event loop that would never happen."""
    import concurrent.futures
    import threading

    entered, release = threading.Event(), threading.Event()

    class _SlowTok(_Tok):
        def encode(self, text, add_special_tokens=True):
            if "slow" in text:
                entered.set()
                assert release.wait(120), "the other request was never answered"
            return super().encode(text, add_special_tokens)

    llm = _StubLLM()
    llm.tokenizer = _SlowTok()
    llm.input_processor.tokenize_prompt = lambda p, add_special_tokens=True: (
        (p, llm.tokenizer.encode(p, add_special_tokens)) if isinstance(p, str) else (None, p))
    pool = concurrent.futures.ThreadPoolExecutor(2)

    async def run_blocking(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    llm.run_blocking = run_blocking
    with TestClient(build_app(ServerState(llm, ["stub"], log_requests=False))) as client:
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            slow = ex.submit(client.post, path, json={**body, "max_tokens": 2})
            assert entered.wait(120)
            try:
                assert client.get("/v1/models").status_code == 200     # served while the tokenizer holds
            finally:
                release.set()
            assert slow.result(timeout=120).status_code in (200, 503)   # (the stub engine then fails, 503)
    pool.shutdown()


# ---- the request bodies --------------------------------------------------------------------------
def test_fields_not_implemented_are_refused_by_name_unless_they_ask_for_nothing():
    import logging

    from pydantic import ValidationError

    from jaxpaged.server.protocol import NOT_IMPLEMENTED, ChatCompletionRequest, CompletionRequest, FieldError

    def cause(exc: ValidationError) -> FieldError:
        (err,) = exc.errors()
        return err["ctx"]["error"]

    for name in NOT_IMPLEMENTED:
        with pytest.raises(ValidationError) as e:
            CompletionRequest.model_validate({"prompt": "Hi", name: {"x": 1}})
        assert str(cause(e.value)) == f"`{name}` is not supported by this server yet." and cause(e.value).param == name
    # a client sending the field's default (or null) asks for nothing: accepted; a value of another type is not
    # the default (False == 0 in Python, but use_beam_search 0 is no boolean)
    for body in ({"use_beam_search": False}, {"length_penalty": 1.0}, {"length_penalty": 1}, {"tools": []},
                 {"tool_choice": "none"},
                 {"response_format": {"type": "text"}}, {"modalities": ["text"]}, {"cache_salt": None}):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], **body})
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": "Hi", "use_beam_search": 0})
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": "Hi", "prompt_logprobs": 1, "stream": True})
    assert cause(e.value).param == "prompt_logprobs"
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}],
                                              "continue_final_message": True, "add_generation_prompt": True})
    assert cause(e.value).param == "continue_final_message"
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"},
                                                           {"role": "assistant", "tool_calls": [call]}]})
    assert "`tool_calls` in messages" in str(cause(e.value)) and cause(e.value).param == "messages"
    # fields of neither API are ignored, with a warning naming them; OpenAI's bookkeeping fields silently
    # (a handler on the logger itself: the jaxpaged logger does not propagate to pytest's capture)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append           # type: ignore[method-assign]
    log = logging.getLogger("jaxpaged.server")
    log.addHandler(handler)
    try:
        CompletionRequest.model_validate({"prompt": "Hi", "frobnicate": 1, "metadata": {"a": "b"}, "store": False})
    finally:
        log.removeHandler(handler)
    assert [r.getMessage() for r in records] == [
        "The following fields were present in the request but ignored: ['frobnicate']"]


def test_truncate_prompt_tokens_keeps_the_last_k():
    from pydantic import ValidationError

    from jaxpaged.server.protocol import CompletionRequest

    ids = [10, 11, 12, 13, 14]
    assert CompletionRequest(prompt=ids, truncate_prompt_tokens=2).truncate(ids, 8) == [13, 14]
    assert CompletionRequest(prompt=ids, truncate_prompt_tokens=-1).truncate(ids, 3) == [12, 13, 14]
    assert CompletionRequest(prompt=ids).truncate(ids, 3) == ids          # unset: the engine's length check
    with pytest.raises(ValueError, match="greater than max_model_len"):
        CompletionRequest(prompt=ids, truncate_prompt_tokens=9).truncate(ids, 8)
    with pytest.raises(ValidationError):
        CompletionRequest(prompt=ids, truncate_prompt_tokens=0)


def test_the_generation_config_fills_what_a_request_leaves_unset():
    """--generation-config (the engine's default_sampling): a field the request does not set samples with the
    model's default, one it sets keeps its value, and the config's max_tokens caps max_tokens, given or not
    (vLLM's rule). The flags map to EngineArgs; a bad value stops the server at start-up."""
    llm = _StubLLM()
    llm.default_sampling = {"temperature": 0.2, "top_k": 7, "repetition_penalty": 1.1, "max_tokens": 3}
    seen = []
    real = llm.generate

    def generate(prompt, params, request_id, priority=0):
        seen.append(params)
        return real(prompt, params, request_id, priority)

    llm.generate = generate
    with TestClient(build_app(ServerState(llm, ["stub"], log_requests=False)), raise_server_exceptions=False) as c:
        for path, body in PATHS:
            for extra in ({}, {"temperature": 0.5, "top_k": 2, "max_tokens": 10}):
                c.post(path, json={**body, **extra})
    got = [(p.temperature, p.top_k, p.repetition_penalty, p.max_tokens) for p in seen]
    assert got == [(0.2, 7, 1.1, 3), (0.5, 2, 1.1, 3)] * 2
    args = make_parser().parse_args(["--generation-config", "vllm", "--override-generation-config",
                                     '{"temperature": 0.3}'])
    e = engine_args_from(args)
    assert (e.generation_config, e.override_generation_config) == ("vllm", {"temperature": 0.3})
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--override-generation-config", "[1]"])
    with pytest.raises(ValueError, match="generation_config must be"):
        engine_args_from(make_parser().parse_args(["--generation-config", "/no/such/folder"]))
    with pytest.raises(ValueError, match="unknown fields"):
        engine_args_from(make_parser().parse_args(["--override-generation-config", '{"temprature": 0.3}']))
