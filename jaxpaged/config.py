"""What users set (EngineArgs) and what runs (RunConfig), joined by one function: resolve().

Every choice of what runs — layer dispatch, decode steps per program, attention backend, executable
cache, input alignment, batch defaults — is made in resolve() from the engine arguments, the platform and
two facts of the model. The server and `LLM` both go through it and get the same program. Nothing below
it reads environment variables or asks JAX for the platform to pick a path.
The measurements behind each rule are in bench/results/NOTES.md.
"""
from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

USAGE_CONTEXTS = ("llm_class", "openai_api_server")
# How a step runs the decoder layers (runner/layerwise.py): one scan over stacked weights, a few layers per
# dispatched program, or every layer unrolled into one program on per-layer weights.
LAYER_DISPATCHES = ("scan", "per_layer", "unrolled")
ATTENTION_BACKENDS = ("reference", "xla", "pallas", "mosaic")
# What EngineArgs.quantization accepts (vLLM's names): gguf keeps the linear layers in the blocks of the GGUF
# file the model folder was converted from; awq, gptq and compressed-tensors (pack-quantized W4A16 or
# float-quantized fp8) read checkpoints as published, and so does fp8 (vLLM's format), which on a dense
# checkpoint quantizes the weights at load (the method is also detected from config.json's
# quantization_config; models/quant_loader.py).
QUANTIZATION_METHODS = ("awq", "compressed-tensors", "fp8", "gguf", "gptq")
# The KV pool's dtype (vLLM's --kv-cache-dtype): auto is the model's; fp8 and fp8_e4m3 store e4m3, half of
# bf16's bytes, with a per-layer k_scale / v_scale from the checkpoint (else 1.0).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")

# Decode steps per program on a GPU when the whole step is one program. With one step per program a small
# model's decode is host-bound (the launch and the engine's work outlast the device step). A stream gets a
# program's tokens together; the scheduler runs one step whenever a request waits for its prefill.
GPU_SCHEDULER_STEPS = 16
# Off the GPU, per-layer dispatch from this many bytes of weights per layer: the layer scan slices each layer's
# weights out of the stacked arrays, and XLA copies every slice that feeds a matmul; from this size those
# copies cost more than the extra launches of a few programs per step.
PER_LAYER_MIN_BYTES = 64 << 20
# On a GPU every layer runs unrolled in the step's one program (no weight slices, one launch a step). From this
# many bytes a layer, one decode step a program; smaller layers take GPU_SCHEDULER_STEPS steps a program, which
# keeps a small model's device busy (a one-request qwen2-0.5b step is ~1 ms, shorter than a step's host work).
# Large layers keep to one step: a device step of several ms hides the host's work, and a multi-step program's
# while loop keeps decode attention on the Triton kernel (pallas_kernels.attention's in_loop), which loses to the
# Mosaic one at large batches (llama3-8b ShareGPT 1000 on the H200: 16 steps unrolled 0.95x one step per_layer).
# Unrolled with one step against per-layer programs of LAYERS_PER_DISPATCH layers (llama3-8b in bf16, 416 MiB a
# layer, H200): offline ShareGPT 1000 1.016x over nine interleaved runs on one machine, the 17-512-request
# decode steps 3-20% shorter (the per-layer programs each recompute the attention kernels' work lists and copy
# their inputs), one request's step as long back to back. In 4 bits (117 MiB a layer) one request's token took
# 4.6-5.6 ms in per-layer programs against 3.4 ms unrolled with 16 steps. What unrolling costs is start-up: its
# programs take longer to compile.
GPU_SINGLE_STEP_MIN_BYTES = 256 << 20
# XLA's GEMM autotuning, which times candidate kernels on the GPU as each program compiles, is off for the step
# programs of layers from GPU_SINGLE_STEP_MIN_BYTES: llama3-8b on the H200 (each pair on one machine) started cold
# in 53.2 s without it against 64.0 s with it (56.9 against 62.2 s on another), at 9,504 against 9,394 offline
# output tok/s and 4.42 against 4.54 ms a token at one request, its large GEMMs as fast on cuBLAS's own choice.
# Smaller layers keep it: qwen2-0.5b's one-request token took 1.22 ms without it against 1.06 ms. A user's
# XLA_FLAGS that name --xla_gpu_autotune_level decide instead.
GPU_NO_AUTOTUNE_MIN_BYTES = GPU_SINGLE_STEP_MIN_BYTES
# A cold start-up compiles the common sampler variants' head-and-sampler programs (runner/step.py
# WARM_SAMPLER_VARIANTS) before the engine is ready for small layers, and while it serves for layers from this
# size. The steps of small layers are host-bound, and they ran slow beside those compiles: a cold qwen2-0.5b
# server took a 1000-request burst at 69-72% of the offline throughput inside its 9-11 s of them, against 82%
# once they were done (H200). Large layers' steps are long enough not to mind, and their start-up has no
# seconds to spare (llama3-8b's ~15 s of them would take a cold server past 60 s). A warm start-up loads
# them from the executable cache in under a second either way.
GPU_BACKGROUND_VARIANTS_MIN_BYTES = GPU_SINGLE_STEP_MIN_BYTES
# Layers in one program under per-layer dispatch: one layer per program left the device idle at small
# batches (a launch costs about as much host time as a layer's device time); four keep it busy.
LAYERS_PER_DISPATCH = 4
# Unrolled layers hand the Mosaic GPU kernels slices of the packed step inputs, and the Mosaic custom call
# needs each input on the 256-byte grid: 64 elements of 4 bytes. Elsewhere the pieces stay back to back.
MOSAIC_INPUT_ALIGN = 64
# Processes that lower a cold start-up's programs beside the engine (runner/lowering_workers.py): lowering
# is Python and holds the GIL, one program at a time, so it was most of a cold start-up (llama3-8b on the
# H100: 46 s of 35 buckets' lowering on the main thread, the compiles trailing it). At most this many, and
# no more than half the host's cores (the engine's compile threads use the rest).
MAX_LOWERING_PROCESSES = 8


