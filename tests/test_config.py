"""config.resolve(): the one function that decides what runs, per platform, use and model size, and the
errors it gives for combinations that cannot run. Pure Python: no model, no device."""
import dataclasses

import pytest

from jaxpaged.config import (GPU_SINGLE_STEP_MIN_BYTES, LAYERS_PER_DISPATCH, MAX_LOWERING_PROCESSES, MOSAIC_INPUT_ALIGN,
                             GPU_SCHEDULER_STEPS, PER_LAYER_MIN_BYTES, EngineArgs, Platform, resolve)

H100 = Platform("gpu", "NVIDIA H100 80GB HBM3", 76 * 2**30, True)
A100 = Platform("gpu", "NVIDIA A100-SXM4-80GB", 76 * 2**30, False)
L4 = Platform("gpu", "NVIDIA L4", 22 * 2**30, False)
CPU = Platform("cpu", "cpu", 0, False)
SMALL, LARGE = 8 << 20, GPU_SINGLE_STEP_MIN_BYTES  # qwen2-0.5b-sized and llama3-8b-sized layers
MEDIUM = PER_LAYER_MIN_BYTES                         # under GPU_SINGLE_STEP_MIN_BYTES: llama3-8b in 4 bits (117 MiB)
SERVER = "openai_api_server"


def run(platform=H100, layer_bytes=SMALL, **args):
    return resolve(EngineArgs(**args), platform, layer_bytes=layer_bytes, max_position_embeddings=4096)


@pytest.mark.parametrize("platform, usage, layer_bytes, dispatch, steps", [
    (H100, "llm_class", SMALL, "unrolled", GPU_SCHEDULER_STEPS),   # small layers: one graph, 16 steps
    (H100, SERVER, SMALL, "unrolled", GPU_SCHEDULER_STEPS),        # the server runs what LLM runs
    (H100, "llm_class", LARGE, "unrolled", 1),      # large layers: one program, one decode step
    (H100, SERVER, LARGE, "unrolled", 1),
    (H100, "llm_class", MEDIUM, "unrolled", GPU_SCHEDULER_STEPS),  # a 4-bit 8B model: several steps a program
    (H100, SERVER, MEDIUM, "unrolled", GPU_SCHEDULER_STEPS),
    (CPU, "llm_class", SMALL, "scan", 1),
    (CPU, "llm_class", MEDIUM, "per_layer", 1),
    (CPU, SERVER, LARGE, "per_layer", 1),
])
def test_layer_dispatch_and_steps_by_platform_use_and_layer_size(platform, usage, layer_bytes, dispatch, steps):
    r = run(platform, layer_bytes, usage_context=usage)
    assert (r.layer_dispatch, r.num_scheduler_steps) == (dispatch, steps)
    assert r.layers_per_dispatch == (LAYERS_PER_DISPATCH if dispatch == "per_layer" else 0)
    assert r.input_align == (MOSAIC_INPUT_ALIGN if dispatch == "unrolled" else 1)
    assert r.single_program == (dispatch != "per_layer")


def test_several_steps_on_large_layers_unroll_them():
    """--num-scheduler-steps on a model with large layers (llama3-8b in the server) needs the step in one
    program: the layers are unrolled instead of refusing to start."""
    r = run(H100, LARGE, usage_context=SERVER, num_scheduler_steps=8)
    assert (r.layer_dispatch, r.num_scheduler_steps, r.input_align) == ("unrolled", 8, MOSAIC_INPUT_ALIGN)
    assert run(CPU, LARGE, num_scheduler_steps=4).layer_dispatch == "unrolled"
    assert run(CPU, LARGE, num_scheduler_steps=1).layer_dispatch == "per_layer"


