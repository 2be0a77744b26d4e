"""Which of K and V costs an e4m3 KV cache its tokens: SmolLM2 in bf16 over a bf16 cache, with K, V or both
rounded to e4m3 as they are written, each token's head scaled by a power of two into e4m3's top range (so the
rounding is an e4m3 cache's, without its scales' effect on small values). The prompts and the judge are
bench/fp8_kv_agreement.py's: the first N ShareGPT prompts of 8-160 tokens, 32 greedy tokens each, each token
judged by the bf16 cache's teacher-forced top choice. Arm "none" is the bf16 cache's own tokens (the measure's
ceiling).

CPU only. Each arm generates in a process of its own whose pallas_kernels.write_kv rounds what it writes, so
the judge's jit caches never hold a patched program (the CPU keeps no executable cache on disk, and its XLA
attention path writes every K and V through write_kv).

    python bench/fp8_kv_ablation.py [--prompts 96] [--max-tokens 32] [--arms none,k,v,kv]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):   # run as a file: see bench/common.py add_repo_to_path
    _bench = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _bench]
    sys.path.append(str(_bench.parent))

from bench.fp8_kv_agreement import greedy, judged, prompts  # noqa: E402

ARMS = {"none": "bf16 cache (the measure's ceiling)", "k": "K rounded to e4m3", "v": "V rounded to e4m3",
        "kv": "K and V rounded to e4m3"}


def e4m3_rounded(x):
    """x (dtype[T, K, D]) with each [t, k] head scaled by the power of two that puts its largest |value| in
    [224, 448), rounded to e4m3 and scaled back (the scalings exact)."""
    import jax.numpy as jnp
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    _, exponent = jnp.frexp(jnp.maximum(amax, 1e-30) / 448.0)         # amax / 448 <= 2**exponent
    scale = jnp.ldexp(jnp.ones_like(amax), exponent)                    # exactly a power of two
    return ((x32 / scale).astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale).astype(x.dtype)


def generate(arm: str, n: int, max_tokens: int, out: Path) -> None:
    """Arm's greedy tokens for the first n prompts, written to out as [[prompt ids, output ids], ...]."""
    import jax

    import jaxpaged.pallas_kernels as kernels
    from jaxpaged import LLM
    if jax.default_backend() != "cpu":
        raise SystemExit("fp8_kv_ablation runs on the CPU only (see its docstring)")
    write_kv = kernels.write_kv

    def rounding_write_kv(kv_cache, layer_idx, k, v, slot_mapping, **kw):
        return write_kv(kv_cache, layer_idx, e4m3_rounded(k) if "k" in arm else k,
                        e4m3_rounded(v) if "v" in arm else v, slot_mapping, **kw)
    if arm != "none":
        kernels.write_kv = rounding_write_kv
    run = LLM(dtype="bfloat16", max_model_len=256)
    out.write_text(json.dumps(greedy(run, prompts(run.get_tokenizer(), n), max_tokens)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    p.add_argument("--generate", metavar="OUT", help=argparse.SUPPRESS)       # (an arm's own process)
    a = p.parse_args()
    arms = a.arms.split(",")
    if unknown := set(arms) - set(ARMS):
        raise SystemExit(f"unknown arms {sorted(unknown)}; expected {', '.join(ARMS)}")
    if a.generate:
        generate(arms[0], a.prompts, a.max_tokens, Path(a.generate))
        return
    from jaxpaged import LLM
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for arm in arms:
            files[arm] = Path(tmp, f"{arm}.json")
            subprocess.run([sys.executable, str(Path(__file__).resolve()), "--generate", str(files[arm]), "--arms",
                            arm, "--prompts", str(a.prompts), "--max-tokens", str(a.max_tokens)], check=True)
        judge = LLM(dtype="bfloat16", max_model_len=256)
        for arm in arms:
            continuations = json.loads(files[arm].read_text())
            k, n, whole = judged(judge, continuations)
            print(f"{ARMS[arm]}: {k} of {n} tokens ({k / n:.2%}); continuations with every token the top choice: "
                  f"{whole} of {len(continuations)}  [{time.time() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
