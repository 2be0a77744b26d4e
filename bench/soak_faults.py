"""The soak benchmark's requests (bench/soak.py): a normal streamed completion, or a fault in its place.

  disconnect_mid_stream       the client closes the connection after k content chunks (k drawn in
                              1..min(8, output length - 1)); the server must abort the request
  disconnect_before_response  the whole request written on a raw socket, closed before any byte is read
  oov_token_id                a prompt token id past any vocabulary (2**31 - 1)                     -> 400
  n_over_limit                n = 129 (OpenAI's limit, and the server's, is 128)                    -> 400
  prompt_over_max_model_len   a prompt of max_model_len + 1 tokens (the sample's, repeated)         -> 400
  malformed_json              the body cut in half                                                  -> 400
  nan_temperature             "temperature": NaN, a bare literal (JSON has none)                    -> 400
  unknown_model               a model the server does not serve                                    -> 404

A bad request must get its status with OpenAI's error body {"error": {"message", "type", "param", "code"}},
code = the status. A disconnect is as expected when the client closed the connection (mid-stream, also when
the stream finished first); whether the server let go of it shows in its pool at the end (bench/soak.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

import numpy as np

from bench.datasets import SampleRequest
from bench.serve import (RequestFuncInput, RequestFuncOutput, async_request_openai_completions, completion_payload,
                         sse_events)

OOV_TOKEN_ID = 2**31 - 1
N_OVER_LIMIT = 129
MAX_DISCONNECT_CHUNK = 8

Body = dict[str, Any]


def _over_max_model_len(body: Body, max_model_len: int) -> Body:
    ids = body["prompt"]
    return {**body, "prompt": (ids * (max_model_len // len(ids) + 1))[:max_model_len + 1]}


# kind -> (the status it must get, the request body made from a normal one and max_model_len)
BAD_REQUESTS: dict[str, tuple[int, Callable[[Body, int], Body]]] = {
    "oov_token_id": (400, lambda b, _: {**b, "prompt": [*b["prompt"], OOV_TOKEN_ID]}),
    "n_over_limit": (400, lambda b, _: {**b, "n": N_OVER_LIMIT}),
    "prompt_over_max_model_len": (400, _over_max_model_len),
    "malformed_json": (400, lambda b, _: b),                        # cut in bad_request_body
    "nan_temperature": (400, lambda b, _: {**b, "temperature": float("nan")}),   # json.dumps writes NaN
    "unknown_model": (404, lambda b, _: {**b, "model": "no-such-model"}),
}
FAULT_KINDS = ("disconnect_mid_stream", "disconnect_before_response", *BAD_REQUESTS)
# What each kind must get; anything else is a finding.
EXPECTED: dict[str, frozenset[str]] = {
    "normal": frozenset({"ok"}),
    "disconnect_mid_stream": frozenset({"disconnected", "finished_first"}),
    "disconnect_before_response": frozenset({"disconnected"}),
    **{kind: frozenset({"rejected"}) for kind in BAD_REQUESTS},
}


@dataclass(frozen=True)
class Target:
    base_url: str
    api_url: str               # …/v1/completions
    model: str                 # the served model's name (the first of /v1/models)
    max_model_len: int

    @classmethod
    async def connect(cls, base_url: str) -> "Target":
        import aiohttp
        base_url = base_url.rstrip("/")
        async with aiohttp.ClientSession() as s, s.get(base_url + "/v1/models") as r:
            r.raise_for_status()
            card = (await r.json())["data"][0]
        return cls(base_url, base_url + "/v1/completions", card["id"], int(card["max_model_len"]))


@dataclass
class Sent:
    """What one request got."""
    outcome: str               # ok, wrong_length, failed, disconnected, finished_first, rejected, wrong_status,
                               # bad_error_body
    status: int                # HTTP status, or an error event's code; 0: none read
    detail: str = ""
    timing: RequestFuncOutput | None = None     # normal requests: serve.py's timings


def plan_kinds(n: int, fault_fraction: float, rng: np.random.Generator) -> list[str]:
    """Kinds of n requests: round(n * fault_fraction) faults at positions drawn from rng, the fault kinds in
    equal shares (in turn, then shuffled), the rest "normal"."""
    num_faults = round(n * fault_fraction)
    mix = [FAULT_KINDS[i % len(FAULT_KINDS)] for i in range(num_faults)]
    rng.shuffle(mix)
    kinds = ["normal"] * n
    for at, kind in zip(rng.choice(n, num_faults, replace=False).tolist(), mix):
        kinds[at] = kind
    return kinds


def disconnect_point(req: SampleRequest, rng: np.random.Generator) -> int:
    """After how many content chunks a mid-stream disconnect closes (before the last token's, if it can)."""
    return int(rng.integers(1, max(1, min(MAX_DISCONNECT_CHUNK, req.output_len - 1)) + 1))


def bad_request_body(kind: str, body: Body, max_model_len: int) -> bytes:
    text = json.dumps(BAD_REQUESTS[kind][1](body, max_model_len))
    return (text[:len(text) // 2] if kind == "malformed_json" else text).encode()


def error_body_problem(text: str, status: int) -> str | None:
    """What is wrong with an error response's body against OpenAI's schema; None if nothing."""
    try:
        err = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return f"not an OpenAI error body: {text[:200]!r}"
    if not (isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)
            and "param" in err and err.get("code") == status):
        return f"error body off OpenAI's schema or its code is not {status}: {text[:200]!r}"
    return None


async def send(target: Target, session, kind: str, req: SampleRequest, k: int) -> Sent:
    """One request of this kind; never raises (a failure is an outcome). k: a mid-stream disconnect's point."""
    inp = RequestFuncInput(req.prompt_token_ids, target.api_url, len(req.prompt_token_ids), req.output_len,
                           target.model)
    try:
        if kind == "normal":
            return await _normal(inp, session)
        body = completion_payload(inp)
        if kind == "disconnect_mid_stream":
            return await _disconnect_mid_stream(target, session, body, k)
        if kind == "disconnect_before_response":
            return await _disconnect_before_response(target, json.dumps(body).encode())
        return await _bad_request(target, session, bad_request_body(kind, body, target.max_model_len),
                                  BAD_REQUESTS[kind][0])
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        return Sent("failed", 0, f"{type(e).__name__}: {e}")


async def _normal(inp: RequestFuncInput, session) -> Sent:
    t = await async_request_openai_completions(inp, session)
    if not t.success:
        return Sent("failed", t.status, t.error, t)
    if t.output_tokens != inp.output_len:
        return Sent("wrong_length", t.status, f"{t.output_tokens} of {inp.output_len} tokens", t)
    return Sent("ok", t.status, "", t)


async def _disconnect_mid_stream(target: Target, session, body: Body, k: int) -> Sent:
    chunks = 0
    async with session.post(target.api_url, json=body) as response:
        if response.status != 200:
            return Sent("failed", response.status, (await response.text())[:300])
        async with contextlib.aclosing(sse_events(response.content)) as events:
            async for data in events:
                if "error" in data:
                    code = data["error"].get("code")
                    return Sent("failed", code if isinstance(code, int) else 0, str(data["error"])[:300])
                choices = data.get("choices") or []
                chunks += bool(choices)
                if any(c.get("finish_reason") for c in choices):
                    break
                if chunks >= k:
                    response.close()         # closes the connection (not back to the pool): the server sees it
                    return Sent("disconnected", 200, f"after {k} content chunks")
    return Sent("finished_first", 200, f"the stream finished within {chunks} of {k} chunks")


async def _disconnect_before_response(target: Target, body: bytes) -> Sent:
    url = urlsplit(target.api_url)
    _, writer = await asyncio.open_connection(url.hostname, url.port or 80)
    head = (f"POST {url.path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    writer.write(head + body)
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    return Sent("disconnected", 0)


async def _bad_request(target: Target, session, body: bytes, status: int) -> Sent:
    """On a connection of its own: a pooled one may be closing just then (the server ends keep-alive
    connections idle for 5 s), and a request sent into that close fails in the client, never reaching the
    server whose answer this probe checks."""
    import aiohttp
    async with aiohttp.ClientSession(timeout=session.timeout, connector=aiohttp.TCPConnector(force_close=True)) as s, \
            s.post(target.api_url, data=body, headers={"Content-Type": "application/json"}) as r:
        text = await r.text()
    if r.status != status:
        return Sent("wrong_status", r.status, text[:300])
    problem = error_body_problem(text, r.status)
    return Sent("bad_error_body" if problem else "rejected", r.status, problem or "")
