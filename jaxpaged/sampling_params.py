"""Sampling parameters, as vLLM's `SamplingParams` (same field names, defaults and checks)."""
from __future__ import annotations

import dataclasses
from enum import IntEnum

_SAMPLING_EPS = 1e-5


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0   # every output carries all text/tokens so far (LLM.generate)
    DELTA = 1        # every output carries only what is new since the last one (streaming)
    FINAL_ONLY = 2   # one output, when the request finishes


@dataclasses.dataclass
class SamplingParams:
    n: int = 1                                  # independent samples per prompt
    best_of: int | None = None                  # accepted for compatibility; must equal n when set
    presence_penalty: float = 0.0               # OpenAI: subtract when a token appeared in the output
    frequency_penalty: float = 0.0              # OpenAI: subtract count * penalty
    repetition_penalty: float = 1.0             # CTRL-style, over prompt and output tokens
    temperature: float = 1.0                    # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0                              # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None                     # per-request seed: same seed, same output, any batch
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16                 # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None                 # top-k logprobs of each sampled token (plus the sampled one)
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    truncate_prompt_tokens: int | None = None   # keep the prompt's last k tokens (-1: max_model_len of them)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and (not isinstance(self.stop, (list, tuple))
                                      or not all(isinstance(s, str) for s in self.stop)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._verify()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the other sampling knobs have no effect; normalise them so batches stay cheap.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _verify(self) -> None:
        def fail(msg: str):
            raise ValueError(msg)
        if not isinstance(self.n, int) or self.n < 1:
            fail(f"n must be at least 1, got {self.n}.")
        if self.best_of is not None and self.best_of != self.n:
            fail(f"best_of must equal n ({self.n}) when set, got {self.best_of}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:
            fail(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if self.temperature < 0.0:
            fail(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            fail(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            fail(f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            fail(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            fail(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            fail(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                 f"got {self.min_tokens}.")
        if self.logprobs is not None and self.logprobs < 0:
            fail(f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            fail(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")
        if self.seed is not None and not isinstance(self.seed, int):
            fail(f"seed must be an integer, got {self.seed!r}.")
        if any(not s for s in self.stop or ()):
            fail("stop cannot contain an empty string.")
        if self.truncate_prompt_tokens is not None and (not isinstance(self.truncate_prompt_tokens, int)
                                                        or self.truncate_prompt_tokens == 0
                                                        or self.truncate_prompt_tokens < -1):
            fail(f"truncate_prompt_tokens must be -1 (max_model_len) or at least 1, got {self.truncate_prompt_tokens}.")

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def all_stop_token_ids(self) -> set[int]:
        return set(self.stop_token_ids or ())

    def clone(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass
class BeamSearchParams:
    """As vLLM's `BeamSearchParams` for `LLM.beam_search`."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}.")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
