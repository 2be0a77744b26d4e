"""HF transformers baselines on the same workload: static batching and HF's continuous batching.

Random-weight models from the same configs (bench/models.py), bf16 on CUDA (float32 on the CPU for
smoke tests with `--model tiny-llama`). EOS is disabled so every request generates exactly its output
length, as `ignore_eos` does for jaxpaged. Sampling: temperature 1.0, top_p 1.0, top_k off (as the
jaxpaged runs).

  static      vLLM's run_hf: requests in workload order are packed into a batch while batch size
              <= --hf-max-batch-size and max prompt + max output <= 2048; each batch is left-padded
              and `model.generate(max_new_tokens = the batch's longest output)`. Only the requested
              tokens count (the padding work is HF's loss). --hf-max-batch-size 1 is "sequential".
  continuous  transformers' ContinuousBatchingManager (`model.init_continuous_batching`), every
              request added with its own max_new_tokens.

Prints `Throughput: ...` and `HF <mode>: X output tok/s`; bench/summarize.py prints the ratio against
jaxpaged's figure of the same run.

Example:
  python -m bench.hf_baseline --model qwen2-0.5b --dataset sharegpt --num-prompts 200 --mode static continuous
"""
from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):   # run as a file: see bench/common.py add_repo_to_path
    _bench = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _bench]
    sys.path.append(str(_bench.parent))

from bench.datasets import DATASETS, SampleRequest  # noqa: E402

MAX_TOTAL_LEN = 2048


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2-0.5b", help="qwen2-0.5b | llama3-8b | tiny-llama | a folder")
    p.add_argument("--dataset", choices=DATASETS, default="sharegpt")
    p.add_argument("--num-prompts", type=int, default=200, help="the first N of the workload's sample")
    p.add_argument("--dataset-num-prompts", type=int, default=None,
                   help="sample size the N are taken from (default: the workload's, so the requests are "
                        "the same as jaxpaged's run)")
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--mode", nargs="+", choices=("static", "continuous"), default=["static", "continuous"])
    p.add_argument("--hf-max-batch-size", type=int, default=256)
    p.add_argument("--cb-num-prompts", type=int, default=None,
                   help="continuous batching runs only the first K of the N (HF CB is slow: keeps a suite on time)")
    p.add_argument("--max-time-s", type=float, default=None,
                   help="static: start no new batch after this many seconds (throughput over what ran)")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="bfloat16 | float32 (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-name", default=None)
    return p.parse_args(argv)


def load_random_model(model: str, device: str, dtype):
    """A random-weight HF model from the bench model's config.json, built directly on `device`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from bench.models import resolve_model
    path, _ = resolve_model(model)
    if path is None:
        raise ValueError("smollm2-135m has no generated config here; use qwen2-0.5b, llama3-8b or tiny-llama")
    config = AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    with torch.device(device):
        m = AutoModelForCausalLM.from_config(config, dtype=dtype)
    m.eval()
    return m


def _generation_config(m, max_new_tokens: int, eos: int | None):
    from transformers import GenerationConfig
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                            eos_token_id=eos, pad_token_id=0, use_cache=True)


def static_batches(requests: list[SampleRequest], max_batch: int) -> list[list[SampleRequest]]:
    """vLLM's run_hf packing: [(in 900, out 900), (in 200, out 1200)] -> two batches (1200 + 900 > 2048)."""
    batches, cur, max_in, max_out = [], [], 0, 0
    for r in requests:
        new_in, new_out = max(max_in, len(r.prompt_token_ids)), max(max_out, r.output_len)
        if cur and (len(cur) == max_batch or new_in + new_out > MAX_TOTAL_LEN):
            batches.append(cur)
            cur, new_in, new_out = [], len(r.prompt_token_ids), r.output_len
        cur.append(r)
        max_in, max_out = new_in, new_out
    if cur:
        batches.append(cur)
    return batches


def run_static(m, requests: list[SampleRequest], max_batch: int, device: str,
               max_time_s: float | None = None) -> dict[str, Any]:
    import torch
    from tqdm import tqdm
    batches = static_batches(requests, max_batch)

    def generate(batch):
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):   # left padding: prompts end where generation starts
            ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids):] = 1
        max_new = max(r.output_len for r in batch)
        out = m.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                         generation_config=_generation_config(m, max_new, None))
        return out.shape[1] - width

    with torch.no_grad():
        generate(batches[0][:2])   # warm-up: CUDA context, kernels
        _sync(device)
        done: list[SampleRequest] = []
        generated_cols = []
        t0 = time.perf_counter()
        for batch in tqdm(batches, desc="HF static batches"):
            if max_time_s is not None and done and time.perf_counter() - t0 > max_time_s:
                break
            generated_cols.append(generate(batch))
            done += batch
        _sync(device)
        elapsed = time.perf_counter() - t0
    wrong = sum(g != max(r.output_len for r in b) for g, b in zip(generated_cols, batches))
    return _result("static", done, elapsed, len(requests), num_batches=len(generated_cols),
                   num_batches_wrong_length=wrong)


