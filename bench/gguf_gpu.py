"""quantization="gguf" on the GPU: the default SmolLM2-135M-Instruct (a Q4_1 file) served from its blocks (4-bit
linear layers repacked for the W4A16 kernel's offset form) against the dense run of the same weights.

For each dtype: greedy tokens of 8 prompts x 32 (how many prompts match, where the first difference falls),
and one request's decode time per token (128 tokens after a warm-up request, wall clock; a 135M model's step
is bound by launches, not by weight bytes, so this is a check that the kernel path runs, not a speed figure).

    python3 bench/gguf_gpu.py --out DIR [--dtypes float32,bfloat16] [--git-rev REV]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # an installed jaxpaged wins

from bench.gpu_e2e import PROMPTS, first_diff  # noqa: E402


def one_request_ms(llm, ids: list[int], max_tokens: int = 128) -> float:
    """Wall milliseconds a token of one greedy request of prompt ids, after a warm-up request of the same length
    that shares no prefix with it (so the timed one runs the programs the warm-up compiled: a repeated prompt
    would hit the prefix cache and run, and compile, another prefill shape inside the timing)."""
    from jaxpaged import SamplingParams
    one = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids[::-1]}], one, use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)
    return (time.perf_counter() - t0) / max_tokens * 1e3


def save_results(out: str, name: str, git_rev: str, results: list) -> None:
    """out/name.json: the device, JAX version, revision and command beside the results."""
    import jax
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "git_rev": git_rev,
            "command": " ".join(sys.argv)}
    (folder / f"{name}.json").write_text(json.dumps({**meta, "results": results}, indent=1))


def run(dtype: str, quantization: str | None) -> dict:
    import jax

    from jaxpaged import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(dtype=dtype, quantization=quantization, max_model_len=512, compile_buckets=False, seed=0)
    start_s = time.perf_counter() - t0
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    per_token_ms = one_request_ms(llm, llm.get_tokenizer().encode(PROMPTS[0]))
    cfg = llm.llm_engine.model_config
    out = {"dtype": dtype, "quantization": quantization, "weight_quant": dict(cfg.weight_quant),
           "start_s": round(start_s, 1), "c1_ms_per_token": round(per_token_ms, 3), "tokens": tokens,
           "device": jax.devices()[0].device_kind}
    del llm
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--git-rev", default="unknown")
    args = ap.parse_args()
    results = []
    for dtype in args.dtypes.split(","):
        dense, gguf = run(dtype, None), run(dtype, "gguf")
        diffs = [first_diff(a, b) for a, b in zip(dense["tokens"], gguf["tokens"])]
        same = sum(d is None for d in diffs)
        print(f"{dtype}: gguf {gguf['weight_quant']}; {same} of {len(diffs)} prompts equal the dense run's 32 "
              f"greedy tokens (first differences at {[d for d in diffs if d is not None]}); one request "
              f"{gguf['c1_ms_per_token']} ms/token against dense {dense['c1_ms_per_token']}; start-up "
              f"{gguf['start_s']} / {dense['start_s']} s", flush=True)
        results.append({"dtype": dtype, "dense": dense, "gguf": gguf, "prompts_equal": same, "first_diffs": diffs})
    save_results(args.out, "gguf_gpu", args.git_rev, results)


if __name__ == "__main__":
    main()
