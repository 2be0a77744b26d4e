"""Layer dispatch on per-layer weights: every layer unrolled into the step's one program (unrolled), or a
few layers per program, each program run once per group of that many layers (per_layer).

Why: under the layer scan each layer's weights are dynamic slices of the stacked [L, ...] weights, and XLA
copies every slice that feeds a cuBLAS matmul: on a model with large layers those copies take a large part
of a decode step. Here each layer's weights are their own arrays, so nothing is sliced. per_layer keeps
compile time that of a few layers: one program of config.LAYERS_PER_DISPATCH layers, unrolled, runs once
per group with its first layer's index as an argument (the kernels index the pool's layer themselves);
where the group size does not divide L, the last, smaller group is a second program. The price is a few
launches per step instead of one. unrolled makes the whole step one program (one CUDA graph), at the cost
of a longer compile.

Same inputs and outputs as step.packed_step; a test checks both give the same tokens. resample is the
head and sampler alone, on the hidden states of a step's sampled rows (step.StepPrograms says when).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxpaged.models.decoder import RuntimeOptions, embed_phase, head_options, head_phase, layer_phase
from jaxpaged.runner.multi_step import decode_steps
from jaxpaged.runner.program_spec import ProgramSpec
from jaxpaged.runner.sampler import SamplerFlags, prompt_head, sample_and_keep
from jaxpaged.runner.step_inputs import fill_input_tokens, unpack


@functools.partial(jax.jit, static_argnames=("layout", "cfg", "dtype"))
def _pre(params, prev_sampled, ints, floats, *, layout, cfg, dtype):
    model_input, sampling = unpack(ints, floats, layout)
    h, cos, sin = embed_phase(cfg, dtype, params, fill_input_tokens(model_input, prev_sampled), model_input.meta)
    return h, cos, sin, model_input, sampling


def _layers(group_params, h, kv_cache, first_idx, meta, cos, sin, *, cfg, dtype, options: RuntimeOptions,
            kinds: tuple[int, ...] | None = None):
    """The layers first_idx, first_idx + 1, ... on their own weights (a tuple of per-layer trees), unrolled.
    kinds: each layer's kind (config.layer_kinds) where the layers differ, so each compiles its own window
    (no switch on the device)."""
    for j, lp in enumerate(group_params):
        h, kv_cache = layer_phase(cfg, dtype, options, lp, h, kv_cache, first_idx + j, meta, cos, sin,
                                  None if kinds is None else kinds[j])
    return h, kv_cache


_layers_jit = jax.jit(_layers, static_argnames=("cfg", "dtype", "options", "kinds"),
                      donate_argnames=("h", "kv_cache"))


def group_layers(layer_params: list, layer_ids: list, group: int,
                 layer_kinds: tuple[int, ...] = ()) -> list[tuple]:
    """[(a group's per-layer trees as a tuple, its first layer's device index, its layers' kinds or None)],
    `group` layers each (the last may be smaller); built once, so a step only walks the list. layer_kinds:
    the model's (config.layer_kinds; () when its layers are alike). Groups of one size and kinds run one
    program."""
    if group < 1:        # range(0, L, -1) would run no layer at all
        raise ValueError(f"layers per dispatch must be at least 1, got {group}")
    return [(tuple(layer_params[first:first + group]), layer_ids[first],
             tuple(layer_kinds[first:first + group]) or None)
            for first in range(0, len(layer_params), group)]


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "flags", "head_opts"), donate_argnames=("prev_sampled",))
def _post(params, h, prev_sampled, model_input, sampling, *, cfg, dtype, flags: SamplerFlags,
          head_opts: RuntimeOptions | None = None):
    """-> (sampled_buf, result, the sampled rows' hidden states [R, H], what resample takes). head_opts:
    decoder.head_options' (None for a dense head)."""
    logits, prompt = head_phase(cfg, dtype, params, h, model_input.logits_indices,
                                model_input.prompt_target_ids, prompt_head(flags), head_opts)
    return (*sample_and_keep(logits, prompt, sampling, flags, prev_sampled), h[model_input.logits_indices])


@functools.partial(jax.jit, static_argnames=("layout", "cfg", "dtype", "flags", "head_opts"),
                   donate_argnames=("prev_sampled",))
def resample(head_params, rows, prev_sampled, ints, floats, *, layout, cfg, dtype, flags: SamplerFlags,
             head_opts: RuntimeOptions | None = None):
    """The head and a sampler variant on the hidden states of a step's sampled rows [R, H] (before the final
    norm), for inputs packed as the step packs them -> (sampled_buf, result), as the step's own head gives them.
    What a batch whose sampler variant has no compiled step runs after the default variant's step
    (step.StepPrograms): a small program, so a new sampling parameter never compiles the model again. Not for
    prompt logprobs, which need every token's hidden states."""
    assert flags.num_prompt_logprobs < 0, "prompt logprobs read every token's hidden states"
    _, sampling = unpack(ints, floats, layout)
    logits, _ = head_phase(cfg, dtype, head_params, rows, jnp.arange(rows.shape[0]), options=head_opts)
    return sample_and_keep(logits, (), sampling, flags, prev_sampled)


@functools.partial(jax.jit, static_argnames=("layout", "cfg", "dtype", "options", "flags"),
                   donate_argnames=("kv_cache", "prev_sampled"))
def whole_step(params, layer_params, kv_cache, prev_sampled, ints, floats, *, layout, cfg, dtype,
               options: RuntimeOptions, flags: SamplerFlags):
    """The whole step as one program, every layer unrolled on its own weights (all layers in one group) ->
    (kv_cache, sampled_buf, results, the sampled rows' hidden states or None for several decode steps)."""
    if options.num_steps > 1:      # multi-step decoding (model_runner.decode_steps)
        model_input, sampling = unpack(ints, floats, layout)

        def forward(tokens, kv, meta):
            h, cos, sin = embed_phase(cfg, dtype, params, tokens, meta)
            h, kv = _layers(layer_params, h, kv, 0, meta, cos, sin, cfg=cfg, dtype=dtype, options=options,
                            kinds=cfg.layer_kinds() or None)
            return head_phase(cfg, dtype, params, h, model_input.logits_indices,
                              options=head_options(cfg, options))[0], kv
        return (*decode_steps(forward, kv_cache, prev_sampled, model_input, sampling, options.num_steps, flags),
                None)
    h, cos, sin, model_input, sampling = _pre.__wrapped__(params, prev_sampled, ints, floats, layout=layout,
                                                          cfg=cfg, dtype=dtype)
    h, kv_cache = _layers(layer_params, h, kv_cache, 0, model_input.meta, cos, sin, cfg=cfg, dtype=dtype,
                          options=options, kinds=cfg.layer_kinds() or None)
    sampled_buf, result, rows = _post.__wrapped__(params, h, prev_sampled, model_input, sampling, cfg=cfg,
                                                  dtype=dtype, head_opts=head_options(cfg, options), flags=flags)
    return kv_cache, sampled_buf, result, rows


@dataclasses.dataclass(frozen=True)
class GroupedStep:
    """One engine step as the programs per_layer dispatch runs in turn: the embedding, one per layer group
    (groups of one size run one program), the head. Called, it runs the step on jitted functions with
    their static arguments bound (jitted) or on the executables compiled or loaded at start-up
    (runner/step.py). The same shape carries each program's cache key (program_keys) and its ProgramSpec
    (program_specs)."""
    pre: Any           # (params, prev_sampled, ints, floats) -> (h, cos, sin, model_input, sampling)
    layers: tuple      # per group: (group_params, h, kv_cache, first_idx, meta, cos, sin) -> (h, kv_cache)
    post: Any          # (params, h, prev_sampled, model_input, sampling) -> (sampled_buf, result, rows)

    def __call__(self, params, layer_groups, kv_cache, prev_sampled, ints, floats):
        """The step -> (kv_cache, sampled_buf, results, the sampled rows' hidden states), as step.packed_step."""
        h, cos, sin, model_input, sampling = self.pre(params, prev_sampled, ints, floats)
        meta = model_input.meta
        for (group_params, first_idx, _), layers in zip(layer_groups, self.layers):
            h, kv_cache = layers(group_params, h, kv_cache, first_idx, meta, cos, sin)
        sampled_buf, result, rows = self.post(params, h, prev_sampled, model_input, sampling)
        return kv_cache, sampled_buf, result, rows

    def flat(self) -> list:
        """The programs in the order they run (a group's once per group)."""
        return [self.pre, *self.layers, self.post]

    @classmethod
    def of(cls, programs: list) -> GroupedStep:
        """flat's inverse."""
        return cls(programs[0], tuple(programs[1:-1]), programs[-1])


def program_keys(layer_groups, *, layout, options: RuntimeOptions, flags: SamplerFlags) -> GroupedStep:
    """What tells each program of a step apart (the executable cache's keys): which program it is, the
    step's input layout, and the static arguments it takes. A group's key names its size, not its place:
    groups of one size run one program, and so do the embeddings (heads) of buckets with one layout."""
    return GroupedStep(("pre", layout), tuple(("layers", len(g), kinds, layout, options)
                                              for g, _, kinds in layer_groups),
                       ("post", layout, flags))


def jitted(layer_groups, *, layout, cfg, dtype, options: RuntimeOptions, flags: SamplerFlags) -> GroupedStep:
    """The step's programs as jitted functions."""
    layers = tuple(functools.partial(_layers_jit, cfg=cfg, dtype=dtype, options=options, kinds=kinds)
                   for _, _, kinds in layer_groups)
    return GroupedStep(functools.partial(_pre, layout=layout, cfg=cfg, dtype=dtype), layers,
                       functools.partial(_post, cfg=cfg, dtype=dtype, flags=flags,
                                         head_opts=head_options(cfg, options)))


def program_specs(params, layer_groups, kv_cache, prev_sampled, ints, floats, *, layout, cfg, dtype,
                  options: RuntimeOptions, flags: SamplerFlags) -> GroupedStep:
    """Each of the step's programs as a ProgramSpec (the jitted function and what it is called with), for
    these arguments. The embedding is traced now: its output shapes stand for the activations it hands to
    the layers and the head, so each program lowers on its own."""
    pre = _pre.trace(params, prev_sampled, ints, floats, layout=layout, cfg=cfg, dtype=dtype)
    h, cos, sin, model_input, sampling = pre.out_info
    layers_kw = dict(cfg=cfg, dtype=dtype, options=options)
    return GroupedStep(
        ProgramSpec(_pre, (params, prev_sampled, ints, floats), dict(layout=layout, cfg=cfg, dtype=dtype), ()),
        tuple(ProgramSpec(_layers_jit, (group_params, h, kv_cache, first_idx, model_input.meta, cos, sin),
                          dict(layers_kw, kinds=kinds), (1, 2)) for group_params, first_idx, kinds in layer_groups),
        ProgramSpec(_post, (params, h, prev_sampled, model_input, sampling),
                    dict(cfg=cfg, dtype=dtype, flags=flags, head_opts=head_options(cfg, options)), (2,)))


def step(params, layer_groups, kv_cache, prev_sampled, ints, floats, *, layout, cfg, dtype,
         options: RuntimeOptions, flags: SamplerFlags):
    """One engine step through jit -> (kv_cache, sampled_buf, results, the sampled rows' hidden states), as
    step.packed_step.

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
    programs = jitted(layer_groups, layout=layout, cfg=cfg, dtype=dtype, options=options, flags=flags)
    return programs(params, layer_groups, kv_cache, prev_sampled, ints, floats)