@dataclasses.dataclass
class EngineArgs:
    model: str | None = None                  # HF folder or .gguf file; None = the embedded SmolLM2-135M-Instruct
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
    max_num_seqs: int | None = None           # default: by device and usage context (resolve)
    max_num_batched_tokens: int | None = None  # default: likewise; >= max_model_len without chunked prefill
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"           # fcfs | priority
    seed: int = 0
    tensor_parallel_size: int = 1
    max_logprobs: int = 20                    # most logprobs / prompt_logprobs a request may ask for (vLLM's)
    generation_config: str = "auto"           # sampling defaults: auto (the model's) | vllm | a folder
    override_generation_config: dict | None = None   # fields over those (engine/generation_config.py)
    attention_backend: str | None = None      # reference | xla | pallas | mosaic; default by platform
    layer_dispatch: str | None = None         # scan | per_layer | unrolled; default by layer size and use
    compile_buckets: bool | None = None       # compile every shape bucket at start-up (default: on GPUs)
    num_scheduler_steps: int | None = None    # decode steps per program (vLLM's multi-step); default by use
    quantization: str | None = None          # QUANTIZATION_METHODS; None: dense, or what config.json declares
    kv_cache_dtype: str = "auto"             # KV_CACHE_DTYPES
    calculate_kv_scales: bool = False        # fp8 KV cache: k_scale / v_scale from a calibration prompt
    disable_log_stats: bool = True
    usage_context: str = "llm_class"          # llm_class | openai_api_server: who runs the engine (logged)

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
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.usage_context not in USAGE_CONTEXTS:
            raise ValueError(f"usage_context must be one of {USAGE_CONTEXTS}, got {self.usage_context!r}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.num_scheduler_steps is not None and self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be at least 1, got {self.num_scheduler_steps}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization {self.quantization!r} is not supported; supported: "
                             f"{', '.join(QUANTIZATION_METHODS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported; supported: "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError("calculate_kv_scales sets the scales of an fp8 KV cache: it needs kv_cache_dtype "
                             "fp8 or fp8_e4m3")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be non-negative, got {self.swap_space}")
        from jaxpaged.engine.generation_config import check_generation_config
        check_generation_config(self.generation_config, self.override_generation_config)


class Platform(NamedTuple):
    """The facts of the device that resolve() reads."""
    name: str                 # JAX platform: "cpu" | "gpu"
    device_kind: str          # e.g. "NVIDIA H100 80GB HBM3"
    memory_bytes: int         # the allocator's limit (0 on the CPU, which reports none)
    hopper: bool              # compute capability 9.x: the Mosaic GPU kernels run
    num_sms: int = 0          # the GPU's streaming multiprocessors (0 on the CPU)
    num_cpus: int = 1         # the host's CPU cores


def detect_platform() -> Platform:
    import jax

    from jaxpaged.pallas_kernels import is_hopper
    device = jax.devices()[0]
    on_gpu = device.platform != "cpu"
    memory = (device.memory_stats() or {}).get("bytes_limit", 0) if on_gpu else 0
    sms = int(getattr(device, "core_count", 0) or 0) if on_gpu else 0
    return Platform(device.platform, device.device_kind, memory, is_hopper(device), sms, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What runs, resolved once from EngineArgs and the platform (resolve) and passed down."""
    platform: str                  # "cpu" | "gpu"
    usage_context: str             # llm_class | openai_api_server
    max_model_len: int
    max_num_batched_tokens: int    # the token budget of one step
    max_num_seqs: int              # requests in one step, at most
    attention_backend: str         # reference | xla | pallas | mosaic (pallas_kernels.attention)
    layer_dispatch: str            # scan | per_layer | unrolled (runner/layerwise.py)
    layers_per_dispatch: int       # layers in one program: all of them unless per_layer
    num_scheduler_steps: int       # decode steps per program (runner/multi_step.py)
    compile_buckets: bool          # compile every shape bucket at start-up
    executable_cache: bool         # keep compiled steps on disk and load them at start-up (runner/exec_cache.py)
    input_align: int               # elements each packed step input starts at a multiple of (runner/step_inputs.py)
    num_sms: int | None = None     # the GPU's SM count the kernels size their grids by (None on the CPU)
    # Worker processes that lower the programs a cold start-up compiles (runner/lowering_workers.py);
    # 0: the engine lowers them itself, one at a time.
    lowering_processes: int = 0
    # The warm-up also compiles the head and sampler of the common sampler variants for every bucket
    # (runner/step.py WARM_SAMPLER_VARIANTS), so their first requests compile nothing (GPUs).
    warm_sampler_variants: bool = False
    # Those compiles run while the engine serves rather than before it is ready (GPU_BACKGROUND_VARIANTS_MIN_BYTES).
    variants_in_background: bool = False
    # XLA's GEMM autotuning for the step programs (GPU_NO_AUTOTUNE_MIN_BYTES); the CPU has none.
    step_autotune: bool = True

    @property
    def interpret(self) -> bool:
        """Whether the Pallas kernels run in interpret mode (the CPU)."""
        return self.platform == "cpu"

    @property
    def single_program(self) -> bool:
        """Whether one engine step is one compiled program (what multi-step decoding needs)."""
        return self.layer_dispatch != "per_layer"

    def summary(self) -> str:
        """The start-up log line."""
        return (f"platform={self.platform} usage={self.usage_context} attention={self.attention_backend} "
                f"layers={self.layer_dispatch}"
                + (f"/{self.layers_per_dispatch}" if self.layer_dispatch == "per_layer" else "")
                + f" steps_per_program={self.num_scheduler_steps} max_num_batched_tokens={self.max_num_batched_tokens}"
                f" max_num_seqs={self.max_num_seqs} max_model_len={self.max_model_len}"
                f" compile_buckets={self.compile_buckets} executable_cache={self.executable_cache}"
                f" input_align={self.input_align} lowering_processes={self.lowering_processes}"
                + ("" if self.step_autotune else " step_autotune=False")
                + (" variants_in_background=True" if self.warm_sampler_variants and self.variants_in_background
                   else ""))


def resolve(args: EngineArgs, platform: Platform, *, layer_bytes: int, max_position_embeddings: int,
            compile_cache: bool = True) -> RunConfig:
    """The one place that decides what runs. layer_bytes: one decoder layer's weights; compile_cache:
    whether compiled programs may be kept on disk at all (the user's JAXPAGED_COMPILE_CACHE)."""
    max_model_len = args.max_model_len or max_position_embeddings
    if max_model_len > max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} is larger than the model's "
                         f"max_position_embeddings={max_position_embeddings}")
    max_tokens, max_seqs = _batch_limits(args, platform, max_model_len)
    on_gpu = platform.name == "gpu"
    # The server runs what LLM runs: its streams take each program's tokens as they arrive, and the
    # scheduler drops to one step per program whenever a request waits (scheduler._num_steps), so a new
    # request's first token never waits behind a multi-step batch.
    dispatch = args.layer_dispatch or _layer_dispatch(layer_bytes, on_gpu, args.num_scheduler_steps)
    if args.num_scheduler_steps is not None:
        steps = args.num_scheduler_steps
    else:
        steps = (GPU_SCHEDULER_STEPS if on_gpu and dispatch != "per_layer" and layer_bytes < GPU_SINGLE_STEP_MIN_BYTES
                 else 1)
    if steps > 1 and dispatch == "per_layer":
        raise ValueError("num_scheduler_steps > 1 (multi-step decoding) needs the whole step in one program, "
                         "but layer_dispatch='per_layer' runs the layers in groups: use layer_dispatch "
                         "'unrolled' or 'scan', or num_scheduler_steps=1")
    backend = args.attention_backend or ("xla" if not on_gpu else "mosaic" if platform.hopper else "pallas")
    compile_buckets = args.compile_buckets if args.compile_buckets is not None else on_gpu
    # Every dispatch: per_layer's embedding, layer-group and head programs are each cached. Not on the
    # CPU: XLA:CPU cannot run some deserialized bf16 programs, and CPU compiles are quick anyway.
    executable_cache = on_gpu and compile_cache
    return RunConfig(
        platform=platform.name, usage_context=args.usage_context, max_model_len=max_model_len,
        max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs, attention_backend=backend,
        layer_dispatch=dispatch,
        layers_per_dispatch=LAYERS_PER_DISPATCH if dispatch == "per_layer" else 0,
        num_scheduler_steps=steps,
        compile_buckets=compile_buckets,
        executable_cache=executable_cache,
        input_align=MOSAIC_INPUT_ALIGN if dispatch == "unrolled" else 1,
        num_sms=(platform.num_sms or None) if on_gpu else None,
        lowering_processes=_lowering_processes(platform, compile_buckets and executable_cache),
        warm_sampler_variants=on_gpu and compile_buckets,
        variants_in_background=layer_bytes >= GPU_BACKGROUND_VARIANTS_MIN_BYTES,
        step_autotune=(not on_gpu or layer_bytes < GPU_NO_AUTOTUNE_MIN_BYTES
                       or "xla_gpu_autotune_level" in os.environ.get("XLA_FLAGS", "")),
    )


def _lowering_processes(platform: Platform, compile_buckets: bool) -> int:
    """Lowering workers for a cold start-up: on Hopper GPUs that compile their buckets at start-up into the
    executable cache (runner/step.py's warm-up). The workers run JAX on the CPU and name the GPU to the
    kernels' lowering as compute capability 9.0, Hopper's: only there is their program the one the engine
    would lower itself. Elsewhere (and on the CPU, whose compiles are quick) the engine lowers alone."""
    if platform.name != "gpu" or not platform.hopper or not compile_buckets:
        return 0
    return min(MAX_LOWERING_PROCESSES, platform.num_cpus // 2)


def _layer_dispatch(layer_bytes: int, on_gpu: bool, steps: int | None) -> str:
    """On a GPU: unrolled (the step one program; GPU_SINGLE_STEP_MIN_BYTES picks its decode steps). On the CPU:
    per_layer from PER_LAYER_MIN_BYTES, else the scan (quick to compile); unrolled where several decode steps a
    program are asked for with large layers (they need the step in one program)."""
    if on_gpu:
        return "unrolled"
    if steps is not None and steps > 1:
        return "unrolled" if layer_bytes >= PER_LAYER_MIN_BYTES else "scan"
    return "per_layer" if layer_bytes >= PER_LAYER_MIN_BYTES else "scan"


def _batch_limits(args: EngineArgs, platform: Platform, max_model_len: int) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs): the user's, else vLLM V1's offline defaults, checked.

    GPUs with >= 70 GiB (H100, H200; not A100, where vLLM measured a regression): 16384 tokens, 1024
    sequences; smaller GPUs 8192 tokens, 256 sequences. vLLM gives its server half the token budget; here
    the server runs what LLM runs (one program), and a user who wants shorter mixed steps sets
    --max-num-batched-tokens. The CPU (tests, development) keeps 2048 tokens and 256 sequences, so its
    compiled shapes stay few and small."""
    if platform.name == "cpu":
        tokens, seqs = 2048, 256
    elif platform.memory_bytes >= 70 * 2**30 and "a100" not in platform.device_kind.lower():
        tokens, seqs = 16384, 1024
    else:
        tokens, seqs = 8192, 256
    if not args.enable_chunked_prefill:
        tokens = max(max_model_len, tokens)
    max_tokens = args.max_num_batched_tokens or tokens
    if not args.enable_chunked_prefill and max_tokens < max_model_len:
        raise ValueError(f"max_num_batched_tokens ({max_tokens}) is smaller than max_model_len "
                         f"({max_model_len}) with chunked prefill disabled: long prompts could never run")
    return max_tokens, args.max_num_seqs or seqs
