"""What the quantized-checkpoint tests share: tiny models whose linear layers the kernels take, and the check
of a jaxpaged LLM against HF transformers carrying the weights (and activation rounding) jaxpaged computes
with."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from conftest import save_tiny_model
from jaxpaged import LLM, SamplingParams

# K a multiple of 128 for every linear layer (the int4 kernel's packed slabs, fp8's 128-column blocks):
# hidden 128, 2 heads of 64, MLP 256
SIZES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
# Phi-3's LongRoPE factors in TINY_MODELS are sized for its 16-wide heads: here 32 per kind, one per rotary pair
FAMILY_SIZES = {"phi3": dict(rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(32)],
                                           "long_factor": [2.0 + 0.1 * i for i in range(32)]})}
# (Phi-3's q/k/v and GLM's and Phi-3's gate/up are fused in their checkpoints: quantized as one module)
LINEARS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj")
SCORED = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0, prompt_logprobs=0)


# W8A8 against HF with the same roundings: equal until an activation lands on the other side of a rounding
# boundary. The two implementations differ by ~1e-7 upstream (attention's sums run in other orders), and an 8-bit
# step is 1-12% of a value, so now and then one of the ~1,800 roundings of a token flips; its K/V then carry the
# difference to every later position of the sequence. How far a flip moves the logits grows with the weights'
# scale: for e4m3 at 10x HF's initializer range (the other suites' choice) up to 0.085-0.125 and a mean of
# 0.019 over a sequence; at 5x (the W8A8 suites' models) at most 0.024, mean 0.0014, over three runs.
W8A8_TOLERANCE = dict(atol=0.15, mean_atol=0.02, tie=0.1)


def save_tiny(family: str, path: Path, initializer_range: float = 0.2):
    """conftest.TINY_MODELS[family] at SIZES, with SmolLM2's tokenizer (its ids cover the tiny vocabulary);
    returns HF's model. initializer_range: 10x HF's default by default, so logits spread wide and few greedy
    choices are near-ties."""
    from jaxpaged.engine.llm_engine import resolve_model_path
    hf = save_tiny_model(family, path, initializer_range=initializer_range, **SIZES, **FAMILY_SIZES.get(family, {}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(resolve_model_path(None)) / f, path)
    return hf


def declare_quantization(path: Path, quant_config: dict) -> None:
    """Write quant_config into the folder's config.json, as a quantized checkpoint declares its method."""
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = quant_config
    (path / "config.json").write_text(json.dumps(cfg))


def built_once(tmp_path_factory, write):
    """A getter that builds each case's checkpoint once (write(case, folder) -> HF's reference model) and
    returns (folder, HF model)."""
    built: dict = {}

    def get(case):
        if case not in built:
            path = tmp_path_factory.mktemp(str(case))
            built[case] = (path, write(case, path))
        return built[case]
    return get


def with_quant_config(path: Path, tmp_path: Path, quant_config: dict) -> Path:
    """A new folder holding path's files (linked) but a config.json that declares quant_config."""
    folder = tmp_path / f"variant-{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    for f in path.iterdir():
        if f.name != "config.json":
            (folder / f.name).symlink_to(f)
    (folder / "config.json").write_text((path / "config.json").read_text())
    declare_quantization(folder, quant_config)
    return folder


def linear_weight_names(tensors: dict) -> list[str]:
    """The decoder layers' linear weights among a checkpoint's tensor names."""
    return [n for n in tensors if n.endswith(".weight") and n.rsplit(".", 2)[-2] in LINEARS]


def hf_logprobs(hf, token_ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = hf(torch.tensor([token_ids])).logits[0, :-1]
    return torch.log_softmax(logits.double(), -1).numpy()


def check_against_hf(llm: LLM, hf, atol: float = 1e-4, mean_atol: float | None = None, tie: float = 0.0) -> None:
    """Two prompts: teacher-forced prompt logprobs and 12 greedy tokens' logprobs within atol of HF's (and
    their mean difference within mean_atol), the greedy tokens HF's. tie > 0 (quantized activations, where a
    1e-7 difference upstream can move one activation to the next e4m3 value): a token may differ where HF's
    own top choice leads it by less than tie nats, and the comparison ends there."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, hf.config.vocab_size, n).tolist() for n in (19, 7)]
    for out in llm.generate([{"prompt_token_ids": p} for p in prompts], SCORED, use_tqdm=False):
        prompt, gen = out.prompt_token_ids, list(out.outputs[0].token_ids)
        lps = hf_logprobs(hf, prompt + gen)
        steps = lps[len(prompt) - 1:]
        same = [t == int(row.argmax()) for t, row in zip(gen, steps)]
        first = same.index(False) if False in same else len(gen)
        if first < len(gen):
            row = steps[first]
            assert row.max() - row[gen[first]] < tie, (first, row.max() - row[gen[first]])
        got = [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], prompt[1:])]
        got += [entry[t].logprob for entry, t in zip(out.outputs[0].logprobs[:first], gen[:first])]
        rows = np.arange(len(prompt) - 1 + first)
        want = lps[rows, (prompt[1:] + gen)[:len(rows)]]
        print(f"logprobs against HF: max |diff| {np.max(np.abs(np.asarray(got) - want)):.2e}, "
              f"mean {np.mean(np.abs(np.asarray(got) - want)):.2e}, {first} of {len(gen)} greedy tokens HF's")
        np.testing.assert_allclose(got, want, rtol=0, atol=atol)
        if mean_atol is not None:
            assert np.mean(np.abs(np.asarray(got) - want)) < mean_atol
