"""The one jitted step (model + sampler, the KV pool donated) and its compiled programs: how a step runs
under the resolved layer dispatch, and how its buckets are compiled, loaded from the executable cache and
warmed up at start-up."""
from __future__ import annotations

import concurrent.futures
import functools
import logging
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.config import RunConfig
from jaxpaged.models import AttentionMetadata, DecoderModel, RuntimeOptions
from jaxpaged.runner import layerwise
from jaxpaged.runner.buckets import Bucket
from jaxpaged.runner.exec_cache import ExecutableCache, fingerprint
from jaxpaged.runner.inputs import ModelInput
from jaxpaged.runner.multi_step import decode_steps
from jaxpaged.runner.sampler import SamplerFlags, SamplingInputs, prompt_head, sample_and_keep
from jaxpaged.runner.step_inputs import HostInputs, fill_input_tokens, flatten, pack, unpack

logger = logging.getLogger("jaxpaged.runner")

# Start-up threads with the executable cache on: they deserialize the cached steps and XLA-compile the
# missing ones while the main thread traces and lowers the next.
STARTUP_THREADS = 8


class StepPrograms:
    """The step's weights as the layer dispatch wants them, and its compiled programs by input layout,
    runtime options and sampler flags."""

    def __init__(self, params, cfg, dtype, run: RunConfig, kv_cache_shape: tuple, max_blocks_per_req: int,
                 max_rows: int, exec_cache_root: str | None):
        self.cfg, self.dtype, self.run = cfg, dtype, run
        self.layer_groups: list[tuple] | None
        if run.layer_dispatch in ("per_layer", "unrolled"):
            # Each layer's weights as their own arrays (layerwise.py), before the KV pool is allocated:
            # params["layers"] is deleted on the way. Unrolled: all layers in one group, one program.
            self.params, layer_params = layerwise.split_params(params)
            layer_ids = [jnp.asarray(i, jnp.int32) for i in range(len(layer_params))]
            self.layer_groups = layerwise.group_layers(layer_params, layer_ids,
                                                       run.layers_per_dispatch or len(layer_params))
        else:
            self.params, self.layer_groups = params, None
        self.host_inputs = HostInputs()
        self.max_blocks_per_req = max_blocks_per_req
        self._compiled: dict = {}       # (layout, options, flags) -> executable, filled at warm-up
        self.exec_cache: ExecutableCache | None = None
        if exec_cache_root is not None and run.executable_cache:
            shapes = jax.tree.map(lambda x: (x.shape, str(x.dtype)), (self.params, self.layer_groups))
            self.exec_cache = ExecutableCache(pathlib.Path(exec_cache_root), fingerprint(
                cfg, str(jnp.dtype(dtype)), run.attention_backend, (run.layer_dispatch, "pinned inputs"),
                kv_cache_shape, max_blocks_per_req, max_rows, shapes))

    def options(self, bucket: Bucket, num_steps: int) -> RuntimeOptions:
        """The static choices of a bucket's program. Its layers run inside a while loop under the layer
        scan, and under any dispatch when the program loops over several decode steps."""
        return RuntimeOptions(self.run.attention_backend, bucket.decode_only, num_steps=num_steps,
                              in_loop=self.layer_groups is None or num_steps > 1)

    def __call__(self, kv_cache, prev_sampled, model_input: ModelInput, sampling: SamplingInputs, *,
                 options: RuntimeOptions, flags: SamplerFlags):
        """Run one step: its inputs go into a pinned host slot (one copy), which the step reads itself."""
        int_pieces, float_pieces, layout = flatten((model_input, sampling), self.run.input_align)
        slot = self.host_inputs.write(int_pieces, float_pieces)
        out = self.run_packed(kv_cache, prev_sampled, *slot.arrays, layout=layout, options=options, flags=flags)
        slot.fence = out[2]       # the slot is free again once this step's results are
        return out

    def run_packed(self, kv_cache, prev_sampled, ints, floats, *, layout, options: RuntimeOptions,
                   flags: SamplerFlags):
        """The step on already packed inputs (step_inputs.pack): a compiled program when warm-up made
        one, else through jit."""
        compiled = self._compiled.get((layout, options, flags))
        if self.layer_groups is None:
            if compiled is not None:
                return compiled(self.params, kv_cache, prev_sampled, ints, floats)
            return packed_step(self.params, kv_cache, prev_sampled, ints, floats, layout=layout, cfg=self.cfg,
                               dtype=self.dtype, options=options, flags=flags)
        if compiled is not None:         # unrolled, from the executable cache or the start-up threads
            return compiled(self.params, self.layer_groups[0][0], kv_cache, prev_sampled, ints, floats)
        return layerwise.step(self.params, self.layer_groups, kv_cache, prev_sampled, ints, floats, layout=layout,
                              cfg=self.cfg, dtype=self.dtype, options=options, flags=flags)

    # ---- warm-up ------------------------------------------------------------------------------
    def warmup(self, state, variants: list[tuple[Bucket, int]], progress: bool = True) -> None:
        """Compile and run the step once per (bucket, decode steps) with the default sampler. `state` holds
        the pool and the sampled-token buffer (the runner), replaced by each run's outputs.

        With the executable cache, cached programs are deserialized on several threads at once; the others
        are traced and lowered here (Python, one at a time) and compiled by XLA on the threads, while this
        one lowers the next."""
        from tqdm.auto import tqdm
        flags = SamplerFlags()
        pool, compiling = None, {}          # compiling: key -> the future of its XLA compile
        if self.exec_cache is not None and len(variants) > 1:
            keys = [self._cache_key(*self.dummy_inputs(b), self.options(b, steps), flags) for b, steps in variants]
            self.exec_cache.load_many(keys, STARTUP_THREADS)
            missing = [(v, k) for v, k in zip(variants, keys) if not self.exec_cache.prefetched(k)]
            if missing:
                pool = concurrent.futures.ThreadPoolExecutor(STARTUP_THREADS, thread_name_prefix="jaxpaged-compile")
                for (bucket, steps), key in tqdm(missing, desc="Lowering buckets", disable=not progress):
                    lowered = self._lower(state, *self.dummy_inputs(bucket), self.options(bucket, steps), flags)
                    compiling[key] = pool.submit(lowered.compile)
        try:
            for bucket, steps in tqdm(variants, desc="Compiling buckets", disable=not progress):
                self._warm_one(state, bucket, steps, flags, compiling)
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def _warm_one(self, state, bucket: Bucket, steps: int, flags: SamplerFlags, compiling: dict) -> None:
        mi, si = self.dummy_inputs(bucket)
        options = self.options(bucket, steps)
        cache = self.exec_cache
        loaded = self._load_or_compile(cache, state, mi, si, options, flags, compiling) if cache else None
        try:
            state.kv_cache, state.prev_sampled, res = self(state.kv_cache, state.prev_sampled, mi, si,
                                                           options=options, flags=flags)
            jax.block_until_ready(res)
        except jax.errors.JaxRuntimeError as e:
            if loaded is None or cache is None:
                raise
            # A loaded executable that does not run (XLA:CPU cannot run some deserialized bf16 programs):
            # forget it and trace as usual. The pool holds nothing yet, so it is simply remade.
            logger.warning("A cached executable failed to run (%s); compiling it instead", e)
            cache.discard(loaded)
            del self._compiled[loaded]
            state.reset_buffers()
            state.kv_cache, state.prev_sampled, res = self(state.kv_cache, state.prev_sampled, mi, si,
                                                           options=options, flags=flags)
            jax.block_until_ready(res)

    def _cache_key(self, mi, si, options: RuntimeOptions, flags: SamplerFlags) -> tuple:
        """What a step's executable is stored under: its inputs' layout, runtime options and sampler flags."""
        return (flatten((mi, si), self.run.input_align)[2], options, flags)

    def _load_or_compile(self, cache: ExecutableCache, state, mi, si, options: RuntimeOptions, flags: SamplerFlags,
                         compiling: dict) -> tuple | None:
        """The bucket's executable from the on-disk cache, else from `compiling` (the start-up threads),
        else traced and compiled here; stored on disk. Returns its key when it came from disk (it has not
        run yet), else None."""
        key = self._cache_key(mi, si, options, flags)
        compiled = cache.load(key)
        from_disk = compiled is not None
        if not from_disk:
            future = compiling.pop(key, None)
            compiled = future.result() if future is not None else self._lower(state, mi, si, options, flags).compile()
            cache.store(key, compiled)
        self._compiled[key] = compiled
        return key if from_disk else None

    def _lower(self, state, mi, si, options: RuntimeOptions, flags: SamplerFlags):
        """The step traced and lowered for these inputs as the steps are called: packed, in pinned host memory."""
        host_ints, host_floats, layout = pack((mi, si), self.run.input_align)
        ints, floats = self.host_inputs.write(host_ints, host_floats).arrays
        kw = dict(layout=layout, cfg=self.cfg, dtype=self.dtype, options=options, flags=flags)
        if self.layer_groups is None:
            traced = packed_step.trace(self.params, state.kv_cache, state.prev_sampled, ints, floats, **kw)
        else:
            traced = layerwise.whole_step.trace(self.params, self.layer_groups[0][0], state.kv_cache,
                                                state.prev_sampled, ints, floats, **kw)
        return traced.lower()

    def dummy_inputs(self, bucket: Bucket) -> tuple[ModelInput, SamplingInputs]:
        """A bucket's inputs with no real request: every token is padding, writes go to the null block."""
        T, R = bucket.padded_num_tokens, bucket.padded_num_reqs
        z = lambda *s: np.zeros(s, np.int32)
        meta = AttentionMetadata(z(T), z(T), z(R, self.max_blocks_per_req), z(R), z(R + 1))
        f = lambda v: np.full(R, v, np.float32)
        e = np.full((R, 0), -1, np.int32)
        si = SamplingInputs(f(0), z(R), f(1), f(0), np.zeros(R, np.uint32), z(R), f(0), f(0), f(1), e, e, e,
                            np.zeros((R, 0), np.float32))
        return ModelInput(z(T), meta, z(R), np.full(R, T, np.int32), z(R), z(0)), si


