"""Whether LLM(dtype="float32") computes in float32 on the device it runs on (issue 25: "a float32 run computes in
float32 end to end"). On Ampere and later GPUs XLA may run a float32 dot at the default precision as TF32 (10
mantissa bits), which a float32 reference would see in every logit.

1. One float32 dot, [256, 4096] x [4096, 4096], at JAX's default precision and at HIGHEST: the largest error
   against float64, relative to the largest |output|.
2. A random-weight Llama (hidden 1024, 4 layers, Llama 3's tokenizer and vocabulary) saved as an HF folder, served
   by LLM(dtype="float32") at the device's defaults: 8 random prompts, prompt logprobs and 32 greedy tokens with
   their logprobs, against HF transformers in float32 on the same device (TF32 off, eager attention) fed the same
   tokens: the largest logprob difference and the greedy tokens HF's argmax picks too.

    python bench/f32_gpu_check.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):   # run as a file: see bench/common.py add_repo_to_path
    _bench = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _bench]
    sys.path.append(str(_bench.parent))

from bench.common import git_revision  # noqa: E402


def dot_errors() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    rng = np.random.default_rng(0)
    a = rng.standard_normal((256, 4096), dtype=np.float32)
    b = rng.standard_normal((4096, 4096), dtype=np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64)
    out = {}
    for name, precision in (("default", None), ("highest", jax.lax.Precision.HIGHEST)):
        got = np.asarray(jax.jit(lambda x, y, p=precision: jnp.dot(x, y, precision=p))(a, b), np.float64)
        out[name] = float(np.abs(got - want).max() / np.abs(want).max())
    return out


def tiny_llama(folder: Path) -> None:
    import torch
    import transformers

    from bench.models import ensure_model_dir
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128256, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                   num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                                   initializer_range=0.05, bos_token_id=128000, eos_token_id=128001)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    src = Path(ensure_model_dir("tiny-llama"))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, folder / f.name)


def engine_against_hf(folder: Path, max_tokens: int = 32) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from jaxpaged import LLM, SamplingParams
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(1000, 120000, int(n)).tolist()}
               for n in (7, 30, 64, 100, 13, 150, 41, 200)]
    t0 = time.perf_counter()
    llm = LLM(model=str(folder), dtype="float32", max_model_len=1024, gpu_memory_utilization=0.3)
    run = llm.llm_engine.run.summary()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0,
                                                prompt_logprobs=0), use_tqdm=False)
    seconds = time.perf_counter() - t0
    del llm
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                              attn_implementation="eager").to(device).eval()
    prompt_diff = sample_diff = 0.0
    agree = total = 0
    for o in outs:
        prompt, tokens = list(o.prompt_token_ids), list(o.outputs[0].token_ids)
        ids = torch.tensor([prompt + tokens], device=device)
        with torch.no_grad():
            lp = torch.log_softmax(hf(ids).logits[0].double(), -1).cpu().numpy()
        for i, entry in enumerate(o.prompt_logprobs[1:], start=1):
            prompt_diff = max(prompt_diff, abs(entry[prompt[i]].logprob - lp[i - 1, prompt[i]]))
        for j, (t, entry) in enumerate(zip(tokens, o.outputs[0].logprobs)):
            row = lp[len(prompt) - 1 + j]
            sample_diff = max(sample_diff, abs(entry[t].logprob - row[t]))
            agree += int(row.argmax() == t)
            total += 1
    return {"run_config": run, "seconds": seconds, "prompt_logprob_max_abs_diff": prompt_diff,
            "sampled_logprob_max_abs_diff": sample_diff, "greedy_tokens_hf_argmax": agree, "greedy_tokens": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for f32_gpu_check.json")
    args = ap.parse_args()
    import jax
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "git_rev": git_revision(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": " ".join(sys.argv),
              "dot_rel_error": dot_errors()}
    with tempfile.TemporaryDirectory() as tmp:
        tiny_llama(Path(tmp))
        result["llm_float32_vs_hf"] = engine_against_hf(Path(tmp))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "f32_gpu_check.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
