"""What a model's compiled programs need beside the weights and the KV pool, against the engine's reserve for it.

The engine sizes its KV pool before it compiles anything, so it reserves memory for the programs' temporaries
from a formula (engine/cache_sizing.py activation_reserve). This probe starts the engine as `LLM` does (dummy
weights, the offline defaults; the programs' temporaries do not depend on the pool's size), waits
for every warm-up compile (the default step of each bucket, the head and sampler of the common sampler
variants), compiles the largest bucket's step once more under each sampler variant (top-k/p, penalties, logprobs,
prompt logprobs, all at once), and prints XLA's memory analysis of each beside the reserve, and the allocator's
peak during the warm-up.

  python bench/temporaries.py --models gemma-2-9b [--max-model-len 4096] [--whole-rows] [--json OUT.json]

Name one model a run: several run in one process, whose allocator peak is the largest of them all.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):   # run as a file: see bench/common.py add_repo_to_path
    _bench = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _bench]
    sys.path.append(str(_bench.parent))

GiB = 2 ** 30


def variant_flags():
    from jaxpaged.runner.sampler import SamplerFlags
    return {
        "top_k_p": SamplerFlags(top_k_p=True),
        "penalties": SamplerFlags(penalties=True),
        "logit_bias": SamplerFlags(logit_bias=True),
        "logprobs_20": SamplerFlags(num_logprobs=20),
        "prompt_logprobs_20": SamplerFlags(num_prompt_logprobs=20),
        "sampled_all": SamplerFlags(top_k_p=True, penalties=True, logit_bias=True, num_logprobs=20),
        "all": SamplerFlags(top_k_p=True, penalties=True, logit_bias=True, num_logprobs=20, num_prompt_logprobs=20),
    }


def largest_bucket_variants(model: str, progs, runner, bucket, flags_by_name: dict | None = None) -> dict[str, int]:
    """Sampler variant (flags_by_name, default variant_flags()) -> the most temporary bytes of any program of
    `bucket`'s step under it."""
    import numpy as np
    from jaxpaged.runner.step import _temporary_bytes
    options = progs.options(bucket, 1)
    plain_inputs = progs.dummy_inputs

    def inputs_for(flags):
        """The bucket's dummy inputs for `flags` (prompt targets where it asks prompt logprobs), with 16 tokens of
        output, prompt and bias a row where the variant reads them."""
        def dummy(b, _flags=None):
            mi, si = plain_inputs(b, flags)
            rows = b.padded_num_reqs
            ids = np.full((rows, 16), -1, np.int32)
            if flags.penalties:
                si = dataclasses.replace(si, output_ids=ids, prompt_ids=ids)
            if flags.logit_bias:
                si = dataclasses.replace(si, bias_ids=ids, bias_values=np.zeros((rows, 16), np.float32))
            return mi, si
        return dummy

    variants: dict[str, int] = {}
    jobs = {}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for name, flags in (flags_by_name or variant_flags()).items():
            progs.dummy_inputs = inputs_for(flags)
            try:
                specs = progs.program_specs(runner, bucket, options, flags)
                lowered = [spec.lower() for spec in specs.values()]
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                print(f"  {model} {name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", file=sys.stderr)
                continue
            finally:
                progs.dummy_inputs = plain_inputs
            for lo in lowered:
                jobs[pool.submit(lambda x: _temporary_bytes(x.compile(progs.step_compiler_options)), lo)] = name
        for fut, name in jobs.items():
            try:
                variants[name] = max(variants.get(name, 0), fut.result())
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
                print(f"  {model} {name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", file=sys.stderr)
    return variants


