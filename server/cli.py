"""Command-line flags of `python -m jaxpaged.server`, with vLLM's names and meanings."""
from __future__ import annotations

import argparse
import json
import os

from jaxpaged.config import (GPU_SCHEDULER_STEPS, GPU_SINGLE_STEP_MIN_BYTES, KV_CACHE_DTYPES, LAYER_DISPATCHES,
                             LAYERS_PER_DISPATCH, QUANTIZATION_METHODS, EngineArgs)


# Request bodies larger than this are refused (413). 64 MiB holds a 1M-token prompt at 64 bytes a token (a
# token id in JSON takes at most 8, a token's text rarely 16), yet bounds what one request makes the API
# process parse and hold.
DEFAULT_MAX_REQUEST_BODY_MIB = 64


# API processes by default where the host has cores to spare: admitting a burst is Python work in the API
# process (parsing, tokenizing, the first stream events), and with one process the last requests of a
# 1000-request burst waited 1.3-3.9 s to be admitted on the H100's 16-core host, the engine idle meanwhile;
# two admit them within a second (bench/results/NOTES.md). Small hosts (CI's 2 cores) keep one.
SPARE_CORES = 8
SPARE_CORES_API_SERVERS = 2


def default_api_server_count(num_cpus: int | None) -> int:
    """--api-server-count when not given."""
    return SPARE_CORES_API_SERVERS if (num_cpus or 1) >= SPARE_CORES else 1


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _json_dict(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text}")
    return value


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxpaged.server",
        description="OpenAI-compatible HTTP server for jaxpaged (the flags of `vllm serve`).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _model_flags(p.add_argument_group("model"))
    _cache_and_scheduler_flags(p.add_argument_group("cache and scheduler"))
    _server_flags(p.add_argument_group("server"))
    return p


def _model_flags(m) -> None:
    m.add_argument("--model", default=None,
                   help="Local Hugging Face model folder, or a GGUF file (llama, qwen2, qwen3, gemma2, gemma3; "
                        "converted once into the cache). Omitted: the embedded SmolLM2-135M-Instruct.")
    m.add_argument("--tokenizer", default=None,
                   help="Tokenizer folder (default: the model folder; a GGUF file's own tokenizer).")
    m.add_argument("--served-model-name", nargs="+", default=None,
                   help="Model name(s) the API accepts in the `model` field; the first is reported in "
                        "responses. Default: the --model argument (or SmolLM2-135M-Instruct).")
    m.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="Weight and activation dtype; auto takes the checkpoint's torch_dtype.")
    m.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="How to load weights; dummy gives random weights of the right shapes (benchmarks).")
    m.add_argument("--quantization", "-q", default=None, choices=list(QUANTIZATION_METHODS),
                   help="Weights kept quantized on the device. gguf: the weights stay in the blocks of the GGUF "
                        "file the model was converted from (the default SmolLM2 as shipped: Q4_1 and Q8_0; a "
                        "--model file.gguf's own), expanded inside each step. Default: dense weights in --dtype.")
    m.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="Context length (prompt + output). Default: the model's max_position_embeddings.")
    m.add_argument("--chat-template", default=None,
                   help="Jinja chat template, as a file path or the template text itself. Default: the "
                        "tokenizer's template.")
    m.add_argument("--trust-request-chat-template", action="store_true",
                   help="Run the chat template a request brings (`chat_template`). Off: such requests are "
                        "refused, since a template is code the server runs.")
    m.add_argument("--seed", type=int, default=0, help="Random seed for weights (dummy) and sampling.")
    m.add_argument("--generation-config", default="auto",
                   help="Sampling defaults for the fields a request leaves unset (temperature, top_p, top_k, "
                        "min_p, repetition_penalty; max_new_tokens caps max_tokens): 'auto' takes the model "
                        "folder's generation_config.json, 'vllm' the neutral defaults, or a folder path its file.")
    m.add_argument("--override-generation-config", type=_json_dict, default=None,
                   help='JSON object of those fields over the generation config, e.g. \'{"temperature": 0.5}\'.')


