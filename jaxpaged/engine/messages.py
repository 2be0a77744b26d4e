"""What crosses the API process <-> engine core boundary: plain typed data, encoded with msgspec.

The API process (AsyncLLM, or LLMEngine in-process) tokenizes, checks and expands a request into one
EngineCoreRequest per sample (n > 1 is n of them); the core schedules, runs and samples, and returns, per
engine step, one EngineCoreOutputs: each request's new token ids (several per request after a multi-step
program), why it finished (EOS, stop token id, length; never a stop string: the API process detokenizes,
finds stop strings and aborts the request in the core) and, when asked, logprobs as plain lists. A core
snapshot of the counters /metrics reads travels with it.

Over the process boundary these go as msgpack (`Encoder`/`Decoder`): structs are arrays on the wire,
fields at their defaults are left out, and nothing is pickled.
"""
from __future__ import annotations

import enum

import msgspec

from jaxpaged.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One sample of a request, checked by the API process (the core trusts it)."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams         # n == 1; seed per sample
    eos_token_ids: tuple[int, ...]          # the model's and the tokenizer's EOS ids
    arrival_time: float                     # time.time() at arrival (API process)
    sample_seed: int                        # the request's PRNG seed (params.seed + index, or drawn)
    priority: int = 0
    client_index: int = 0                   # the API process it came from (--api-server-count)


class SampleLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Per new token, in order: its logprob and rank, and the request's top-k alternatives."""
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class PromptLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Scores of prompt tokens first_index .. first_index + len - 1 (each from the token before it)."""
    first_index: int
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class FinishReason(enum.IntEnum):
    STOP = 0            # EOS or a stop token id (stop_reason holds the id)
    LENGTH = 1          # max_tokens or max_model_len
    ABORT = 2

    @property
    def text(self) -> str:
        return ("stop", "length", "abort")[self]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's progress in one engine step."""
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None          # the stop token id that finished it
    num_cached_tokens: int = 0              # prompt tokens served by the prefix cache
    new_logprobs: SampleLogprobs | None = None
    new_prompt_logprobs: PromptLogprobs | None = None


class CoreStats(msgspec.Struct, array_like=True, gc=False):
    """The core's counters and gauges after a step (vLLM's metric names in server/metrics.py)."""
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage: float = 0.0             # fraction of blocks in use
    kv_cache_waste: float = 0.0             # allocated-but-unused slots over allocated (running requests)
    num_free_blocks: int = 0
    prefix_cache_queries: int = 0           # tokens of first admissions looked up in the prefix cache
    prefix_cache_hits: int = 0              # tokens it served
    num_preemptions: int = 0
    prompt_tokens: int = 0                  # whole prompts, counted at each request's first token
    generation_tokens: int = 0              # tokens sampled (the API process may drop some after a stop string)
    num_steps: int = 0
    device_memory_bytes: int = 0            # the device allocator's bytes in use (0 where it keeps no count)


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, tag=True, gc=False):
    """One engine step's outputs, and the core's counters after it."""
    outputs: list[EngineCoreOutput]
    stats: CoreStats | None = None


class CoreInfo(msgspec.Struct, array_like=True, tag=True, gc=False):
    """What the API process needs from the core to check requests; sent once, when the core is ready."""
    model_path: str
    architecture: str
    dtype: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]          # from the model's config (the API process adds the tokenizer's)
    max_model_len: int
    max_num_seqs: int
    max_logprobs: int
    block_size: int
    num_blocks: int                         # the pool, the null block included
    num_scheduler_steps: int
    run_summary: str                        # RunConfig.summary()
    startup_seconds: float
    # With a sliding window on every layer: the most KV slots a request holds at once (its blocks behind the
    # window go back to the pool), else None: every token it keeps
    kv_window_slots: int | None = None


class CoreFailure(msgspec.Struct, array_like=True, tag=True, gc=False):
    """The core's last message before it exits on an error (to every API process; the first API process
    sends it to the others when the core died without a word). Its traceback stays in the core's log: this
    message reaches clients (/health, error bodies)."""
    error: str                              # "ExceptionType: message"


# The core -> API process stream: CoreInfo once ready, then EngineCoreOutputs per step; CoreFailure on an error.
CoreMessage = CoreInfo | EngineCoreOutputs | CoreFailure


class Command(enum.IntEnum):
    """The API process -> core commands: the first frame of each message; the payload is the second."""
    ADD = 0             # list[EngineCoreRequest]
    ABORT = 1           # list[str]: request ids
    SHUTDOWN = 2        # nothing


def core_message_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreMessage)


def add_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(list[EngineCoreRequest])


def abort_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(list[str])