@functools.partial(jax.jit, static_argnames=("layout", "cfg", "dtype", "options", "flags"),
                   donate_argnames=("kv_cache", "prev_sampled"))
def packed_step(params, kv_cache, prev_sampled, ints, floats, *, layout, cfg, dtype, options: RuntimeOptions,
                flags: SamplerFlags):
    """The one jitted step under the layer scan: model forward over the flat batch, then sampling; the pool
    and the sampled-token buffer are donated (updated in place: their addresses stay those the step's CUDA
    graphs hold).

    A module-level function whose static arguments are plain hashable values (no runner instance), so
    JAX's caches never keep a runner, and with it a KV pool of many GiB, alive.
    """
    model_input, sampling = unpack(ints, floats, layout)
    model = DecoderModel(cfg, dtype, options)
    if options.num_steps > 1:
        return decode_steps(lambda tokens, kv, meta: model.apply({"params": params}, tokens, kv, meta,
                                                                 model_input.logits_indices)[:2],
                            kv_cache, prev_sampled, model_input, sampling, options.num_steps, flags)
    logits, kv_cache, prompt = model.apply({"params": params}, fill_input_tokens(model_input, prev_sampled),
                                           kv_cache, model_input.meta, model_input.logits_indices,
                                           model_input.prompt_target_ids, prompt_head(flags))
    return (kv_cache, *sample_and_keep(logits, prompt, sampling, flags, prev_sampled))
