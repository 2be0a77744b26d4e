"""Request and response bodies of the OpenAI API (and vLLM's extras), as pydantic v2 models."""
from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jaxpaged.engine.input_processor import truncate_prompt
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("jaxpaged.server")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


MAX_N = 128               # samples per prompt, as OpenAI's limit (each is a request in the engine)
# Fields of OpenAI's and vLLM's APIs that jaxpaged does not implement yet: refused with a 400 naming them,
# never ignored (a client relying on one must know). Each maps to the values that ask for nothing (the
# field's default, which clients often send): those pass, as does null.
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    # tool calling and structured outputs
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "parallel_tool_calls": (), "response_format": ({"type": "text"},), "guided_json": (), "guided_regex": (),
    "guided_choice": (), "guided_grammar": (), "guided_decoding_backend": (), "guided_whitespace_pattern": (),
    "structured_outputs": (), "structural_tag": (),
    # sampling and decoding that the engine has no path for behind the API
    "use_beam_search": (False,), "length_penalty": (1.0,), "allowed_token_ids": (), "bad_words": ([],),
    "logits_processors": (), "vllm_xargs": (),
    # inputs and outputs beyond text
    "prompt_embeds": (), "suffix": ("",), "modalities": (["text"],), "audio": (), "prediction": (),
    "mm_processor_kwargs": (), "documents": (), "web_search_options": (), "reasoning_effort": (),
    # adapters, cache control, disaggregation
    "lora_request": (), "cache_salt": (), "kv_transfer_params": (),
}
# OpenAI's fields about storing, billing and tagging a request, which change nothing about its tokens:
# accepted as they are, without the log's warning for fields of neither API.
IGNORED_FIELDS = frozenset({"metadata", "store", "service_tier"})


def _same(value: Any, default: Any) -> bool:
    """Equal as JSON values: 1 is 1.0, but 0 is no false (a bool only equals a bool)."""
    return value == default and isinstance(value, bool) == isinstance(default, bool)


class FieldError(ValueError):
    """A request's value refused by a check across fields; `param` names the field (the error's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


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
            for name, inert in NOT_IMPLEMENTED.items():
                value = data.get(name)
                if value is not None and not any(_same(value, v) for v in inert):
                    raise FieldError(f"`{name}` is not supported by this server yet.", name)
            # Fields of neither API (a typo, another server's extension) change nothing: as vLLM, they are
            # ignored with a warning in the log rather than refused.
            unknown = sorted(set(data) - set(cls.model_fields) - set(NOT_IMPLEMENTED) - IGNORED_FIELDS)
            if unknown:
                logger.warning("The following fields were present in the request but ignored: %s", unknown)
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
    prompt_logprobs: int | None = Field(None, ge=0)      # vLLM's: the prompt tokens' logprobs, top k of each
    spaces_between_special_tokens: bool = True
    # keep only the prompt's last k tokens (-1: max_model_len of them), as vLLM
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    return_tokens_as_token_ids: bool = False              # logprobs name tokens "token_id:<id>"
    request_id: str | None = Field(None, min_length=1, max_length=256)    # names the response: <prefix>-<request_id>

    @model_validator(mode="after")
    def _check_extras(self) -> SamplingFields:
        if self.prompt_logprobs is not None and self.stream:
            raise FieldError("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        if self.truncate_prompt_tokens == 0:
            raise FieldError("truncate_prompt_tokens must be -1 (max_model_len) or at least 1.",
                             "truncate_prompt_tokens")
        return self

    def truncate(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as truncate_prompt_tokens keeps it (the engine's rule). The server applies it itself,
        before max_tokens' default is taken from the kept length, so its SamplingParams leave it unset."""
        return truncate_prompt(token_ids, self.truncate_prompt_tokens, max_model_len)

    def ids(self, prefix: str) -> tuple[str, str]:
        """(the engine's id, the response's id). The engine's is always drawn here: a client's request_id
        need not be unique, and two running requests of one id would collide in the engine."""
        engine_id = random_id(prefix)
        return engine_id, engine_id if self.request_id is None else f"{prefix}-{self.request_id}"

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: dict) -> SamplingParams:
        """Raises ValueError (-> 400) for values out of range, with SamplingParams' messages. (logprobs past
        --max-logprobs: the engine's check, InputProcessor.validate_prompt.) defaults: the model's sampling
        defaults (engine/generation_config.py), for the fields the request leaves unset."""
        try:
            bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        except ValueError:
            raise ValueError("logit_bias keys must be token ids (integers as strings).") from None

        def field(name: str, neutral):
            value = getattr(self, name)
            return defaults.get(name, neutral) if value is None else value
        return SamplingParams(
            n=self.n, temperature=field("temperature", 1.0), top_p=field("top_p", 1.0), top_k=field("top_k", 0),
            min_p=field("min_p", 0.0), repetition_penalty=field("repetition_penalty", 1.0),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output, prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens, logit_bias=bias or None,
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
    add_special_tokens: bool = True        # vLLM's: the tokenizer's BOS (and the like) on text prompts

    def to_sampling_params(self, max_tokens: int | None, defaults: dict | None = None) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}) when set, got {self.best_of}.")
        return self._sampling_params(max_tokens, self.logprobs, defaults or {})


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token's entry in vLLM's prompt_logprobs."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: one entry per prompt token, {token id (as a JSON key): PromptLogprob} holding the
# prompt's own token and the top k; null for the first token, which nothing precedes.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


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

    @model_validator(mode="before")
    @classmethod
    def _refuse_tool_calls(cls, data: Any) -> Any:
        # an earlier turn's tool calls would reach the template as nothing: refused, as `tools` is
        if isinstance(data, dict) and data.get("tool_calls"):
            raise FieldError("`tool_calls` in messages are not supported by this server yet.", "messages")
        return data

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
    continue_final_message: bool = False   # the prompt ends inside the last message: the model continues it
    echo: bool = False                     # the last message's content starts the reply, if it is the assistant's
    add_special_tokens: bool = False       # the template holds the special tokens already
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_generation_prompt(cls, data: Any) -> Any:
        # as vLLM: both named true is a contradiction; continue_final_message alone implies no generation prompt
        if isinstance(data, dict) and data.get("continue_final_message") and data.get("add_generation_prompt"):
            raise FieldError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                             "continue_final_message")
        return data

    def to_sampling_params(self, max_tokens: int | None, defaults: dict | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true.")
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None,
                                     defaults or {})


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
    prompt_logprobs: PromptLogprobs | None = None


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
    add_special_tokens: bool = True        # on `prompt` (a chat's template holds its special tokens)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
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
