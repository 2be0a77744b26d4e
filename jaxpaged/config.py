"""EngineArgs: every engine setting, with vLLM's names and defaults."""
from __future__ import annotations

import dataclasses


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
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default 2048, or max_model_len when chunked prefill is off
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"           # fcfs | priority
    seed: int = 0
    tensor_parallel_size: int = 1
    max_logprobs: int = 20                    # most logprobs / prompt_logprobs a request may ask for (vLLM's)
    attention_backend: str | None = None      # reference | xla | pallas; default by platform
    compile_buckets: bool | None = None       # compile every shape bucket at start-up (default: on GPUs)
    disable_log_stats: bool = True

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
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be non-negative, got {self.swap_space}")
