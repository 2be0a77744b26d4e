"""quantization="gguf": the default SmolLM2 runs from its GGUF file's blocks (the Q4_1 linear layers repacked for
the W4A16 kernel's offset form, the Q8_0 embedding's rows expanded as the lookup gathers them, the tied LM head the
same blocks repacked for the kernel as 8-bit values), and computes what the dense float32 run computes (whose
weights are the same blocks dequantized at load)."""
import dataclasses

import numpy as np
import pytest

from conftest import tiny_llama_dir
from jaxpaged import LLM, SamplingParams
from jaxpaged.config import EngineArgs

pytestmark = pytest.mark.cost(65)

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]


def _run(quantization, layer_dispatch=None):
    llm = LLM(dtype="float32", quantization=quantization, max_model_len=256, layer_dispatch=layer_dispatch)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, prompt_logprobs=0, logprobs=0),
                        use_tqdm=False)
    return outs, llm


def _chosen(logprobs, tokens):
    return np.array([d[t].logprob for d, t in zip(logprobs, tokens)])


@pytest.fixture(scope="module")
def dense():
    return _run(None)[0]


@pytest.mark.parametrize("layer_dispatch", ["scan", "per_layer", "unrolled"])
def test_gguf_blocks_give_the_dense_float32_run(dense, layer_dispatch):
    """Under every layer dispatch (the GPU's per_layer and unrolled run the embedding and head as programs of
    their own)."""
    quant, llm = _run("gguf", layer_dispatch)
    cfg = llm.llm_engine.model_config
    # every tensor the file quantizes: the Q4_1 linear layers repacked, the Q8_0 embedding in its blocks, and the
    # tied LM head from those blocks repacked as 8-bit values
    assert dict(cfg.weight_quant) == {"embed_tokens": "Q8_0", "qkv_proj": "gguf-int4", "o_proj": "gguf-int4",
                                      "gate_up_proj": "gguf-int4", "down_proj": "gguf-int4",
                                      "lm_head": "gguf-int8-g32"}
    for d, q in zip(dense, quant):
        assert q.outputs[0].token_ids == d.outputs[0].token_ids
        prompt = d.prompt_token_ids
        np.testing.assert_allclose(_chosen(q.prompt_logprobs[1:], prompt[1:]),
                                   _chosen(d.prompt_logprobs[1:], prompt[1:]), atol=1e-4, rtol=0)
        toks = d.outputs[0].token_ids
        np.testing.assert_allclose(_chosen(q.outputs[0].logprobs, toks), _chosen(d.outputs[0].logprobs, toks),
                                   atol=1e-4, rtol=0)


def test_unsupported_methods_and_models_without_a_gguf_file_are_refused(tmp_path_factory):
    with pytest.raises(ValueError, match="quantization 'bitsandbytes' is not supported; supported: awq, "
                                         "compressed-tensors, fp8, gguf, gptq"):
        EngineArgs(quantization="bitsandbytes")
    with pytest.raises(ValueError, match="was not converted from one"):
        LLM(model=tiny_llama_dir(tmp_path_factory, "not-gguf"), quantization="gguf")


def test_the_server_flag_reaches_the_engine_args():
    from jaxpaged.server.cli import engine_args_from, make_parser
    args = engine_args_from(make_parser().parse_args(["--quantization", "gguf"]))
    assert dataclasses.asdict(args)["quantization"] == "gguf"
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--quantization", "bitsandbytes"])


def test_a_checkpoint_of_another_quantization_method_is_refused_by_name(tmp_path_factory):
    """config.json's quantization_config names the method (as bitsandbytes checkpoints do): one
    jaxpaged cannot read is refused at start-up with what is supported, not a missing-tensor error."""
    import json
    from pathlib import Path
    folder = Path(tiny_llama_dir(tmp_path_factory, "bnb"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(cfg))
    for quantization in (None, "gguf"):
        with pytest.raises(ValueError, match="holds 'bitsandbytes'-quantized weights .* supported "
                                             "quantization: awq, compressed-tensors, fp8, gguf, gptq"):
            LLM(model=str(folder), quantization=quantization)
