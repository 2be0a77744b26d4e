"""End-to-end checks on the GPU (issue 2 and 3's end-to-end points), one call:

1. SmolLM2-135M-Instruct, float32, greedy: jaxpaged (each attention backend) vs HF transformers on the
   same GPU, token for token, for a batch of prompts. `--smollm2-dtype bfloat16` runs both in bf16 (where
   backend "mosaic" runs its Mosaic GPU kernel; in float32 it falls back to the Triton one). bf16 rounding
   may fairly turn a greedy path after some tokens, so that run also reports, per backend, how many
   prompts match HF exactly and where each prompt first differs, and the same between the backends.
2. qwen2-0.5b with dummy weights, bf16: a generate of a few prompts, then sharegpt-like throughput.

    python3 bench/gpu_e2e.py --out DIR [--skip-throughput]
    python3 bench/gpu_e2e.py --out DIR --skip-qwen --smollm2-dtype bfloat16 --backends pallas,mosaic \
        [--mosaic-decode-min-pairs 1 --layer-dispatch per_layer]
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # an installed jaxpaged wins

from bench.common import git_revision  # noqa: E402

PROMPTS = [
    "The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):", "Hi",
    "List three primary colors:",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old clockmaker who",
    "Translate to French: The weather is nice today and I would like to go for a walk in the park.",
    "1, 2, 3, 4, 5,",
]


def first_diff(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where a and b differ (the shorter one's length if it is the other's
    prefix), or None where they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def near_match(got: list[list[int]], ref: list[list[int]]) -> dict:
    """How far two sets of greedy outputs agree: prompts equal throughout, and each one's first difference."""
    diffs = [first_diff(g, r) for g, r in zip(got, ref)]
    return {"num_equal": sum(d is None for d in diffs), "num_prompts": len(diffs), "first_diff": diffs}


def smollm2_check(backends: list[str], max_tokens: int = 32, layer_dispatch: str | None = None,
                  dtype: str = "float32") -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from jaxpaged import LLM, SamplingParams
    torch.backends.cuda.matmul.allow_tf32 = False     # HF's float32 dots in float32, as the engine's are
    res = {"dtype": dtype}
    for backend in backends:
        t0 = time.perf_counter()
        llm = LLM(dtype=dtype, max_model_len=512, attention_backend=backend, gpu_memory_utilization=0.3,
                  compile_buckets=False, layer_dispatch=layer_dispatch)
        start = time.perf_counter() - t0
        t1 = time.perf_counter()
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
        res[backend] = {"layer_dispatch": llm.llm_engine.run.layer_dispatch,
                        "startup_s": start, "generate_s": time.perf_counter() - t1,
                        "token_ids": [o.outputs[0].token_ids for o in outs],
                        "texts": [o.outputs[0].text for o in outs]}
        path, tok, eos = llm.llm_engine.model_path, llm.get_tokenizer(), set(llm.llm_engine.eos_token_ids)
        del llm
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).cuda().eval()
    ref = []
    for p in PROMPTS:
        ids = torch.tensor([tok.encode(p)]).cuda()
        with torch.no_grad():
            g = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, attention_mask=torch.ones_like(ids),
                               pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        ref.append(g[:next((i + 1 for i, t in enumerate(g) if t in eos), len(g))])
    for backend in backends:
        got = res[backend]["token_ids"]
        res[backend]["matches_hf"] = [g == r for g, r in zip(got, ref)]
        res[backend]["all_match_hf"] = all(res[backend]["matches_hf"])
        if dtype != "float32":     # exact equality is float32's test; bf16 may part ways after some tokens
            res[backend]["near_hf"] = near_match(got, ref)
    if len(backends) > 1:
        res["backends_agree"] = all(res[b]["token_ids"] == res[backends[0]]["token_ids"] for b in backends)
        if dtype != "float32":
            res["backends_near"] = {f"{a}/{b}": near_match(res[a]["token_ids"], res[b]["token_ids"])
                                    for a, b in itertools.combinations(backends, 2)}
    res["hf_token_ids"] = ref
    return res


