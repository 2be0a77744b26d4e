"""The GPU check of a cold start-up's lowering workers (jaxpaged/runner/lowering_workers.py): the programs
they lower (JAX on the CPU, exported for CUDA) must be the programs the engine lowers itself.

    python3 bench/lowering_check.py --out DIR [--model qwen2-0.5b]

A benchmark model with dummy weights (the same draw both times), bf16, greedy with logprobs, 96 prompts
of 5-400 random tokens (up to 128 requests a step: decode steps of >= 64 rows reach the Mosaic decode
kernel, prefills the Mosaic prefill kernel): once with every bucket compiled at start-up into a fresh
executable cache (on Hopper the resolved configuration lowers them in workers: the log's "Lowering buckets
(N processes)"), once without compiling at start-up (each step traced and lowered in this process through
jit). The token ids and their logprobs should be equal; the start-up times are reported.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # an installed jaxpaged wins

from bench.common import git_revision  # noqa: E402
from bench.models import resolve_model  # noqa: E402


def run(model: str, compile_buckets: bool) -> dict:
    import numpy as np

    from jaxpaged import LLM, SamplingParams, envs
    envs.JAXPAGED_CACHE_ROOT = Path(tempfile.mkdtemp(prefix="jaxpaged-lowering-check-"))
    envs.JAXPAGED_XLA_CACHE_PATH = envs.JAXPAGED_CACHE_ROOT / "xla"     # a cold start (JAX keeps the first run's)
    t0 = time.perf_counter()
    llm = LLM(model=resolve_model(model)[0], load_format="dummy", dtype="bfloat16", max_model_len=1024,
              max_num_batched_tokens=512, max_num_seqs=128, gpu_memory_utilization=0.3,
              compile_buckets=compile_buckets)
    startup = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [rng.integers(100, vocab - 200, int(n)).tolist() for n in rng.integers(5, 400, 96)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=48, logprobs=1, ignore_eos=True), use_tqdm=False)
    res = {"run_config": llm.llm_engine.run.summary(), "startup_s": startup,
           "token_ids": [o.outputs[0].token_ids for o in outs],
           "logprobs": [[entry[t].logprob for entry, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                        for o in outs]}
    del llm
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--model", default="qwen2-0.5b")
    args = ap.parse_args()
    import jax
    workers, traced = run(args.model, True), run(args.model, False)
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "revision": git_revision(),
           "compiled_at_startup": workers, "traced_on_demand": traced,
           "model": args.model, "tokens_equal": workers["token_ids"] == traced["token_ids"],
           "prompts_equal": sum(a == b for a, b in zip(workers["token_ids"], traced["token_ids"])),
           "logprobs_equal": workers["logprobs"] == traced["logprobs"]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lowering_check.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if not isinstance(v, dict)}
                     | {"startup_s": [workers["startup_s"], traced["startup_s"]],
                        "run_config": workers["run_config"]}, indent=1))


if __name__ == "__main__":
    main()
