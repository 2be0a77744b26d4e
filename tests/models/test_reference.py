"""The reference suite: every architecture and checkpoint format jaxpaged loads, served by `LLM`, against
HF transformers (PyTorch, CPU) on the same checkpoint.

Cases: a tiny random-weight model of each architecture (a safetensors folder saved by transformers), and
the real SmolLM2-135M-Instruct from its Q4_1 GGUF (jaxpaged converts it to a folder; HF loads the GGUF
file itself). Each case's engine has limits that force the mechanism under test, and runs three workloads:

  chunked  one request whose prompt is longer than the step's token budget (max_num_batched_tokens)
  prefix   a request, then one whose prompt shares full blocks with it: a prefix-cache hit
  preempt  a batch whose blocks do not fit the pool at once (num_gpu_blocks_override): preemption

float32: the prompt logprobs (teacher-forced) and the sampled tokens' logprobs are within 1e-4 of HF's
log-softmax of the raw logits, and the greedy tokens (64 unless EOS ends a request) are HF's greedy
continuation. bfloat16 (test_reference_bf16.py, a module of its own so that the two halves run in parallel):
the same workloads against HF in bfloat16.
"""
import dataclasses
import os

import numpy as np
import pytest
import torch

from conftest import TINY_MODELS, hf_default_gguf_model, save_tiny_baichuan, save_tiny_chatglm, save_tiny_model
from jaxpaged import LLM, SamplingParams
from jaxpaged.models.config import SUPPORTED_ARCHITECTURES

pytestmark = pytest.mark.cost(95)

MAX_TOKENS = 64
MAX_MODEL_LEN = 128
BLOCK_SIZE = 8
CHUNK = 16                                          # the step's token budget: every prompt is longer
NUM_BLOCKS = 1 + MAX_MODEL_LEN // BLOCK_SIZE        # the null block + one full-length request
LOGPROB_ATOL = 1e-4
NEAR_TIE = 0.25         # nats: a few bf16 rounding steps of logits of magnitude 10-20

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SCORED = GREEDY.clone(logprobs=0, prompt_logprobs=0)      # also the logprobs of its own tokens


@dataclasses.dataclass
class Case:
    model: str | None               # the folder LLM loads (None: the embedded default model)
    hf: torch.nn.Module              # HF's float32 model of the same checkpoint
    prompts: list[list[int]]        # [chunked, prefix first, prefix second, preempt x 3]


def tiny_case(tmp_path_factory, name: str) -> Case:
    """TINY_MODELS[name] with SmolLM2's tokenizer (its ids cover the small vocabulary) and random prompts."""
    import shutil

    from jaxpaged.engine.llm_engine import resolve_model_path
    path = tmp_path_factory.mktemp(name)
    # weights 10x HF's default scale: logits spread wide, so few greedy choices are near-ties
    hf = save_tiny_model(name, path, initializer_range=0.2)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(resolve_model_path(None), f), path)
    return Case(str(path), hf, random_prompts(hf.config.vocab_size))


def random_prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, n).tolist() for n in (29, 24, 17, 21, 26)]
    prompts.insert(2, prompts[1][:2 * BLOCK_SIZE + 3] + rng.integers(0, vocab, 5).tolist())
    return prompts


def baichuan_case(tmp_path_factory) -> Case:
    """A tiny Baichuan with ALiBi (the 13B models' attention; transformers has no Baichuan class, so HF's
    reference is its Llama on the same weights computing Baichuan's attention: conftest.AlibiLlama)."""
    path = tmp_path_factory.mktemp("baichuan")
    hf = save_tiny_baichuan(path, alibi=True)
    return Case(str(path), hf, random_prompts(hf.config.vocab_size))


def chatglm_case(tmp_path_factory) -> Case:
    """A tiny ChatGLM in THUDM's layout (transformers has no class for it: HF's reference is the Glm whose
    weights it holds under ChatGLM's names, conftest.save_tiny_chatglm)."""
    import shutil

    from jaxpaged.engine.llm_engine import resolve_model_path
    path = tmp_path_factory.mktemp("chatglm")
    hf = save_tiny_chatglm(path, initializer_range=0.2)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(resolve_model_path(None), f), path)
    return Case(str(path), hf, random_prompts(hf.config.vocab_size))


def smollm2_case(tmp_path_factory) -> Case:
    """The default model; HF loads the very GGUF file that jaxpaged converts (dequantized to float32;
    conftest.hf_default_gguf_model keeps what that load gives)."""
    from transformers import AutoTokenizer

    from jaxpaged.engine.llm_engine import resolve_model_path
    hf = hf_default_gguf_model()
    tok = AutoTokenizer.from_pretrained(resolve_model_path(None))      # converted from the GGUF's
    shared = "Once upon a time, in a small village at the edge of a dark forest, there lived"
    texts = ["Translate to French: The weather is nice today and I would like to go for a walk.",
             shared + " an old clockmaker who",
             shared + " a girl who loved to",
             "The capital of France is",
             "def fibonacci(n):",
             "Explain why the sky is blue in one sentence, for a child of five."]
    return Case(None, hf, [tok.encode(t) for t in texts])


