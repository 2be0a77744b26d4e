"""What a variant's sampler costs in time with its rows in chunks (runner/sampler.py SAMPLER_CHUNK_BYTES) against
all rows at once, on random logits: the sampler alone, jitted as the step jits it, median of back-to-back calls.

  python bench/sampler_chunks.py [--rows 256,1024] [--vocab 128256,256000] [--iters 20]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):   # run as a file: see bench/common.py add_repo_to_path
    _bench = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _bench]
    sys.path.append(str(_bench.parent))


def inputs(rows: int, vocab: int, rng):
    import numpy as np

    from jaxpaged.runner.sampler import SamplingInputs
    ids = rng.integers(-1, vocab, (rows, 16)).astype(np.int32)
    f = lambda lo, hi: rng.uniform(lo, hi, rows).astype(np.float32)  # noqa: E731
    return SamplingInputs(temperature=f(0.5, 1.2), top_k=rng.integers(0, 50, rows).astype(np.int32),
                          top_p=f(0.5, 1.0), min_p=f(0.0, 0.05), seeds=np.arange(rows, dtype=np.uint32),
                          positions=np.zeros(rows, np.int32), presence_penalty=f(0, 0.5),
                          frequency_penalty=f(0, 0.5), repetition_penalty=f(1, 1.2), output_ids=ids, prompt_ids=ids,
                          bias_ids=ids, bias_values=np.zeros((rows, 16), np.float32))


def time_sample(logits, inp, flags, iters: int) -> float:
    """Median microseconds of one jitted sample() call (traced anew: the module switch is read at trace time)."""
    import jax

    from jaxpaged.runner import sampler
    fn = jax.jit(sampler.sample, static_argnames="flags")
    jax.block_until_ready(fn(logits, inp, flags))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(logits, inp, flags))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpaged.runner import sampler
    from jaxpaged.runner.sampler import SamplerFlags
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="256,1024")
    p.add_argument("--vocab", default="128256,256000")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    variants = {"top_k_p": SamplerFlags(top_k_p=True), "logprobs_20": SamplerFlags(num_logprobs=20),
                "all": SamplerFlags(top_k_p=True, penalties=True, logit_bias=True, num_logprobs=20)}
    chunk_bytes = sampler.SAMPLER_CHUNK_BYTES
    print(f"{jax.devices()[0].device_kind}; SAMPLER_CHUNK_BYTES {chunk_bytes >> 20} MiB; median us of "
          f"{args.iters} calls")
    print("| rows | vocab | variant | rows a chunk | chunked | whole | chunked / whole |")
    print("|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for vocab in map(int, args.vocab.split(",")):
        for rows in map(int, args.rows.split(",")):
            logits = jnp.asarray(rng.normal(size=(rows, vocab)).astype(np.float32) * 3)
            inp = inputs(rows, vocab, rng)
            for name, flags in variants.items():
                per = sampler.sampler_chunk_rows(rows, vocab, flags)
                sampler.SAMPLER_CHUNK_BYTES = chunk_bytes
                chunked = time_sample(logits, inp, flags, args.iters)
                sampler.SAMPLER_CHUNK_BYTES = 0
                whole = time_sample(logits, inp, flags, args.iters)
                sampler.SAMPLER_CHUNK_BYTES = chunk_bytes
                print(f"| {rows} | {vocab} | {name} | {per} | {chunked:.0f} | {whole:.0f} | {chunked / whole:.2f} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