def qwen_dummy(model_dir: str, throughput: bool, backend: str | None) -> dict:
    import numpy as np

    from jaxpaged import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(model=model_dir, load_format="dummy", dtype="bfloat16", max_model_len=2048, attention_backend=backend,
              compile_buckets=True)
    res = {"startup_s": time.perf_counter() - t0, "kv_blocks": llm.llm_engine.num_blocks - 1,
           "kv_tokens": llm.llm_engine.kv_cache_tokens}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 150000, n).tolist() for n in (5, 17, 64, 300)]
    t1 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    res["generate_s"] = time.perf_counter() - t1
    res["outputs"] = [{"prompt_len": len(p), "num_tokens": len(o.outputs[0].token_ids),
                       "first_ids": o.outputs[0].token_ids[:8], "text_head": o.outputs[0].text[:60]}
                      for p, o in zip(prompts, outs)]
    if throughput:
        from bench.datasets import sample_sharegpt_like
        workload = sample_sharegpt_like(llm.llm_engine.model_config.vocab_size, 1000, seed=0)
        n = len(workload)
        inp = np.array([len(w.prompt_token_ids) for w in workload])
        out = np.array([w.output_len for w in workload])
        reqs = [w.prompt_token_ids for w in workload]
        sps = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=int(o), ignore_eos=True) for o in out]
        from bench.llm_args import engine_stats, stats_delta
        stats = llm.llm_engine.stats
        stats.max_waste_seen = 0.0                     # the largest waste of this run, not of the engine's life
        before = engine_stats(llm)
        t2 = time.perf_counter()
        llm.generate(reqs, sps, use_tqdm=False)
        dt = time.perf_counter() - t2
        d = stats_delta(before, engine_stats(llm))     # this run only (wait_s was a running total before)
        res["sharegpt_like_1000"] = {
            "seconds": dt, "requests_per_s": n / dt, "output_tok_per_s": int(out.sum()) / dt,
            "total_tok_per_s": int(inp.sum() + out.sum()) / dt, "input_tokens": int(inp.sum()),
            "output_tokens": int(out.sum()), "steps": d["num_steps"],
            **{k: d[k] for k in ("schedule_s", "execute_s", "process_s", "wait_s", "prepare_inputs_s",
                                 "launch_s", "detokenize_s")},
            "max_waste": stats.max_waste_seen,
            "avg_waste": (stats.waste_slots_unused - before["waste_slots_unused"])
            / max(1, stats.waste_slots_allocated - before["waste_slots_allocated"]),
            "compiled_keys": len(llm.llm_engine.runner.compiled_keys),
            "preemptions": d["num_preemptions"]}
        from bench.step_probe import time_decode_steps
        res["decode_step_us"] = time_decode_steps(llm)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--skip-smollm2", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--backends", default="xla,pallas")
    ap.add_argument("--smollm2-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="SmolLM2 check: jaxpaged and HF in this dtype (bfloat16: also counts near matches)")
    ap.add_argument("--qwen-backend", default=None)
    ap.add_argument("--skip-qwen", action="store_true")
    ap.add_argument("--layer-dispatch", default=None, help="SmolLM2 check: scan | per_layer | unrolled "
                    "(default: the engine's choice)")
    args = ap.parse_args()
    import jax

    import pallas_kernels
    from bench.models import ensure_model_dir
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": " ".join(sys.argv),
              "git_rev": git_revision(), "mosaic_decode_min_pairs": pallas_kernels.MOSAIC_DECODE_MIN_PAIRS}
    if not args.skip_smollm2:
        try:
            result["smollm2_greedy"] = smollm2_check(args.backends.split(","), layer_dispatch=args.layer_dispatch,
                                                     dtype=args.smollm2_dtype)
        except Exception:  # report and go on to the next check
            import traceback
            result["smollm2_greedy"] = {"error": traceback.format_exc()}
    if not args.skip_qwen:
        try:
            result["qwen2_0.5b_dummy"] = qwen_dummy(ensure_model_dir("qwen2-0.5b"), not args.skip_throughput,
                                                    args.qwen_backend)
        except Exception:
            import traceback
            result["qwen2_0.5b_dummy"] = {"error": traceback.format_exc()}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_e2e.json").write_text(json.dumps(result, indent=1, default=str))
    short = json.loads(json.dumps(result, default=str))
    for b in args.backends.split(","):
        short.get("smollm2_greedy", {}).get(b, {}).pop("token_ids", None)
    short.get("smollm2_greedy", {}).pop("hf_token_ids", None)
    print(json.dumps(short, indent=1)[:6000])
    print_near(result.get("smollm2_greedy", {}))


def print_near(res: dict) -> None:
    """One line per comparison of a bf16 SmolLM2 check, after the JSON (which may be cut short)."""
    pairs = [(f"{b} vs HF", v["near_hf"]) for b, v in res.items() if isinstance(v, dict) and "near_hf" in v]
    for name, near in pairs + list(res.get("backends_near", {}).items()):
        print(f"SmolLM2 {res['dtype']} {name}: {near['num_equal']}/{near['num_prompts']} prompts equal; "
              f"first differing token per prompt {near['first_diff']}")


if __name__ == "__main__":
    main()
