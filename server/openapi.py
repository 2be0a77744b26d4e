"""What the OpenAPI schema (/openapi.json, /docs) says beyond FastAPI's defaults: refusals in OpenAI's error
schema (request validation errors are 400s here, so never FastAPI's 422), the events of the streaming
routes, and the API key. Schema-driven clients and fuzzers read it; tests/server/test_server_fuzz.py holds
the server to it."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from jaxpaged.server.protocol import ChatCompletionChunk, CompletionResponse, ErrorResponse

Responses = dict[int | str, dict[str, Any]]
REF = "#/components/schemas/{model}"
SECURITY_SCHEME = "APIKey"

REFUSED: Responses = {"4XX": {"model": ErrorResponse, "description": "A refused request, in OpenAI's error schema"}}
ENGINE_GONE: Responses = {503: {"model": ErrorResponse, "description": "The engine core died or stalled"}}
# The stream events' payloads, which no route names as its model: added to the components here.
STREAM_CHUNKS: tuple[type[BaseModel], ...] = (CompletionResponse, ChatCompletionChunk)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def generates(chunk: type[BaseModel]) -> Responses:
    """A generating route's answers besides its response model: with `stream`, server-sent events whose
    data is a `chunk` or an error as JSON, then `[DONE]`; refusals; a 503 once the engine core is gone."""
    data = {"anyOf": [{"const": "[DONE]"},
                      {"type": "string", "contentMediaType": "application/json",
                       "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}}]}
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {**REFUSED, **ENGINE_GONE,
            200: {"description": "The whole response, or with `stream` server-sent events: JSON chunks (an error "
                                 "chunk if generation fails), then `data: [DONE]`",
                  "content": {"text/event-stream": {"schema": event}}}}


def customize(app: FastAPI, guarded: Callable[[str], bool] | None) -> None:
    """Extend app.openapi() once: the stream chunks' schemas, and with an API key (`guarded` tells which
    paths need it) the bearer scheme on those routes (Swagger UI's Authorize button)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        schema = app.openapi_schema
        if schema is None:
            schema = generate()             # (which FastAPI keeps in app.openapi_schema: edited once)
            components = schema.setdefault("components", {})
            _, defs = models_json_schema([(m, "serialization") for m in STREAM_CHUNKS], ref_template=REF)
            for name, definition in defs["$defs"].items():
                components.setdefault("schemas", {}).setdefault(name, definition)
            if guarded is not None:
                components["securitySchemes"] = {SECURITY_SCHEME: {"type": "http", "scheme": "bearer"}}
                for path, operations in schema["paths"].items():
                    if guarded(path):
                        for operation in operations.values():
                            operation["security"] = [{SECURITY_SCHEME: []}]
        return schema

    # FastAPI's documented way to extend the schema
    app.openapi = openapi  # type: ignore[method-assign]
