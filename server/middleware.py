"""Access control in front of the routes, as pure ASGI middlewares (no per-chunk cost on streams): the API
key check, and the request body size limit. Both refuse in OpenAI's error schema."""
from __future__ import annotations

import hashlib
import secrets

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jaxpaged.server.serving import HTTP_ERROR_TYPES, error_body

# Routes that stay open with --api-key, as in vLLM: probes, metrics scraping and the API docs. Every other
# route (a new one too) needs the key.
PUBLIC_PATHS = ("/health", "/ping", "/version", "/metrics", "/docs", "/redoc", "/openapi.json")


def is_public(path: str) -> bool:
    """Exact or on a segment boundary: /docs/oauth2-redirect is public, /healthz is not."""
    return any(path == p or path.startswith(p + "/") for p in PUBLIC_PATHS)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class APIKeyCheck:
    """Every non-public route needs `Authorization: Bearer <key>` with one of `keys`; else a 401. Keys are
    compared as SHA-256 digests with secrets.compare_digest: constant time, and of one length whatever the
    client sends, so the comparison tells nothing about a key. CORS preflights (OPTIONS) pass, as in vLLM."""

    def __init__(self, app: ASGIApp, keys: list[str]):
        self.app = app
        self.digests = [_digest(k) for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or self._authorized(scope):
            return await self.app(scope, receive, send)
        body = error_body("Unauthorized: a valid API key is required (Authorization: Bearer <key>).",
                          HTTP_ERROR_TYPES[401], 401)
        await JSONResponse(body, status_code=401)(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if is_public(path):
            return True
        scheme, _, given = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        given_digest = _digest(given)
        match = False
        for digest in self.digests:          # no early exit: the time does not say which key matched
            match |= secrets.compare_digest(given_digest, digest)
        return match


class BodySizeLimit:
    """Refuse a request body larger than `max_bytes` with a 413, before it is held in memory: at once when
    Content-Length announces it, else (a chunked body) as soon as the bytes received pass the limit.
    Starlette's own limit answers in plain text where the route does not read the body."""

    def __init__(self, app: ASGIApp, max_bytes: int, flag: str):
        self.app = app
        self.max_bytes = max_bytes
        self.message = (f"The request body is larger than this server's limit of {max_bytes} bytes "
                        f"(raise it with {flag}).")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            body = error_body(self.message, HTTP_ERROR_TYPES[413], 413)
            return await JSONResponse(body, status_code=413)(scope, receive, send)
        received = 0

        async def receive_limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, self.message)   # inside FastAPI's body read: its 413 handler
            return message

        await self.app(scope, receive_limited, send)