# architecture or checkpoint format -> how to build its case (tiny Mistral's window is shorter than its requests)
CASES = {
    **{name: lambda f, name=name: tiny_case(f, name) for name in TINY_MODELS},
    "baichuan": baichuan_case,
    "chatglm": chatglm_case,
    "smollm2-gguf": smollm2_case,
}
SETUPS = ["chunked", "prefix", "preempt"]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return case_getter(tmp_path_factory)


def case_getter(tmp_path_factory):
    """get(name, dtype) -> (case, its engine): each built on first use and shared by the module's tests."""
    built: dict = {}

    def get(name: str, dtype: str = "float32"):
        if name not in built:
            built[name] = CASES[name](tmp_path_factory)
        case = built[name]
        if (name, dtype) not in built:
            built[name, dtype] = LLM(model=case.model, dtype=dtype, max_model_len=MAX_MODEL_LEN,
                                     block_size=BLOCK_SIZE, max_num_batched_tokens=CHUNK,
                                     num_gpu_blocks_override=NUM_BLOCKS, seed=0)
        return case, built[name, dtype]
    return get


def run_setup(llm: LLM, case: Case, setup: str, scored: bool = True) -> list[tuple]:
    """The setup's workload; asserts that its mechanism ran. Returns (output, its SamplingParams) pairs.
    scored=False asks no logprobs of any request (the same greedy tokens: logprobs never change what is sampled),
    for a caller that judges only the tokens; its engine then compiles only the plain sampler's steps."""
    eng = llm.llm_engine
    p = case.prompts
    with_lps = SCORED if scored else GREEDY
    if setup == "chunked":
        assert len(p[0]) > CHUNK
        prompts, params = [p[0]], [with_lps]
        outs = llm.generate(prompts, params, use_tqdm=False)
    elif setup == "prefix":
        # no prompt logprobs on the second: they would bypass the prefix cache, as in vLLM
        params = [GREEDY, with_lps.clone(prompt_logprobs=None)]
        outs = [llm.generate([p[1 + i]], sp, use_tqdm=False)[0] for i, sp in enumerate(params)]
        assert outs[1].num_cached_tokens >= 2 * BLOCK_SIZE
    else:
        preemptions = eng.scheduler.num_preemptions
        # the third stops at EOS as HF's generate does
        params = [with_lps, GREEDY, GREEDY.clone(ignore_eos=False)]
        outs = llm.generate(p[3:6], params, use_tqdm=False)
        assert eng.scheduler.num_preemptions > preemptions
    pool = eng.kv_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1 and not eng.kv_manager.req_to_blocks
    return list(zip(outs, params))


def hf_logprobs(hf, token_ids: list[int]) -> np.ndarray:
    """f64[len - 1, V]: the log-softmax of HF's raw logits after each token but the last (one forward)."""
    with torch.no_grad():
        logits = hf(torch.tensor([token_ids])).logits[0, :-1]
    return torch.log_softmax(logits.double(), -1).numpy()


def hf_choices(hf, out) -> tuple[np.ndarray, list[int]]:
    """(HF's logprobs after each token of prompt + output, HF's greedy choice after each output prefix).

    The choices are read from one forward over the whole sequence: where every output token is HF's
    argmax after the tokens before it, the output is, by induction, what HF's greedy generate returns
    (which takes the same argmax after the same tokens, one token at a time)."""
    prompt, gen = out.prompt_token_ids, out.outputs[0].token_ids
    lps = hf_logprobs(hf, prompt + gen)
    return lps, lps[len(prompt) - 1:].argmax(-1).tolist()


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("name", CASES)
def test_float32_equals_hf(cases, name, setup):
    case, llm = cases(name)
    eos = set(llm.llm_engine.eos_token_ids)
    for out, sp in run_setup(llm, case, setup):
        prompt, gen = out.prompt_token_ids, out.outputs[0]
        lps, greedy = hf_choices(case.hf, out)
        assert gen.token_ids == greedy
        # ... and it ends where HF's generate would: at MAX_TOKENS, or at its first EOS unless ignored
        stopped = not sp.ignore_eos and gen.token_ids[-1] in eos
        assert len(gen.token_ids) == MAX_TOKENS or stopped
        assert sp.ignore_eos or not eos & set(gen.token_ids[:-1])
        assert gen.finish_reason == ("stop" if stopped else "length")
        if sp.prompt_logprobs is not None:
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
            got = [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], prompt[1:])]
            np.testing.assert_allclose(got, lps[np.arange(len(prompt) - 1), prompt[1:]], rtol=0, atol=LOGPROB_ATOL)
        if sp.logprobs is not None:
            got = [entry[t].logprob for entry, t in zip(gen.logprobs, gen.token_ids)]
            rows = np.arange(len(prompt) - 1, len(prompt) - 1 + len(gen.token_ids))
            np.testing.assert_allclose(got, lps[rows, gen.token_ids], rtol=0, atol=LOGPROB_ATOL)


def test_every_architecture_has_a_case():
    """A new architecture in jaxpaged's table needs its case here (and its tiny model in conftest)."""
    uncovered = [a for a, family in SUPPORTED_ARCHITECTURES.items()
                 if a.removesuffix("ForCausalLM").lower() not in CASES and family not in CASES]
    assert not uncovered
