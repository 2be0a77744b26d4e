"""jaxpaged: vLLM-style LLM serving in JAX, Flax and Pallas.

    from jaxpaged import LLM, SamplingParams
    llm = LLM()                      # the embedded SmolLM2-135M-Instruct
    print(llm.generate("Hello", SamplingParams(max_tokens=16))[0].outputs[0].text)
"""
import logging as _logging

from jaxpaged import envs as _envs  # (sets allocator defaults before jax starts)

if _envs.JAXPAGED_CONFIGURE_LOGGING and not _logging.getLogger("jaxpaged").handlers:
    _handler = _logging.StreamHandler()
    _handler.setFormatter(_logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
    _root = _logging.getLogger("jaxpaged")
    _root.addHandler(_handler)
    _root.setLevel(_logging.INFO)
    _root.propagate = False
from jaxpaged.config import EngineArgs
from jaxpaged.outputs import CompletionOutput, Logprob, RequestOutput
from jaxpaged.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

__version__ = "0.1.0"


def __getattr__(name):
    # LLM pulls in jax and transformers: import it lazily so `import jaxpaged` stays cheap.
    if name == "LLM":
        from jaxpaged.llm import LLM
        return LLM
    if name == "AsyncLLM":
        from jaxpaged.engine.async_llm import AsyncLLM
        return AsyncLLM
    raise AttributeError(name)


def generate(prompts, sampling_params: SamplingParams | None = None, **engine_args):
    """One-shot: build an LLM from engine_args, generate, return the RequestOutputs."""
    from jaxpaged.llm import LLM
    return LLM(**engine_args).generate(prompts, sampling_params)


__all__ = ["LLM", "AsyncLLM", "EngineArgs", "SamplingParams", "BeamSearchParams", "RequestOutput",
           "CompletionOutput", "Logprob", "RequestOutputKind", "generate", "__version__"]