def probe(model: str, max_model_len: int | None, blocks: int | None, whole_rows: bool) -> dict:
    import jax
    from bench.models import ensure_model_dir
    from jaxpaged import LLM
    from jaxpaged.engine.cache_sizing import activation_reserve

    kw: dict = dict(load_format="dummy")
    if blocks:
        kw["num_gpu_blocks_override"] = blocks
    if max_model_len:
        kw["max_model_len"] = max_model_len
    t0 = time.perf_counter()
    llm = LLM(model=model if Path(model).is_dir() else ensure_model_dir(model), **kw)
    core = llm.llm_engine.core
    runner, run, cfg = core.runner, core.run, core.model_config
    progs = runner.programs
    progs.wait_for_background_compiles()
    startup = time.perf_counter() - t0
    stats = jax.devices()[0].memory_stats() or {}
    by_kind: dict[str, int] = {}
    for key, temp in progs.temp_bytes.items():
        by_kind[str(key[0])] = max(by_kind.get(str(key[0]), 0), temp)
    buckets = runner.buckets.all_buckets()
    largest = max(buckets, key=lambda b: (b.padded_num_tokens, b.padded_num_reqs))
    variants = largest_bucket_variants(model, progs, runner, largest)
    before = None
    if whole_rows:      # the same with a variant's sampler and the prompt head over all rows at once
        from jaxpaged.models import decoder
        from jaxpaged.runner import sampler
        saved = sampler.SAMPLER_CHUNK_BYTES, decoder.PROMPT_HEAD_BYTES
        sampler.SAMPLER_CHUNK_BYTES, decoder.PROMPT_HEAD_BYTES = 0, 0
        jax.clear_caches()
        try:
            before = largest_bucket_variants(model, progs, runner, largest)
        finally:
            sampler.SAMPLER_CHUNK_BYTES, decoder.PROMPT_HEAD_BYTES = saved
            jax.clear_caches()
    reserve = activation_reserve(cfg, run.max_num_batched_tokens, run.max_num_seqs, jax.numpy.dtype(core.dtype))
    out = {
        "model": model, "startup_s": round(startup, 1), "max_num_batched_tokens": run.max_num_batched_tokens,
        "max_num_seqs": run.max_num_seqs, "vocab": cfg.vocab_size, "intermediate": cfg.intermediate_size,
        "hidden": cfg.hidden_size, "dtype": str(core.dtype), "reserve_gib": reserve / GiB,
        "largest_bucket": f"{largest.padded_num_tokens} tokens, {largest.padded_num_reqs} rows",
        "temp_gib_by_kind": {k: v / GiB for k, v in sorted(by_kind.items())},
        "largest_bucket_variants_gib": {k: v / GiB for k, v in variants.items()},
        "whole_rows_variants_gib": None if before is None else {k: v / GiB for k, v in before.items()},
        "allocator_peak_gib": stats.get("peak_bytes_in_use", 0) / GiB,
        "allocator_in_use_gib": stats.get("bytes_in_use", 0) / GiB,
        "pool_gib": runner.kv_cache.size * runner.kv_cache.dtype.itemsize / GiB,
    }
    del llm
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama3-8b", help="bench/models.py names or model folders, comma-separated")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--blocks", type=int, default=None,
                   help="the probe's pool (the temporaries do not depend on it; default: the engine's own sizing, "
                        "whose compiled steps a later engine of the same settings reads from the executable cache)")
    p.add_argument("--json", default=None)
    p.add_argument("--whole-rows", action="store_true",
                   help="also measure the variants with their sampler and the prompt head over all rows at once")
    args = p.parse_args(argv)
    results = []
    for model in args.models.split(","):
        r = probe(model, args.max_model_len, args.blocks, args.whole_rows)
        results.append(r)
        print(json.dumps(r, indent=1), flush=True)
        print(f"== {model}: reserve {r['reserve_gib']:.2f} GiB; largest temporaries "
              f"{max([*r['temp_gib_by_kind'].values(), *r['largest_bucket_variants_gib'].values()]):.2f} GiB; "
              f"allocator peak {r['allocator_peak_gib']:.2f} GiB (pool {r['pool_gib']:.2f})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
