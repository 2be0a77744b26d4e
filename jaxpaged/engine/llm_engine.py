"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time, with the engine core in this process.

The API-process half (InputProcessor, OutputProcessor) is the same one AsyncLLM runs beside a core process;
here the core is called directly (LLM, beam search, the benchmarks). The core's parts (scheduler, runner,
KV manager, run config) are reachable as attributes for in-process tools and tests.
"""
from __future__ import annotations

import logging

from jaxpaged.config import EngineArgs
from jaxpaged.engine.core import EngineCore
from jaxpaged.engine.model_path import resolve_model_path
from jaxpaged.engine.generation_config import default_sampling_fields
from jaxpaged.engine.detokenizer import prepare as prepare_detokenizer
from jaxpaged.engine.input_processor import InputProcessor, PromptType
from jaxpaged.engine.output_processor import OutputProcessor
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import SamplingParams

logger = logging.getLogger("jaxpaged.engine")

__all__ = ["LLMEngine", "PromptType", "resolve_model_path"]


def _from_core(name: str) -> property:
    return property(lambda self: getattr(self.core, name), doc=f"EngineCore.{name}")


class LLMEngine:
    def __init__(self, args: EngineArgs):
        from jaxpaged.engine.tokenizer import load_tokenizer
        self.args = args
        self.core = core = EngineCore(args)
        self.tokenizer = load_tokenizer(args.tokenizer or core.model_path)
        self.info = core.info()
        self.input_processor = InputProcessor(self.tokenizer, self.info, args.seed)
        # the model's sampling defaults (--generation-config): what LLM.get_default_sampling_params gives
        self.default_sampling = default_sampling_fields(self.info.model_path, args.generation_config,
                                                        args.override_generation_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.request_stats = self.output_processor.stats
        prepare_detokenizer(self.tokenizer)

    # the core's parts, in this process (read-only views for in-process tools, tests and beam search)
    scheduler = _from_core("scheduler")
    runner = _from_core("runner")
    kv_manager = _from_core("kv_manager")
    stats = _from_core("stats")
    run = _from_core("run")
    model_config = _from_core("model_config")
    model_path = _from_core("model_path")
    buckets = _from_core("buckets")
    num_blocks = _from_core("num_blocks")
    block_size = _from_core("block_size")
    max_model_len = _from_core("max_model_len")
    max_num_seqs = _from_core("max_num_seqs")
    max_num_batched_tokens = _from_core("max_num_batched_tokens")
    num_scheduler_steps = _from_core("num_scheduler_steps")
    kv_cache_tokens = _from_core("kv_cache_tokens")
    startup_seconds = _from_core("startup_seconds")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.input_processor.eos_token_ids

    # ---- requests -----------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return self.input_processor.tokenize_prompt(prompt)

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        self.input_processor.validate_prompt(token_ids, params)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> list[str]:
        """Validate, tokenize and queue a request (n > 1 becomes n core requests sharing the prompt's
        blocks through the prefix cache). Raises ValueError for a request that could never run."""
        params = params or SamplingParams()
        text, token_ids = self.tokenize_prompt(prompt)
        token_ids = self.input_processor.truncate(token_ids, params)
        self.validate_prompt(token_ids, params)
        return self.add_validated_request(request_id, text, token_ids, params, arrival_time, priority)

    def add_validated_request(self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams,
                              arrival_time: float | None = None, priority: int = 0) -> list[str]:
        """add_request for a prompt that tokenize_prompt and validate_prompt have already seen (LLM.generate
        checks a whole batch before it queues any), so it is not checked twice."""
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        reqs = self.input_processor.make_requests(request_id, token_ids, params, arrival_time, priority)
        for r in reqs:
            if r.request_id in self.core.scheduler.requests:
                raise ValueError(f"request id {r.request_id!r} is already in use")
        self.output_processor.add(request_id, text, token_ids, params, [r.request_id for r in reqs],
                                  reqs[0].arrival_time)
        for r in reqs:
            self.core.add_request(r)
        return [r.request_id for r in reqs]

    def abort_request(self, request_ids) -> None:
        for rid in ([request_ids] if isinstance(request_ids, str) else request_ids):
            self.core.abort_requests(self.output_processor.abort(rid))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.core.scheduler.num_running + self.core.scheduler.num_waiting

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One core step (schedule N, launch it, process N-1), then its outputs through the output
        processor; samples a stop string finished are aborted in the core before the next step."""
        outputs, to_abort = self.output_processor.process(self.core.step())
        if to_abort:
            self.core.abort_requests(to_abort)
        return outputs
