"""Issue 26's e4m3 KV cache agreement on a larger sample than its test's 8 prompts: SmolLM2 (the embedded default
model) in bf16, the first N ShareGPT prompts of 8-160 tokens, 32 greedy tokens each, over the bf16 cache, an e4m3
cache with scales of 1.0 and one with --calculate-kv-scales. Each run's tokens are judged as
tests/quantization/test_fp8_kv_cache.py judges them: the bf16 cache's top choice after the same tokens, from one
teacher-forced prefill. The bf16 cache's own tokens, judged so, give the measure's ceiling (a decode and a prefill
round differently).

  python bench/fp8_kv_agreement.py [--prompts 96] [--max-tokens 32]

Runs on the CPU (a few minutes for 96 prompts) or a GPU.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):   # run as a file: see bench/common.py add_repo_to_path
    _bench = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _bench]
    sys.path.append(str(_bench.parent))

from bench.datasets import _sharegpt_pairs, sharegpt_json_path  # noqa: E402


def prompts(tokenizer, n: int, lo: int = 8, hi: int = 160) -> list[dict]:
    out = []
    for text, _ in _sharegpt_pairs(sharegpt_json_path()):
        ids = tokenizer(text)["input_ids"]
        if lo <= len(ids) <= hi:
            out.append({"prompt_token_ids": ids})
        if len(out) == n:
            break
    return out


def judged(judge, continuations: list[tuple[list[int], list[int]]]) -> tuple[int, int, int]:
    """Each (prompt ids, output ids) judged by one teacher-forced prefill of the judge: (tokens that are its top
    choice, tokens, continuations whose every token is)."""
    from jaxpaged import SamplingParams
    scored = judge.generate([{"prompt_token_ids": p + t} for p, t in continuations],
                            SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    per = [[entry[tok].rank == 1 for entry, tok in zip(s.prompt_logprobs[len(p):], t)]
           for (p, t), s in zip(continuations, scored)]
    return sum(map(sum, per)), sum(map(len, per)), sum(all(p) for p in per)


def greedy(run, requests: list[dict], max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """run's greedy continuations of the requests: (prompt ids, output ids) each."""
    from jaxpaged import SamplingParams
    outs = run.generate(requests, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=32)
    a = p.parse_args()
    from jaxpaged import LLM
    dense = LLM(dtype="bfloat16", max_model_len=256)
    requests = prompts(dense.get_tokenizer(), a.prompts)
    t0 = time.time()
    for name, kwargs in (("bf16 cache (the measure's ceiling)", None),
                         ("e4m3 cache, scales 1.0", {"kv_cache_dtype": "fp8"}),
                         ("e4m3 cache, calculated scales", {"kv_cache_dtype": "fp8", "calculate_kv_scales": True})):
        run = dense if kwargs is None else LLM(dtype="bfloat16", max_model_len=256, **kwargs)
        k, n, whole = judged(dense, greedy(run, requests, a.max_tokens))
        print(f"{name}: {k} of {n} tokens ({k / n:.2%}); continuations with every token the top choice: "
              f"{whole} of {len(requests)}  [{time.time() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
