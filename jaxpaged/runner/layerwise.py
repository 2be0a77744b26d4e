"""Per-layer dispatch of one engine step: embed -> one compiled layer program run L times -> head + sampling.

Why: under the layer scan each layer's weights are dynamic slices of the stacked [L, ...] weights, and XLA
copies every slice that feeds a cuBLAS matmul. On llama3-8b that is four copies per layer, 0.44 GB per
layer and 9.4 ms of a 24.9 ms decode step at batch 256 (bench/results/h100/NOTES.md). Unrolling the layers
removes the copies but compiles ~20x longer. Here each layer's weights are their own arrays and the same
layer executable runs L times with the layer index as an argument (the kernels index the pool's layer
themselves), so nothing is sliced and compile time stays that of one layer.

The price is L + 2 dispatches per step instead of one: ~210 us of host time each on the H100 host,
about half of it XLA launching the layer's CUDA graph (NOTES.md, third session), so ~7 ms a step on
llama3-8b, which the device covers at batch >= 64. Worth it where a layer's weights are large (the
default picks it from 64 MiB per layer: llama3-8b yes; on qwen2-0.5b it measured slower than the scan).
Same inputs and outputs as model_runner._packed_step; a test checks both give the same tokens.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.models.decoder import RuntimeOptions, embed_phase, head_phase, layer_phase, split_layer_params
from jaxpaged.runner.sampler import SamplerFlags

PER_LAYER_MIN_BYTES = 64 << 20      # auto: per-layer dispatch when one layer's weights are at least this


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
    from jaxpaged.runner.model_runner import _unpack, fill_input_tokens   # (model_runner imports this module)
    model_input, sampling = _unpack(ints, floats, layout)
    h, cos, sin = embed_phase(cfg, dtype, params, fill_input_tokens(model_input, prev_sampled),
                              model_input.meta.positions)
    return h, cos, sin, model_input, sampling


def _layers(group_params, h, kv_cache, first_idx, meta, cos, sin, *, cfg, dtype, options: RuntimeOptions):
    """The layers first_idx, first_idx + 1, ... on their own weights (a tuple of per-layer trees), unrolled."""
    for j, lp in enumerate(group_params):
        h, kv_cache = layer_phase(cfg, dtype, options, lp, h, kv_cache, first_idx + j, meta, cos, sin)
    return h, kv_cache


@functools.lru_cache(maxsize=None)
def _layers_program(instance: int):
    """The jitted group program, one per instance: each instance compiles (or loads from the compilation
    cache) to its own executable, hence its own CUDA graphs. XLA updates a graph whenever its buffers
    move, and consecutive dispatches of one executable with different weights move them every call."""
    def run(group_params, h, kv_cache, first_idx, meta, cos, sin, *, cfg, dtype, options):
        return _layers(group_params, h, kv_cache, first_idx, meta, cos, sin, cfg=cfg, dtype=dtype,
                       options=options)
    run.__name__ = run.__qualname__ = "_layers"      # one HLO module name: instances share cache entries
    return jax.jit(run, static_argnames=("cfg", "dtype", "options"), donate_argnames=("h", "kv_cache"))


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "flags"))
def _post(params, h, prev_sampled, model_input, sampling, *, cfg, dtype, flags: SamplerFlags):
    from jaxpaged.runner.model_runner import prompt_head, sample_and_keep
    logits, prompt = head_phase(cfg, dtype, params, h, model_input.logits_indices,
                                model_input.prompt_target_ids, prompt_head(flags))
    return sample_and_keep(logits, prompt, sampling, flags, prev_sampled)


def step(params, layer_params, layer_ids, kv_cache, prev_sampled, ints, floats, *, layout, cfg, dtype,
         options: RuntimeOptions, flags: SamplerFlags, group: int = 1, instances: int = 1):
    """One engine step dispatched layer by layer -> (kv_cache, sampled_buf, results), as _packed_step.

    layer_ids: one device int32 scalar per layer, made once (a Python int would be copied every call).
    group: layers per dispatch (unrolled in one program); instances: how many separately compiled copies
    of that program take turns, dispatch by dispatch.
    """
    h, cos, sin, model_input, sampling = _pre(params, prev_sampled, ints, floats, layout=layout, cfg=cfg,
                                              dtype=dtype)
    meta = model_input.meta
    for n, first in enumerate(range(0, len(layer_params), group)):
        run = _layers_program(n % instances)
        h, kv_cache = run(tuple(layer_params[first:first + group]), h, kv_cache, layer_ids[first], meta, cos,
                          sin, cfg=cfg, dtype=dtype, options=options)
    sampled_buf, result = _post(params, h, prev_sampled, model_input, sampling, cfg=cfg, dtype=dtype,
                                flags=flags)
    return kv_cache, sampled_buf, result
