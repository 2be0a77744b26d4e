"""EngineArgs: every engine setting, with vLLM's names and defaults."""
from __future__ import annotations

import dataclasses


USAGE_CONTEXTS = ("llm_class", "openai_api_server")
# How a step runs the decoder layers (runner/layerwise.py): one scan over stacked weights, a few layers per
# dispatched program, or every layer unrolled into one program on per-layer weights.
LAYER_DISPATCHES = ("scan", "per_layer", "unrolled")


def batch_defaults(platform: str, device_memory_bytes: int, device_kind: str,
                   usage_context: str) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) when the user names neither: vLLM V1's choices.

    GPUs with >= 70 GiB (H100, H200; not A100, where vLLM measured a regression): 16384 tokens for the
    offline LLM class, 8192 for the server, 1024 sequences. Smaller GPUs: 8192 / 2048 tokens, 256
    sequences. The CPU backend (tests, development) keeps 2048 tokens and 256 sequences for both, so
    its compiled shapes stay few and small.
    """
    server = usage_context == "openai_api_server"
    if platform == "cpu":
        return 2048, 256
    if device_memory_bytes >= 70 * 2**30 and "a100" not in device_kind.lower():
        return (8192 if server else 16384), 1024
    return (2048 if server else 8192), 256


# Decode steps per program for the offline LLM class on GPUs: on an H100, qwen2-0.5b's one-step decode
# keeps the device busy 42% of a profiled run (host launch and engine work ~2x the device step) and 88%
# with 16 steps (idle/busy 0.136); ShareGPT 1000 ran 36,460 output tok/s against 28,237 with one step on
# one machine (bench/results/h100/NOTES.md, seventh and ninth sessions). Offline there is no stream for
# the steps' groups of tokens to make uneven; the server keeps vLLM's one step.
OFFLINE_GPU_SCHEDULER_STEPS = 16


def default_scheduler_steps(platform: str, usage_context: str, layer_dispatch: str) -> int:
    """num_scheduler_steps when the user names none: OFFLINE_GPU_SCHEDULER_STEPS for the LLM class on a
    GPU where the whole step is one program (scan or unrolled layers), else 1 (the server, the CPU, and
    per-layer dispatch, whose layer groups are separate programs)."""
    if platform == "gpu" and usage_context == "llm_class" and layer_dispatch != "per_layer":
        return OFFLINE_GPU_SCHEDULER_STEPS
    return 1


@dataclasses.dataclass
class EngineArgs:
    model: str | None = None                  # local HF folder; None = the embedded SmolLM2-135M-Instruct
    tokenizer: str | None = None              # defaults to the model folder
    served_model_name: str | None = None
    dtype: str = "auto"                       # auto | bfloat16 | float16 | float32
    load_format: str = "auto"                 # auto | safetensors | dummy
    max_model_len: int | None = None          # default: the model's max_position_embeddings
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    swap_space: float = 4.0                   # GiB of host memory for swapped-out blocks
    preemption_mode: str | None = None        # recompute (default) | swap
    max_num_seqs: int | None = None           # default: by device and usage context (batch_defaults)
    max_num_batched_tokens: int | None = None  # default: likewise; >= max_model_len without chunked prefill
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"           # fcfs | priority
    seed: int = 0
    tensor_parallel_size: int = 1
    max_logprobs: int = 20                    # most logprobs / prompt_logprobs a request may ask for (vLLM's)
    attention_backend: str | None = None      # reference | xla | pallas | mosaic; default by platform
    layer_dispatch: str | None = None         # scan | per_layer | unrolled; default_dispatch: by layer size and use
    compile_buckets: bool | None = None       # compile every shape bucket at start-up (default: on GPUs)
    num_scheduler_steps: int | None = None    # decode steps per program (vLLM's multi-step); default_scheduler_steps
    disable_log_stats: bool = True
    usage_context: str = "llm_class"          # llm_class | openai_api_server: picks the batch defaults

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32):
            raise ValueError(f"block_size must be 8, 16 or 32, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} is not supported yet: "
                             "jaxpaged runs on one GPU (tensor_parallel_size=1)")
        if self.preemption_mode not in (None, "recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors or dummy, got {self.load_format!r}")
        if self.layer_dispatch not in (None, *LAYER_DISPATCHES):
            raise ValueError(f"layer_dispatch must be one of {', '.join(LAYER_DISPATCHES)}, "
                             f"got {self.layer_dispatch!r}")
        if self.usage_context not in USAGE_CONTEXTS:
            raise ValueError(f"usage_context must be one of {USAGE_CONTEXTS}, got {self.usage_context!r}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.num_scheduler_steps is not None and self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be at least 1, got {self.num_scheduler_steps}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be non-negative, got {self.swap_space}")