def run_continuous(m, requests: list[SampleRequest], device: str) -> dict[str, Any]:
    import torch
    from tqdm import tqdm
    gen_config = _generation_config(m, max(r.output_len for r in requests), -1)
    kwargs = {}
    if "workload_hints" in inspect.signature(m.init_continuous_batching).parameters:
        from transformers.generation.continuous_batching.continuous_api import WorkloadHints
        kwargs["workload_hints"] = WorkloadHints(max_prompt_length=max(len(r.prompt_token_ids) for r in requests),
                                                 max_generated_length=max(r.output_len for r in requests),
                                                 num_requests=len(requests))
    with torch.no_grad():
        manager = m.init_continuous_batching(generation_config=gen_config, **kwargs)
        if hasattr(manager, "warmup"):
            manager.warmup()
        manager.start()
        add_params = inspect.signature(manager.add_request).parameters
        extra = {"eos_token_id": -1} if "eos_token_id" in add_params else {}
        lengths: dict[str, int] = {}
        try:
            t0 = time.perf_counter()
            for i, r in enumerate(requests):
                manager.add_request(r.prompt_token_ids, request_id=f"r{i}", max_new_tokens=r.output_len, **extra)
            with tqdm(total=len(requests), desc="HF continuous batching") as pbar:
                while len(lengths) < len(requests):
                    res = manager.get_result(timeout=1)
                    if res is None:
                        if not manager.is_running():
                            raise RuntimeError("HF continuous batching thread stopped")
                        continue
                    if res.is_finished():
                        lengths[res.request_id] = len(res.generated_tokens)
                        pbar.update(1)
            _sync(device)
            elapsed = time.perf_counter() - t0
        finally:
            manager.stop(block=True, timeout=10)
    wrong = sum(lengths.get(f"r{i}") != r.output_len for i, r in enumerate(requests))
    res = _result("continuous", requests, elapsed, len(requests), num_wrong_output_len=wrong)
    res["total_output_tokens_generated"] = sum(lengths.values())
    return res


def _sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _result(mode: str, done: list[SampleRequest], elapsed: float, asked: int, **extra) -> dict[str, Any]:
    prompt = sum(len(r.prompt_token_ids) for r in done)
    output = sum(r.output_len for r in done)
    return {"mode": mode, "num_requests": len(done), "num_requests_asked": asked, "elapsed_time": elapsed,
            "requests_per_second": len(done) / elapsed, "tokens_per_second": (prompt + output) / elapsed,
            "output_tokens_per_second": output / elapsed, "total_prompt_tokens": prompt,
            "total_output_tokens": output, **extra}


def run(args: argparse.Namespace, argv: list[str] | None = None) -> dict[str, Any]:
    import torch
    from bench.common import stamp, write_result
    from bench.datasets import get_dataset, summarize
    from bench.models import resolve_model
    from bench.throughput import throughput_line
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device == "cuda" else torch.float32)
    short = resolve_model(args.model)[1]
    requests = get_dataset(args.dataset, args.model, args.dataset_num_prompts, args.seed, args.input_len,
                           args.output_len)[:args.num_prompts]
    print(f"workload {args.dataset} (first {len(requests)}): {summarize(requests)}")
    m = load_random_model(args.model, device, dtype)
    results: dict[str, Any] = {"model": short, "dataset": args.dataset, "device": device, "dtype": str(dtype),
                               "workload": summarize(requests), "transformers": __import__("transformers").__version__,
                               "torch": torch.__version__, "hf_max_batch_size": args.hf_max_batch_size}
    name = args.result_name or f"hf-{short}-{args.dataset}"
    meta = stamp(sys.argv if argv is None else ["bench/hf_baseline.py"] + list(argv), with_device=False)
    title = f"HF transformers baseline: {name}"
    path = None
    for mode in args.mode:
        try:
            r = (run_static(m, requests, args.hf_max_batch_size, device, args.max_time_s) if mode == "static"
                 else run_continuous(m, requests[:args.cb_num_prompts or len(requests)], device))
        except Exception as e:  # noqa: BLE001 - one mode failing (API drift across versions) keeps the other
            import traceback
            traceback.print_exc()
            results[mode] = {"mode": mode, "error": f"{type(e).__name__}: {e}"}
            print(f"HF {mode}: FAILED ({type(e).__name__}: {e})")
            continue
        print(throughput_line(r["num_requests"], r["total_prompt_tokens"] + r["total_output_tokens"],
                              r["total_output_tokens"], r["elapsed_time"]))
        print(f"HF {mode}: {r['output_tokens_per_second']:.2f} output tok/s ({r['num_requests']} requests)")
        results[mode] = r
        # written after every mode, so a time limit hit in the next one keeps this one's figure
        results["best_output_tokens_per_second"] = max(
            results[m_].get("output_tokens_per_second", 0.0) for m_ in args.mode if m_ in results)
        path = write_result(name, results, meta=meta, title=title)
    if path is None:            # no mode gave a figure
        results["best_output_tokens_per_second"] = 0.0
        path = write_result(name, results, meta=meta, title=title)
    print(f"results: {path}")
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run(parse_args(argv), argv)


if __name__ == "__main__":
    main()
