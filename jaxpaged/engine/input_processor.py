"""The API process's side of a new request: tokenize, check against the core's limits, and expand into one
EngineCoreRequest per sample. Everything here is read-only towards the core, so a bad request is refused
before anything reaches it."""
from __future__ import annotations

import time

import numpy as np

from jaxpaged.engine.kv_cache_manager import cdiv
from jaxpaged.engine.messages import CoreInfo, EngineCoreRequest
from jaxpaged.engine.scheduler import max_kv_slots
from jaxpaged.sampling_params import SamplingParams

PromptType = str | list[int] | dict


def truncate_prompt(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: max_model_len of them; None: all).

        [5, 6, 7, 8], keep 2 -> [7, 8]
    """
    if keep is None:
        return token_ids
    if keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({max_model_len}). "
                         "Please, select a smaller truncation size.")
    return token_ids[-(max_model_len if keep == -1 else keep):]


class InputProcessor:
    def __init__(self, tokenizer, info: CoreInfo, seed: int = 0, client_index: int = 0):
        """client_index: this API process's number among --api-server-count (0 for LLM and a single one)."""
        self.tokenizer = tokenizer
        self.info = info
        self.client_index = client_index
        tok_eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        self.eos_token_ids = tuple(sorted(set(info.eos_token_ids) | tok_eos))
        # per-sample seeds of requests that give none (a sequence of its own in each API process)
        self._rng = np.random.default_rng(seed if client_index == 0 else [seed, client_index])

    def tokenize_prompt(self, prompt: PromptType, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt; add_special_tokens: the tokenizer's own (a BOS) on text prompts."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if isinstance(prompt, (list, tuple)):
            ids = _token_ids(prompt)
            if ids is not None:
                return None, ids
        raise ValueError("a prompt must be a string, a list of token ids, or a dict with 'prompt' or "
                         "'prompt_token_ids'")

    def truncate(self, token_ids: list[int], params: SamplingParams) -> list[int]:
        return truncate_prompt(token_ids, params.truncate_prompt_tokens, self.info.max_model_len)

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        info = self.info
        max_model_len = info.max_model_len
        if not token_ids:
            raise ValueError("The prompt cannot be empty.")
        n = len(token_ids)
        if n >= max_model_len:
            raise ValueError(f"This model's maximum context length is {max_model_len} tokens. However, "
                             f"you requested {n + (params.max_tokens or 0)} tokens ({n} in the messages, "
                             f"{params.max_tokens or 0} in the completion). Please reduce the length of "
                             "the messages or completion.")
        if params.max_tokens is not None and n + params.max_tokens > max_model_len:
            raise ValueError(f"This model's maximum context length is {max_model_len} tokens. However, "
                             f"you requested {n + params.max_tokens} tokens ({n} in the messages, "
                             f"{params.max_tokens} in the completion). Please reduce the length of the "
                             "messages or completion.")
        # Refuse what could never run, rather than admit it to wait or preempt itself forever: the slots it
        # must hold at once to finish have to fit in the whole pool.
        slots = max_kv_slots(n, params.max_tokens, max_model_len)
        if info.kv_window_slots is not None:      # blocks behind a sliding window go back to the pool
            slots = min(slots, info.kv_window_slots)
        num_blocks = info.num_blocks - 1
        if cdiv(slots, info.block_size) > num_blocks:
            limit = f"max_tokens={params.max_tokens}" if params.max_tokens is not None else \
                f"no max_tokens: up to max_model_len={max_model_len}"
            raise ValueError(f"This request needs up to {slots} tokens of KV cache ({n} in the prompt, {limit}), "
                             f"more than the whole KV cache holds: {num_blocks * info.block_size} tokens "
                             f"({num_blocks} blocks of {info.block_size}), so it could never run. Lower max_tokens "
                             "or shorten the prompt, or give the KV cache more memory (gpu_memory_utilization, "
                             "num_gpu_blocks_override).")
        for name, k in (("sample", params.logprobs), ("prompt", params.prompt_logprobs)):
            if k is not None and k > info.max_logprobs:
                raise ValueError(f"Requested {name} logprobs of {k}, which is greater than max allowed: "
                                 f"{info.max_logprobs}")
        vocab = info.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:        # two C passes over the list
            bad = next(t for t in token_ids if not 0 <= t < vocab)
            raise ValueError(f"Token id {bad} is out of vocabulary (vocab size {vocab}).")
        bad_bias = [t for t in (params.logit_bias or {}) if not 0 <= t < vocab]
        if bad_bias:
            raise ValueError(f"token_id(s) {bad_bias} in logit_bias contain out-of-vocab token ids "
                             f"(vocab size {vocab}).")

    def max_new_tokens(self, num_prompt_tokens: int) -> int:
        """The most tokens a request with this prompt may generate: up to max_model_len, and no more than the
        whole KV cache can hold for it (prompt + max_tokens - 1 slots, max_kv_slots). Negative when the
        prompt alone is too long."""
        info = self.info
        pool_tokens = (info.num_blocks - 1) * info.block_size
        if info.kv_window_slots is not None and info.kv_window_slots <= pool_tokens:
            return info.max_model_len - num_prompt_tokens      # the window's blocks are all it holds
        return min(info.max_model_len, pool_tokens + 1) - num_prompt_tokens

    def make_requests(self, request_id: str, token_ids: list[int], params: SamplingParams,
                      arrival_time: float | None = None, priority: int = 0) -> list[EngineCoreRequest]:
        """One core request per sample: n > 1 becomes n requests that share the prompt's blocks through the
        prefix cache, the i-th seeded params.seed + i (or drawn)."""
        arrival = time.time() if arrival_time is None else arrival_time
        out = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            sample_params = params if params.n == 1 else params.clone(n=1, best_of=None, seed=seed)
            sample_seed = seed if seed is not None else int(self._rng.integers(0, 2**31))
            out.append(EngineCoreRequest(request_id if params.n == 1 else f"{i}_{request_id}", token_ids,
                                         sample_params, self.eos_token_ids, arrival, sample_seed, priority,
                                         self.client_index))
        return out


def _token_ids(prompt: list | tuple) -> list[int] | None:
    """The prompt's token ids as Python ints, or None if an item is not an integer. numpy converts and checks
    the list in C: the per-item Python loop was a tenth of the API process's time per request with
    token-id prompts (ShareGPT over HTTP)."""
    if not prompt:
        return []
    ids = np.asarray(prompt)
    if ids.ndim == 1 and ids.dtype.kind in "iub":
        return ids.astype(np.int64).tolist() if ids.dtype.kind == "b" else ids.tolist()
    # ids past int64's range become an object array: check them one by one (the vocabulary check refuses them)
    if ids.ndim == 1 and ids.dtype == object and all(isinstance(t, (int, np.integer)) for t in prompt):
        return [int(t) for t in prompt]
    return None
