"""The model's sampling defaults (jaxpaged/engine/generation_config.py, vLLM's --generation-config): read from
generation_config.json as transformers reads it, only the fields it sets away from transformers' defaults, the
override on top; LLM.generate without sampling params samples with them."""
import json

import pytest

from conftest import tiny_llama_dir
from jaxpaged import LLM, SamplingParams
from jaxpaged.config import EngineArgs
from jaxpaged.engine.generation_config import default_sampling_fields


def _write(folder, **fields):
    (folder / "generation_config.json").write_text(json.dumps(fields))
    return str(folder)


def test_the_fields_a_generation_config_sets(tmp_path):
    (tmp_path / "m").mkdir()
    model = _write(tmp_path / "m", temperature=0.6, top_p=0.9,
                   top_k=20, repetition_penalty=1.05, max_new_tokens=7, do_sample=True, bos_token_id=1)
    want = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 7}
    assert default_sampling_fields(model) == want
    assert default_sampling_fields(model, "vllm") == {}
    assert default_sampling_fields(model, "vllm", {"top_p": 0.5}) == {"top_p": 0.5}
    assert default_sampling_fields(model, "auto", {"top_p": 0.5}) == {**want, "top_p": 0.5}
    other = _write(tmp_path, min_p=0.1)                                  # a folder of its own
    assert default_sampling_fields(model, other) == {"min_p": 0.1}
    (tmp_path / "empty").mkdir()
    assert default_sampling_fields(str(tmp_path / "empty")) == {}       # no generation_config.json
    with pytest.raises(ValueError, match="generation_config must be"):
        EngineArgs(generation_config=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="unknown fields"):
        EngineArgs(override_generation_config={"temprature": 0.5})


def test_llm_generates_with_the_models_defaults(tmp_path_factory):
    """A model folder whose generation config asks for greedy decoding and 5 tokens: LLM.generate without
    sampling params gives those (get_default_sampling_params); generation_config="vllm" gives SamplingParams'."""
    from pathlib import Path
    model = tiny_llama_dir(tmp_path_factory, "tiny_llama_gc")
    config = json.loads((Path(model) / "generation_config.json").read_text())
    _write(Path(model), **config, temperature=0.0, max_new_tokens=5)
    kw = dict(dtype="float32", max_model_len=128, num_gpu_blocks_override=32, compile_buckets=False)
    llm = LLM(model=model, **kw)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.max_tokens) == (0.0, 5)
    prompt = {"prompt_token_ids": [5, 17, 230, 4000]}
    got = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
    want = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and len(got.token_ids) <= 5
    neutral = LLM(model=model, generation_config="vllm", **kw).get_default_sampling_params()
    assert (neutral.temperature, neutral.max_tokens) == (SamplingParams().temperature, SamplingParams().max_tokens)
