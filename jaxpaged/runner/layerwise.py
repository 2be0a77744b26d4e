"""Per-layer dispatch of one engine step: embed -> one compiled program of a few layers (4 by default), run
once per group of layers -> head + sampling.

Why: under the layer scan each layer's weights are dynamic slices of the stacked [L, ...] weights, and XLA
copies every slice that feeds a cuBLAS matmul. On llama3-8b that is four copies per layer, 0.44 GB per
layer and 9.4 ms of a 24.9 ms decode step at batch 256 (bench/results/h100/NOTES.md). Unrolling the layers
removes the copies but compiles ~20x longer. Here each layer's weights are their own arrays and one
program of LAYERS_PER_DISPATCH layers (JAXPAGED_LAYER_GROUP overrides), unrolled, runs once per group of
that many layers with its first layer's index as an argument (the kernels index the pool's layer
themselves), so nothing is sliced and compile time stays that of a few layers. Where the group size does
not divide L, the last, smaller group is a second program.

The price is a few dispatches per step instead of one, ~210 us of host time each on the H100 host, about
half of it XLA launching the program's CUDA graph (NOTES.md, third session). One layer per dispatch
(~7 ms of host a step on llama3-8b) left the device idle most of a small-batch step; four keep it busy.
Worth it where a layer's weights are large (the default picks it from 64 MiB per layer: llama3-8b yes;
on qwen2-0.5b, one layer per dispatch measured slower than the scan).
Same inputs and outputs as model_runner._packed_step; a test checks both give the same tokens.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.models.decoder import RuntimeOptions, embed_phase, head_phase, layer_phase, split_layer_params
from jaxpaged.runner.multi_step import decode_steps
from jaxpaged.runner.sampler import SamplerFlags
from jaxpaged.runner.step_inputs import fill_input_tokens, unpack

PER_LAYER_MIN_BYTES = 64 << 20      # auto: per-layer dispatch when one layer's weights are at least this
# Layers per dispatch. On the H100, llama3-8b decode at batch 1 (bench/results/h100/NOTES.md, fourth
# session): 1 layer per dispatch 7.29 ms a step with the device busy 42% of the traced span, 4 layers
# 5.82 ms at 95%; unchanged at batch 64 and 256 (8.5 / 15.3 ms, device-bound). A 4-layer group compiled
# in ~1 s per bucket there.
LAYERS_PER_DISPATCH = 4


def default_dispatch(params, platform: str = "cpu", usage_context: str = "llm_class") -> str:
    """per_layer where a layer's weights are large (>= PER_LAYER_MIN_BYTES); else, for the offline LLM class
    on a GPU, every layer unrolled into the step; else the layer scan.

    Unrolled layers make a decode step one CUDA graph on per-layer weights: no weight-slice copies and one
    graph launch per step instead of one per layer. On the H100 (bench/results/h100/NOTES.md, twelfth
    session), qwen2-0.5b ShareGPT 1000 at 16 decode steps per program: 48,191-48,938 output tok/s in five
    runs on four machines against the scan's 36,030 (35,992-36,314 over earlier sessions); warm start-up
    22.4-28.6 s. Its programs take about twice the scan's to compile one by one (304-318 s for 50),
    so start-up compiles them on threads (101 s; ModelRunner.warmup).
    The server keeps the scan: with one step per program a small batch is host-bound, and the one large
    graph cost more to launch than the scan's (sixth session, openqa at concurrency 1: median TPOT 3.50 ms
    against 1.95 ms)."""
    if layer_bytes(params) >= PER_LAYER_MIN_BYTES:
        return "per_layer"
    return "unrolled" if platform == "gpu" and usage_context == "llm_class" else "scan"


def layer_bytes(params) -> int:
    """Bytes of one layer's weights in DecoderModel's stacked params."""
    leaves = jax.tree.leaves(params["layers"])
    return sum(x.size * x.dtype.itemsize for x in leaves) // max(1, leaves[0].shape[0])


def split_params(params) -> tuple[dict, list[dict]]:
    """Stacked params -> (the rest, one tree per layer). The stacked layer arrays are DELETED.

    They go through host memory: copied out, freed on the device, then each layer's slice copied back.
    Splitting on the device would hold the weights twice, and the freed stacked region would leave the
    allocator too fragmented for the one large KV pool allocated next (llama3-8b: 16 GB of layers
    beside a 49 GB pool on an 80 GB GPU)."""
    stacked = params["layers"]
    host = jax.tree.map(lambda x: np.array(x), stacked)            # a copy, not a view of the buffer
    for x in jax.tree.leaves(stacked):
        x.delete()
    rest, layers = split_layer_params({**params, "layers": host})
    return rest, [jax.tree.map(jnp.asarray, lp) for lp in layers]


@functools.partial(jax.jit, static_argnames=("layout", "cfg", "dtype"))
def _pre(params, prev_sampled, ints, floats, *, layout, cfg, dtype):
    model_input, sampling = unpack(ints, floats, layout)
    h, cos, sin = embed_phase(cfg, dtype, params, fill_input_tokens(model_input, prev_sampled),
                              model_input.meta.positions)
    return h, cos, sin, model_input, sampling


def _layers(group_params, h, kv_cache, first_idx, meta, cos, sin, *, cfg, dtype, options: RuntimeOptions):
    """The layers first_idx, first_idx + 1, ... on their own weights (a tuple of per-layer trees), unrolled."""
    for j, lp in enumerate(group_params):
        h, kv_cache = layer_phase(cfg, dtype, options, lp, h, kv_cache, first_idx + j, meta, cos, sin)
    return h, kv_cache


_layers_jit = jax.jit(_layers, static_argnames=("cfg", "dtype", "options"), donate_argnames=("h", "kv_cache"))


def group_layers(layer_params: list, layer_ids: list, group: int) -> list[tuple]:
    """[(a group's per-layer trees as a tuple, its first layer's device index)], `group` layers each (the
    last may be smaller); built once, so a step only walks the list."""
    if group < 1:        # range(0, L, -1) would run no layer at all
        raise ValueError(f"layers per dispatch (JAXPAGED_LAYER_GROUP) must be at least 1, got {group}")
    return [(tuple(layer_params[first:first + group]), layer_ids[first])
            for first in range(0, len(layer_params), group)]


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "flags"), donate_argnames=("prev_sampled",))
def _post(params, h, prev_sampled, model_input, sampling, *, cfg, dtype, flags: SamplerFlags):
    from jaxpaged.runner.model_runner import prompt_head, sample_and_keep
    logits, prompt = head_phase(cfg, dtype, params, h, model_input.logits_indices,
                                model_input.prompt_target_ids, prompt_head(flags))
    return sample_and_keep(logits, prompt, sampling, flags, prev_sampled)


@functools.partial(jax.jit, static_argnames=("layout", "cfg", "dtype", "options", "flags"),
                   donate_argnames=("kv_cache", "prev_sampled"))
def whole_step(params, layer_params, kv_cache, prev_sampled, ints, floats, *, layout, cfg, dtype,
               options: RuntimeOptions, flags: SamplerFlags):
    """The whole step as one program, every layer unrolled on its own weights (all layers in one group)."""
    if options.num_steps > 1:      # multi-step decoding (model_runner.decode_steps)
        model_input, sampling = unpack(ints, floats, layout)

        def forward(tokens, kv, meta):
            h, cos, sin = embed_phase(cfg, dtype, params, tokens, meta.positions)
            h, kv = _layers(layer_params, h, kv, 0, meta, cos, sin, cfg=cfg, dtype=dtype, options=options)
            return head_phase(cfg, dtype, params, h, model_input.logits_indices)[0], kv
        return decode_steps(forward, kv_cache, prev_sampled, model_input, sampling, options.num_steps, flags)
    h, cos, sin, model_input, sampling = _pre.__wrapped__(params, prev_sampled, ints, floats, layout=layout,
                                                          cfg=cfg, dtype=dtype)
    h, kv_cache = _layers(layer_params, h, kv_cache, 0, model_input.meta, cos, sin, cfg=cfg, dtype=dtype,
                          options=options)
    sampled_buf, result = _post.__wrapped__(params, h, prev_sampled, model_input, sampling, cfg=cfg, dtype=dtype,
                                            flags=flags)
    return kv_cache, sampled_buf, result


def step(params, layer_groups, kv_cache, prev_sampled, ints, floats, *, layout, cfg, dtype,
         options: RuntimeOptions, flags: SamplerFlags):
    """One engine step dispatched group by group -> (kv_cache, sampled_buf, results), as _packed_step.

    layer_groups: from group_layers; each group's layers run unrolled in one program (a last, smaller
    group compiles its own), its first index a device scalar made once (a Python int is copied every call).
    A single group (layers per dispatch >= L) makes the whole step one program (whole_step): one launch
    instead of L / group + 2, and no activations handed from program to program.
    """
    if len(layer_groups) == 1:
        return whole_step(params, layer_groups[0][0], kv_cache, prev_sampled, ints, floats, layout=layout,
                          cfg=cfg, dtype=dtype, options=options, flags=flags)
    if options.num_steps > 1:
        raise ValueError("multi-step decoding needs the whole step in one program, not layer groups")
    h, cos, sin, model_input, sampling = _pre(params, prev_sampled, ints, floats, layout=layout, cfg=cfg,
                                              dtype=dtype)
    meta = model_input.meta
    for group_params, first_idx in layer_groups:
        h, kv_cache = _layers_jit(group_params, h, kv_cache, first_idx, meta, cos, sin, cfg=cfg, dtype=dtype,
                                  options=options)
    sampled_buf, result = _post(params, h, prev_sampled, model_input, sampling, cfg=cfg, dtype=dtype,
                                flags=flags)
    return kv_cache, sampled_buf, result
