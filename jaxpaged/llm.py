"""`LLM`: offline batched generation, as vLLM's `LLM` class."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine, PromptType
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class LLM:
    """An engine plus a loop: `generate` adds every prompt, steps until all finish, returns in order.

    LLM(model=None) serves the embedded SmolLM2-135M-Instruct. Keyword arguments are EngineArgs'.
    """

    def __init__(self, model: str | None = None, **kwargs):
        self.llm_engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's sampling defaults (its generation_config.json, unless
        generation_config="vllm"): what generate uses when given none."""
        return SamplingParams(**self.llm_engine.default_sampling)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        # Offline generation only wants finished requests: no per-step outputs to build.
        params = [sp if sp.output_kind == RequestOutputKind.FINAL_ONLY
                  else sp.clone(output_kind=RequestOutputKind.FINAL_ONLY) for sp in params]
        # Tokenize and validate every prompt before queueing any, so one bad prompt leaves the engine
        # untouched; the engine then receives the checked token ids and neither tokenizes nor checks again.
        tokenized = []
        for p, sp in zip(prompts, params):
            text, token_ids = self.llm_engine.tokenize_prompt(p)
            token_ids = self.llm_engine.input_processor.truncate(token_ids, sp)
            self.llm_engine.validate_prompt(token_ids, sp)
            tokenized.append((text, token_ids))
        ids = []
        for i, ((text, token_ids), sp) in enumerate(zip(tokenized, params)):
            rid = str(next(self._counter))
            self.llm_engine.add_validated_request(rid, text, token_ids, sp, priority=priority[i] if priority else 0)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"}) or a list of them. continue_final_message:
        the prompt ends inside the last message, which the model continues (no generation prompt then);
        chat_template_kwargs: more variables for the template (e.g. enable_thinking)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.llm_engine.tokenizer
        kwargs = dict(chat_template_kwargs or {})
        if continue_final_message:
            kwargs["continue_final_message"] = True
        prompts = [tok.apply_chat_template(c, chat_template=chat_template, tokenize=False,
                                           add_generation_prompt=add_generation_prompt and not continue_final_message,
                                           **kwargs) for c in conversations]
        # the template already holds any BOS; don't add special tokens twice
        token_prompts = [{"prompt": p, "prompt_token_ids": tok.encode(p, add_special_tokens=False)} for p in prompts]
        return self.generate(token_prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm or len(request_ids) < 2,
                   dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        except BaseException:
            engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]

    def beam_search(self, prompts, params: BeamSearchParams):
        from jaxpaged.engine.beam_search import beam_search
        return beam_search(self, prompts, params)
