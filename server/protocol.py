"""Request and response bodies of the OpenAI API (and vLLM's extras), as pydantic v2 models."""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jaxpaged.sampling_params import RequestOutputKind, SamplingParams



def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


MAX_N = 128               # samples per prompt, as OpenAI's limit (each is a request in the engine)
# Fields of OpenAI's and vLLM's APIs that jaxpaged does not implement yet: refused with a 400 naming them,
# never ignored (a client relying on one must know). response_format {"type": "text"} is the default.
NOT_IMPLEMENTED = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "response_format",
                   "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                   "logits_processors", "prompt_embeds", "lora_request", "suffix")


class OpenAIModel(BaseModel):
    # Strict: a value of another JSON type is refused, not coerced (true is no token id, "16" no max_tokens),
    # as OpenAI does; so what the server takes is what its OpenAPI schema says. NaN and infinities (JSON's
    # NaN / Infinity literals, or 1e999) are refused: no sampler value may be non-finite.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


# ---- errors ------------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- shared ------------------------------------------------------------------------------------
class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False   # vLLM: usage on every chunk


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class SamplingFields(OpenAIModel):
    """The sampling fields both endpoints share: OpenAI's, then vLLM's extras."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in NOT_IMPLEMENTED:
                value = data.get(name)
                if value is None or (name == "response_format" and value == {"type": "text"}):
                    continue
                raise ValueError(f"`{name}` is not supported by this server yet.")
        return data

    # The ranges are OpenAI's and vLLM's (SamplingParams checks the same for LLM); declared here, they reach
    # the OpenAPI schema and refuse a value before anything is built from it (n=100000 would make 100000
    # requests).
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1)      # int64, as vLLM (it crosses to the core)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None     # OpenAI's range
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError (-> 400) for values out of range, with SamplingParams' messages. (logprobs past
        --max-logprobs: the engine's check, InputProcessor.validate_prompt.)"""
        try:
            bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        except ValueError:
            raise ValueError("logit_bias keys must be token ids (integers as strings).") from None
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logit_bias=bias or None,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# ---- /v1/completions ---------------------------------------------------------------------------
class CompletionRequest(SamplingFields):
    # Examples for the OpenAPI schema: /docs shows them, schema-driven clients and fuzzers start from them.
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.7},
        {"prompt": ["The capital of France is", "The three primary colors are"], "max_tokens": 8, "n": 2,
         "seed": 0, "logprobs": 2, "echo": True},
        {"prompt": [100, 200, 300], "max_tokens": 4, "temperature": 0},
        {"prompt": "def fibonacci(n):", "max_tokens": 16, "stream": True, "stop": ["\n\n"],
         "stream_options": {"include_usage": True}},
    ]})

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}) when set, got {self.best_of}.")
        return self._sampling_params(max_tokens, self.logprobs)


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---- /v1/chat/completions ----------------------------------------------------------------------
class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"content parts of type {part.type!r} are not supported (text only).")
        return "\n".join(part.text or "" for part in self.content)


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16},
        {"messages": [{"role": "system", "content": "You are terse."},
                      {"role": "user", "content": [{"type": "text", "text": "Name a color."}]}],
         "max_completion_tokens": 8, "logprobs": True, "top_logprobs": 2, "stream": True, "n": 2},
    ]})

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def to_sampling_params(self, max_tokens: int | None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true.")
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---- /v1/models, /tokenize, /detokenize --------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxpaged"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIModel):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "Hello world", "return_token_strs": True},
        {"messages": [{"role": "user", "content": "Hello"}]}]})

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"tokens": [100, 200, 300]}]})

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