def _cache_and_scheduler_flags(c) -> None:
    c.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="Fraction of GPU memory for weights, activations and the KV cache.")
    c.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32],
                   help="Tokens per KV cache block.")
    c.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="The KV cache's dtype: auto (the model's) or fp8 / fp8_e4m3 (e4m3: twice the tokens in "
                        "the same memory, scaled by the checkpoint's per-layer k_scale / v_scale, else 1.0).")
    c.add_argument("--calculate-kv-scales", action="store_true",
                   help="With an fp8 KV cache: each layer's k_scale / v_scale from a calibration prompt run at "
                        "start-up (the largest |k| / 200 and |v| / 100, vLLM's constants), in place of the "
                        "checkpoint's or 1.0.")
    c.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="Use this many KV cache blocks instead of sizing the pool from free memory.")
    c.add_argument("--swap-space", type=float, default=4.0,
                   help="GiB of host memory for swapped-out blocks (with --preemption-mode swap).")
    c.add_argument("--preemption-mode", default=None, choices=["recompute", "swap"],
                   help="What to do with a preempted request's blocks: drop and recompute, or swap to host.")
    c.add_argument("--max-num-seqs", type=_positive_int, default=None,
                   help="Most requests in one batch. Default (vLLM's): 1024 on GPUs with >= 70 GiB, else "
                        "256.")
    c.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                   help="Token budget of one engine step. Default (as LLM, vLLM's offline defaults): 16384 "
                        "on GPUs with >= 70 GiB, 8192 on smaller GPUs, 2048 on the CPU; at least max-model-len "
                        "when chunked prefill is off.")
    c.add_argument("--num-scheduler-steps", type=_positive_int, default=None,
                   help="Decode steps per device program (multi-step scheduling, as vLLM V0); default (as "
                        f"LLM): {GPU_SCHEDULER_STEPS} on GPUs for models whose layers hold under "
                        f"{GPU_SINGLE_STEP_MIN_BYTES >> 20} MiB of weights, else 1. When "
                        "every running request decodes and none waits, the GPU runs this many steps before the "
                        "host sees their tokens, which then stream in groups of up to this many. Requests "
                        "with logprobs, penalties, logit bias or min_tokens run one step at a time.")
    c.add_argument("--layer-dispatch", default=None, choices=list(LAYER_DISPATCHES),
                   help="How a step runs the decoder layers (as LLM's layer_dispatch); default: unrolled on GPUs "
                        "(the whole step one program), per_layer or scan on the CPU. per_layer runs programs of "
                        f"{LAYERS_PER_DISPATCH} layers, one decode step each: they compile faster (a shorter cold "
                        "start-up for large models) at a small cost in speed.")
    c.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="Reuse KV blocks of shared prompt prefixes (automatic prefix caching).")
    c.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="Split long prompts into chunks scheduled beside running decodes.")
    c.add_argument("--max-logprobs", type=_positive_int, default=20,
                   help="Most logprobs (and prompt logprobs) one request may ask for; more is a 400.")
    c.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs: first come first served; priority: the request's `priority` field first.")
    c.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="GPUs to shard the model over. Only 1 is supported for now.")


def _server_flags(s) -> None:
    s.add_argument("--host", default=None, help="Host to bind (default: all interfaces).")
    s.add_argument("--port", type=int, default=8000, help="TCP port to listen on.")
    s.add_argument("--api-server-count", type=_positive_int, default=None,
                   help="API server processes sharing the port over the one engine core. Each parses, tokenizes, "
                        "detokenizes and streams the requests it accepts, so more of them admit bursts of "
                        "requests faster, for a few hundred MB of host memory and a busy core each; /metrics "
                        f"sums them all. Default: {SPARE_CORES_API_SERVERS} on a host of at least "
                        f"{SPARE_CORES} cores, else 1.")
    s.add_argument("--api-key", nargs="+", default=None,
                   help="If set, requests must send `Authorization: Bearer <key>` with one of these keys, on "
                        "every route but /health, /ping, /version, /metrics and the API docs. Default: the "
                        "JAXPAGED_API_KEY environment variable, if set.")
    s.add_argument("--max-request-body-mib", type=_positive_int, default=DEFAULT_MAX_REQUEST_BODY_MIB,
                   help="Largest request body accepted, in MiB; a larger one gets a 413 before it is read "
                        "whole. The default admits a prompt of a million tokens, as text or token ids.")
    s.add_argument("--allowed-origins", type=_json_list, default=["*"],
                   help='CORS allowed origins, as a JSON list, e.g. \'["http://localhost:3000"]\'.')
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical", "trace"],
                   help="Log level of uvicorn.")
    s.add_argument("--disable-log-requests", action="store_true",
                   help="Do not log each request's id, prompt length and sampling parameters.")
    s.add_argument("--root-path", default=None,
                   help="FastAPI root_path, when the app sits behind a path-based proxy.")


def _json_list(text: str) -> list[str]:
    import json
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings: {e}") from None
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError("expected a JSON list of strings")
    return [str(v) for v in value]


def validate_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Errors the engine would only find after loading the model: report them at once. Fills in the
    defaults that depend on the host (--api-server-count)."""
    if args.api_server_count is None:
        args.api_server_count = default_api_server_count(os.cpu_count())
    if args.tensor_parallel_size != 1:
        parser.error(f"--tensor-parallel-size {args.tensor_parallel_size} is not supported yet: jaxpaged "
                     "runs on one GPU, so only --tensor-parallel-size 1 works")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        parser.error(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.swap_space < 0:
        parser.error(f"--swap-space must be non-negative, got {args.swap_space}")
    if args.num_gpu_blocks_override is not None and args.num_gpu_blocks_override < 2:
        parser.error("--num-gpu-blocks-override must be at least 2 (block 0 is the null block)")


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=args.model, tokenizer=args.tokenizer,
        served_model_name=args.served_model_name[0] if args.served_model_name else None,
        dtype=args.dtype, load_format=args.load_format, max_model_len=args.max_model_len,
        block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_blocks_override=args.num_gpu_blocks_override, swap_space=args.swap_space,
        preemption_mode=args.preemption_mode, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill, scheduling_policy=args.scheduling_policy,
        seed=args.seed, tensor_parallel_size=args.tensor_parallel_size, max_logprobs=args.max_logprobs,
        num_scheduler_steps=args.num_scheduler_steps, layer_dispatch=args.layer_dispatch,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales,
        generation_config=args.generation_config, override_generation_config=args.override_generation_config,
        usage_context="openai_api_server")