def test_explicit_choices_are_kept_and_impossible_ones_refused():
    assert run(CPU, num_scheduler_steps=4).num_scheduler_steps == 4
    assert run(H100, layer_dispatch="scan").num_scheduler_steps == GPU_SCHEDULER_STEPS
    assert run(H100, attention_backend="xla").attention_backend == "xla"
    with pytest.raises(ValueError, match="needs the whole step in one program"):
        run(H100, LARGE, layer_dispatch="per_layer", num_scheduler_steps=4)
    with pytest.raises(ValueError, match="max_model_len=8192 is larger than the model's"):
        run(max_model_len=8192)
    with pytest.raises(ValueError, match="smaller than max_model_len"):
        run(enable_chunked_prefill=False, max_num_batched_tokens=1024)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineArgs(attention_backend="cudnn")


@pytest.mark.parametrize("platform, expected", [(H100, "mosaic"), (A100, "pallas"), (L4, "pallas"), (CPU, "xla")])
def test_attention_backend_by_platform(platform, expected):
    """Hopper: the Mosaic GPU kernels; other GPUs: Triton; the CPU: the chunked jnp path."""
    assert run(platform).attention_backend == expected


def test_batch_defaults_are_vllms():
    """vLLM V1's offline defaults, for LLM and the server alike (one program): GPUs with >= 70 GiB (not A100)
    16384 tokens, 1024 sequences; smaller GPUs 8192 and 256; the CPU 2048 and 256. Without chunked prefill
    the budget covers max_model_len."""
    limits = lambda r: (r.max_num_batched_tokens, r.max_num_seqs)
    assert limits(run(H100)) == (16384, 1024)
    assert limits(run(H100, usage_context=SERVER)) == (16384, 1024)
    assert limits(run(A100)) == (8192, 256)
    assert limits(run(L4, usage_context=SERVER)) == (8192, 256)
    assert limits(run(CPU)) == (2048, 256)
    assert limits(run(CPU, enable_chunked_prefill=False)) == (4096, 256)
    assert limits(run(H100, max_num_batched_tokens=512, max_num_seqs=3)) == (512, 3)
    assert run().max_model_len == 4096 and run(max_model_len=100).max_model_len == 100


def test_compile_buckets_and_executable_cache():
    """Buckets compile at start-up on GPUs; compiled steps are kept on disk on GPUs with the compile cache
    on, under every layer dispatch (XLA:CPU cannot run some deserialized programs)."""
    assert run(H100).compile_buckets and not run(CPU).compile_buckets
    assert run(CPU, compile_buckets=True).compile_buckets
    assert run(H100).executable_cache and not run(CPU).executable_cache
    assert run(H100, LARGE, layer_dispatch="per_layer").executable_cache    # each of a step's programs
    for layer_bytes in (SMALL, LARGE):
        assert not resolve(EngineArgs(), H100, layer_bytes=layer_bytes, max_position_embeddings=4096,
                           compile_cache=False).executable_cache


def test_the_summary_is_one_line_naming_every_choice():
    line = run(H100, LARGE, layer_dispatch="per_layer").summary()
    assert "\n" not in line
    for part in ("platform=gpu", "attention=mosaic", "layers=per_layer/4", "steps_per_program=1",
                 "max_num_batched_tokens=16384", "max_num_seqs=1024", "executable_cache=True", "input_align=1"):
        assert part in line


@pytest.mark.parametrize("platform", [H100, A100, L4, CPU])
@pytest.mark.parametrize("layer_bytes", [SMALL, LARGE])
def test_the_server_and_llm_resolve_the_same_program(platform, layer_bytes):
    """One program: the two uses differ only in the label."""
    a = run(platform, layer_bytes, usage_context="llm_class")
    b = run(platform, layer_bytes, usage_context=SERVER)
    assert dataclasses.replace(b, usage_context="llm_class") == a


