"""The rope scalings vLLM handles (linear, dynamic NTK, YaRN, llama3, LongRoPE) against HF transformers: a tiny
model's logits through the paged cache, the prompt in one step and then one token a step, equal HF's forward
run the same way (its KV cache kept), past the length where the dynamic scalings change (dynamic NTK beyond
max_position_embeddings, LongRoPE's long factors beyond original_max_position_embeddings)."""
import inspect

import numpy as np
import pytest
import torch

from conftest import decode_traced_anew, save_tiny_model
from jaxpaged.models import load_model
from paged_runner import PagedRunner

PROMPT, STEPS = 20, 14              # positions 0..33: across the 32 where the scalings below change

SCALINGS = {
    "linear": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.5})),
    "dynamic": ("llama", dict(max_position_embeddings=32, rope_scaling={"rope_type": "dynamic", "factor": 3.0})),
    "yarn": ("qwen2", dict(max_position_embeddings=128, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})),
    "yarn-mscale": ("llama", dict(max_position_embeddings=128, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0,
        "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2})),
    "longrope": ("phi3", dict(max_position_embeddings=128, original_max_position_embeddings=32)),
}


def hf_incremental_logits(hf, ids: list[int]) -> np.ndarray:
    """HF's logits for ids: one forward for the prompt, then one per token with its KV cache (HF's generate). The
    cache goes by the keyword this transformers takes: `cache` from 5.25 (`past_key_values` deprecated), before it
    `past_key_values` (an unknown `cache=` is dropped there without an error, each token then run alone at
    position 0)."""
    keyword = "cache" if "cache" in inspect.signature(hf.model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = hf(torch.tensor([ids[:PROMPT]]), use_cache=True)
        logits, cache = [out.logits[0]], out.past_key_values
        for t in ids[PROMPT:]:
            out = hf(torch.tensor([[t]]), use_cache=True, **{keyword: cache})
            logits.append(out.logits[0])
            cache = out.past_key_values
    return torch.cat(logits).numpy()


@pytest.mark.parametrize("name", SCALINGS)
def test_rope_scaling_equals_hf(name, tmp_path):
    family, overrides = SCALINGS[name]
    hf = save_tiny_model(family, tmp_path, **overrides)
    loaded = load_model(tmp_path, dtype="float32")
    assert dict(loaded.config.rope_scaling or ())["rope_type"] == name.split("-")[0]
    runner = PagedRunner(loaded, num_blocks=64)
    prompt = np.random.default_rng(0).integers(0, 320, PROMPT).tolist()
    ids = list(prompt)
    ours = [runner.step(prompt)]
    for _ in range(STEPS - 1):
        ids.append(int(np.argmax(ours[-1][-1])))
        ours.append(runner.step([ids[-1]]))
    got = np.concatenate(ours)
    ref = hf_incremental_logits(hf, ids)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, rel


def test_unsupported_rope_is_refused():
    from jaxpaged.models.config import decoder_config_from_hf
    from jaxpaged.models.rope import UnsupportedRopeError
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    with pytest.raises(UnsupportedRopeError, match="rope_scaling type 'mrope' is not supported"):
        decoder_config_from_hf({**base, "rope_scaling": {"rope_type": "mrope"}})
    with pytest.raises(UnsupportedRopeError, match="partial_rotary_factor"):
        decoder_config_from_hf({**base, "partial_rotary_factor": 0.5})


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])           # (Llama's is Qwen2's without the bias)
def test_the_rope_kernel_gives_a_dense_decode_row_what_xla_gives(family, tmp_path, monkeypatch):
    """DENSE_ROPE_KERNEL: one request's decode steps through the Pallas kernels (interpreted, float16: the CPU's
    Pallas attention holds a bf16 pool as uint16) take q, k and v from rope_qkv (Qwen2's q/k/v bias added by the
    dense projection, Qwen3's q/k norms in the kernel with ROPE_QK_NORM, k and v stored into the pool with
    ROPE_WRITES_KV); the greedy tokens and their
    logprobs are those of XLA's rotation (to half precision's tolerance)."""
    import shutil
    from pathlib import Path

    import jaxpaged.models.decoder as decoder
    from jaxpaged.engine.llm_engine import resolve_model_path
    save_tiny_model(family, tmp_path, initializer_range=0.2, hidden_size=128, intermediate_size=256,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(resolve_model_path(None)) / f, tmp_path)
    prompt = {"prompt_token_ids": np.random.default_rng(5).integers(0, 320, 11).tolist()}
    calls = []
    kernel = decoder.rope_qkv
    monkeypatch.setattr(decoder, "rope_qkv", lambda *a, **k: calls.append(k.get("kv_write") is not None) or kernel(
        *a, **k))

    def run(on: bool):
        monkeypatch.setattr(decoder, "DENSE_ROPE_KERNEL", on)
        monkeypatch.setattr(decoder, "ROPE_QK_NORM", on)
        monkeypatch.setattr(decoder, "ROPE_WRITES_KV", on)
        calls.clear()
        tokens, logprobs = decode_traced_anew(tmp_path, prompt, dtype="float16", max_model_len=128, block_size=8,
                                              max_num_batched_tokens=32, attention_backend="pallas",
                                              layer_dispatch="unrolled")
        return list(calls), tokens, logprobs
    traced, xla_tokens, xla_lps = run(False)
    assert not traced
    traced, tokens, lps = run(True)
    assert traced and all(calls) and tokens == xla_tokens          # (each call stored k and v)
    np.testing.assert_allclose(lps, xla_lps, rtol=0, atol=0.05)