@pytest.mark.parametrize("platform, cpus, compile_cache, want", [
    (H100._replace(num_cpus=16), 16, True, 8),      # half the cores, at most MAX_LOWERING_PROCESSES
    (H100._replace(num_cpus=64), 64, True, MAX_LOWERING_PROCESSES),
    (H100._replace(num_cpus=6), 6, True, 3),
    (H100._replace(num_cpus=16), 16, False, 0),     # no executable cache: the engine lowers alone
    (A100._replace(num_cpus=16), 16, True, 0),      # workers lower for compute capability 9.0 only
    (CPU._replace(num_cpus=16), 16, True, 0),
])
def test_lowering_processes_on_hopper_gpus_that_compile_at_startup(platform, cpus, compile_cache, want):
    r = resolve(EngineArgs(), platform, layer_bytes=SMALL, max_position_embeddings=4096, compile_cache=compile_cache)
    assert r.lowering_processes == want
    assert f"lowering_processes={want}" in r.summary()
    assert r.interpret == (platform.name == "cpu")


def test_the_device_facts_reach_the_runtime_options():
    """The kernels take interpret mode and the SM count from the configuration, never from the process's
    JAX (a lowering worker runs JAX on the CPU for a GPU program)."""
    assert run(H100._replace(num_sms=132)).num_sms == 132
    assert run(CPU).num_sms is None and run(CPU).interpret


@pytest.mark.parametrize("user, expected", [
    ("", "--xla_gpu_enable_triton_gemm=false"),
    ("--xla_dump_to=/tmp/d", "--xla_dump_to=/tmp/d --xla_gpu_enable_triton_gemm=false"),
    ("--xla_gpu_enable_triton_gemm=true", "--xla_gpu_enable_triton_gemm=true"),      # the user's flag wins
    ("--xla_gpu_enable_triton_gemm", "--xla_gpu_enable_triton_gemm"),
])
def test_xla_defaults_keep_the_users_flags(user, expected):
    from jaxpaged.envs import with_xla_default
    assert with_xla_default(user, "xla_gpu_enable_triton_gemm", "false") == expected


def test_xla_flags_in_force_include_the_engine_defaults():
    """jaxpaged's import (before this test's jax started) put its defaults into XLA_FLAGS."""
    import os

    import jaxpaged  # noqa: F401
    assert "xla_gpu_enable_triton_gemm" in os.environ["XLA_FLAGS"]
    assert "xla_disable_hlo_passes" in os.environ["XLA_FLAGS"]


@pytest.mark.parametrize("platform, layer_bytes, xla_flags, want", [
    (H100, LARGE, "", False),         # llama3-8b's layers: the steps compile without XLA's GEMM autotuning
    (H100, LARGE - 1, "", True),      # smaller layers (qwen2-0.5b, a 4-bit 8B model) keep it
    (H100, SMALL, "", True),
    (H100, LARGE, "--xla_gpu_autotune_level=4", True),   # the user's XLA_FLAGS decide
    (CPU, LARGE, "", True),           # the CPU has nothing to autotune: no options passed
])
def test_step_autotuning_by_layer_size(platform, layer_bytes, xla_flags, want, monkeypatch):
    from jaxpaged.config import GPU_NO_AUTOTUNE_MIN_BYTES
    assert GPU_NO_AUTOTUNE_MIN_BYTES == LARGE
    monkeypatch.setenv("XLA_FLAGS", xla_flags)
    r = run(platform, layer_bytes)
    assert r.step_autotune == want
    assert ("step_autotune=False" in r.summary()) == (not want)


@pytest.mark.parametrize("platform, layer_bytes, warm, background", [
    (H100, LARGE, True, True),        # llama3-8b's layers: the variants' heads compile while the engine serves
    (H100, LARGE - 1, True, False),   # smaller layers (host-bound steps) compile them before it is ready
    (H100, SMALL, True, False),
    (CPU, LARGE, False, True),        # the CPU compiles on first use: nothing to warm
])
def test_sampler_variants_compile_before_ready_for_small_layers(platform, layer_bytes, warm, background):
    from jaxpaged.config import GPU_BACKGROUND_VARIANTS_MIN_BYTES
    assert GPU_BACKGROUND_VARIANTS_MIN_BYTES == LARGE
    r = run(platform, layer_bytes)
    assert (r.warm_sampler_variants, r.variants_in_background) == (warm, background)
    assert ("variants_in_background=True" in r.summary()) == (warm and background)
