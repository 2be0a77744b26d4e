"""The one jitted step (model + sampler, the KV pool donated) and its compiled programs: how a step runs
under the resolved layer dispatch, and how its buckets are compiled, loaded from the executable cache and
warmed up at start-up."""
from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import pathlib
import queue
import sys
import threading
import time
import types
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged import envs
from jaxpaged.config import RunConfig
from jaxpaged.models import AttentionMetadata, DecoderModel, RuntimeOptions
from jaxpaged.models.decoder import head_options
from jaxpaged.runner import layerwise
from jaxpaged.runner.buckets import Bucket
from jaxpaged.runner.exec_cache import ExecutableCache, fingerprint
from jaxpaged.runner.inputs import MIN_LOGPROBS_WIDTH, ModelInput
from jaxpaged.runner.multi_step import decode_steps
from jaxpaged.runner.lowering_workers import HeadWork, LoweringJob, LoweringWorkers, Result, StepWork
from jaxpaged.runner.program_spec import ProgramSpec, abstract
from jaxpaged.runner.sampler import SamplerFlags, SamplingInputs, prompt_head, sample_and_keep
from jaxpaged.runner.step_inputs import HostInputs, fill_input_tokens, flatten, pack, padded_len, unpack

logger = logging.getLogger("jaxpaged.runner")

# Start-up threads with the executable cache on: they deserialize the cached programs and XLA-compile the
# missing ones while the main thread traces and lowers the next (envs.JAXPAGED_STARTUP_THREADS).
STARTUP_THREADS = envs.JAXPAGED_STARTUP_THREADS
# At most this many of them compile in the background while the engine serves, beside its loop and the API
# processes on the same cores (the number the cold-server benchmarks ran with).
BACKGROUND_THREADS = 8

# XLA's GPU compile without its GEMM autotuning, which times candidate kernels on the device. The head-and-sampler
# programs (layerwise.resample) compile so: they compile while the engine serves (in the background after the
# warm-up, or in the loop for a variant's first request) and run only until that variant's own step is there, and
# a cold server's first requests ran slow while the warm-up's 84 of them were timed on the GPU that runs the steps
# (bench/results/NOTES.md). The step programs compile so where RunConfig.step_autotune is off (large layers).
NO_AUTOTUNE_GPU_COMPILER_OPTIONS = {"xla_gpu_autotune_level": "0"}

# The nice value of what compiles while the engine serves (the background thread, its compile threads and the
# lowering workers it starts): their CPU time yields to the engine loop's, whose step dispatch is host-bound for
# per-layer programs, and to the API processes'. Linux keeps a nice value per thread.
BACKGROUND_NICE = 10

# XLA's GPU compile runs ptxas as a child process of the engine. On a busy host (the start-up's compile threads
# and lowering workers, or the background's) its launch can fail once ("INTERNAL: Failed to launch ptxas";
# bench/results/NOTES.md) and then succeed: such a compile is tried this many times in all, a second apart.
# Other compile errors are the program's and stand at once.
COMPILE_ATTEMPTS = 3
COMPILE_RETRY_S = 1.0


def _child_launch_failed(error: Exception) -> bool:
    return isinstance(error, jax.errors.JaxRuntimeError) and "Failed to launch" in str(error)


def _without_jax_cache_write():
    """For this thread: JAX's persistent compilation cache writes nothing (its other programs still go there).
    With the executable cache on a GPU (_variant_cache), every program StepPrograms compiles is stored there
    (runner/exec_cache.py); JAX's own write would serialize and compress the same executable again, holding the
    GIL from the engine loop while it serves (bench/results/NOTES.md). JAX's setting is a thread-local context."""
    from jax._src import config as jax_config
    state = getattr(jax_config, "persistent_cache_min_compile_time_secs", None)
    return state(float("inf")) if state is not None else contextlib.nullcontext()


def _lower_thread_priority(nice: int = BACKGROUND_NICE) -> None:
    """Raise the calling thread's nice value by `nice` (on Linux, where it is per thread and the threads and
    processes it starts inherit it; elsewhere it would be the whole engine's, so nothing)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.nice(nice)

DEFAULT_FLAGS = SamplerFlags()      # the sampler variant the warm-up compiles
# Sampler variants whose head and sampler (layerwise.resample) are compiled for every bucket by the warm-up (or
# after it, in the background), with RunConfig.warm_sampler_variants: top-k/p/min-p, which OpenAI clients send, and
# logprobs (the sampled token's alone, and up to inputs.MIN_LOGPROBS_WIDTH top ones).
WARM_SAMPLER_VARIANTS = (SamplerFlags(top_k_p=True), SamplerFlags(num_logprobs=0),
                         SamplerFlags(num_logprobs=MIN_LOGPROBS_WIDTH))


def _plain_sampling(sampling: SamplingInputs) -> SamplingInputs:
    """A step's sampling inputs without what only a sampler variant reads (penalty histories, logit bias): with
    its model inputs, the layout of the default variant's step for the same bucket."""
    rows = sampling.temperature.shape[0]
    no_ints, no_floats = np.zeros((rows, 0), np.int32), np.zeros((rows, 0), np.float32)
    return dataclasses.replace(sampling, output_ids=no_ints, prompt_ids=no_ints, bias_ids=no_ints,
                               bias_values=no_floats)


def abstract_like(x: jax.Array) -> jax.ShapeDtypeStruct:
    """An array's shape, dtype and placement, for lowering a program it will be passed to."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def _temporary_bytes(compiled) -> int:
    """A compiled program's temporaries in bytes (XLA's memory analysis), 0 where the backend gives none."""
    try:
        return int(compiled.memory_analysis().temp_size_in_bytes or 0)
    except Exception:       # (a backend, or a stand-in, without the analysis)
        return 0


def _bucket_label(bucket: Bucket, steps: int) -> str:
    """A bucket's step in words, for the start-up log and its errors."""
    return (f"{bucket.padded_num_tokens} tokens, {bucket.padded_num_reqs} rows, "
            f"{steps} step{'s' if steps > 1 else ''}")


class _BackgroundCompiler:
    """One daemon thread that runs queued compiles in turn; a compile that fails is logged, and the step
    keeps the path it had. At the interpreter's exit the queue is dropped and a compile under way is waited
    for (a thread killed inside XLA's compiler aborts the process)."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="jaxpaged-variant-compile", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def submit(self, fn) -> None:
        if not self._closed:
            self._queue.put(fn)

    def join(self) -> None:
        """Until every compile queued so far is done."""
        self._queue.join()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
                self._queue.task_done()
        self._queue.put(None)
        self._thread.join()

    def _work(self) -> None:
        _lower_thread_priority()
        while (fn := self._queue.get()) is not None:
            try:
                fn()
            except Exception:  # noqa: BLE001 - the step goes on without the variant's own program
                logger.exception("Compiling a sampler variant's step failed; it keeps running on the default step")
            finally:
                del fn            # the engine it compiled for is not kept alive by this thread
                self._queue.task_done()
        self._queue.task_done()


class StepPrograms:
    """The step's weights as the layer dispatch wants them, and its compiled programs by input layout,
    runtime options and sampler flags."""

    def __init__(self, params, cfg, dtype, run: RunConfig, kv_cache_shape: tuple, max_blocks_per_req: int,
                 max_rows: int, exec_cache_root: str | None):
        self.cfg, self.dtype, self.run = cfg, dtype, run
        self.layer_groups: list[tuple] | None
        if run.layer_dispatch in ("per_layer", "unrolled"):
            # Each layer's weights are their own arrays (load_model(per_layer=True)): layerwise.py.
            # Unrolled: all layers in one group, one program.
            layer_params = params["layers"]
            if not isinstance(layer_params, list):
                raise ValueError(f"{run.layer_dispatch} dispatch runs on per-layer weights: "
                                 "load the model with load_model(..., per_layer=True)")
            self.params = {k: v for k, v in params.items() if k != "layers"}
            layer_ids = [jnp.asarray(i, jnp.int32) for i in range(len(layer_params))]
            self.layer_groups = layerwise.group_layers(layer_params, layer_ids,
                                                       run.layers_per_dispatch or len(layer_params),
                                                       cfg.layer_kinds())
        else:
            self.params, self.layer_groups = params, None
        self.host_inputs = HostInputs()
        self.kv_cache_shape, self.max_blocks_per_req, self.max_rows = kv_cache_shape, max_blocks_per_req, max_rows
        self._compiled: dict = {}       # (layout, options, flags) -> the step's compiled programs, at warm-up
        self.head_params = {k: v for k, v in self.params.items() if k != "layers"}   # what resample reads
        self._resamplers: dict = {}     # _resampler's key -> compiled layerwise.resample
        self._head_lowered: dict = {}   # _resampler's key -> lowered by the start-up's workers, compiled later
        self._later: set = set()        # sampler variants queued for the background thread (_compile_later)
        self._background: _BackgroundCompiler | None = None
        self.compile_seconds: dict[str, list[float]] = {}   # program kind -> seconds of each XLA compile
        # program key -> its compiled temporaries (XLA's memory analysis): they must fit beside the weights and the
        # pool, and the start-up log names the largest (largest_temporaries)
        self.temp_bytes: dict[tuple, int] = {}
        self._bucket_of: dict[tuple, str] = {}   # program key -> the warm-up bucket it was compiled for
        self.exec_cache: ExecutableCache | None = None
        if exec_cache_root is not None and run.executable_cache:
            groups = None if self.layer_groups is None else [g[:2] for g in self.layer_groups]   # the arrays
            shapes = jax.tree.map(lambda x: (x.shape, str(x.dtype)), (self.params, groups))
            self.exec_cache = ExecutableCache(pathlib.Path(exec_cache_root), fingerprint(
                cfg, str(jnp.dtype(dtype)), run.attention_backend, (run.layer_dispatch, "pinned inputs"),
                self.step_compiler_options,
                kv_cache_shape, max_blocks_per_req, max_rows, shapes))

    def options(self, bucket: Bucket, num_steps: int) -> RuntimeOptions:
        """The static choices of a bucket's program. Its layers run inside a while loop under the layer
        scan, and under any dispatch when the program loops over several decode steps."""
        return RuntimeOptions(self.run.attention_backend, bucket.decode_only, num_steps=num_steps,
                              in_loop=self.layer_groups is None or num_steps > 1,
                              interpret=self.run.interpret, num_sms=self.run.num_sms)

    def __call__(self, kv_cache, prev_sampled, model_input: ModelInput, sampling: SamplingInputs, *,
                 options: RuntimeOptions, flags: SamplerFlags, bucket: Bucket | None = None):
        """Run one step -> (kv_cache, sampled-token buffer, results): its inputs go into a pinned host slot
        (one copy), which the step reads itself.

        A sampler variant (top-k/p, penalties, logit bias, logprobs: SamplerFlags) with no compiled step
        of its own runs the default variant's step, which the warm-up compiled, then the head and that
        variant's sampler on the sampled rows' hidden states (layerwise.resample, a small program), so a new
        sampling parameter never stalls every request in flight while the whole model compiles again; the
        variant's own step compiles on a background thread meanwhile and takes over once it is ready (it
        saves the second head). Not prompt logprobs (they read every token's hidden states, which the step
        does not hand out): those compile their own step on first use. Nor where the warm-up compiles nothing
        (compile_buckets off: the CPU's default), which compiles every program on first use anyway. bucket:
        the inputs' (a lowering worker can then lower the variant's step, as it lowers a cold start-up's)."""
        flat = flatten((model_input, sampling), self.run.input_align)
        if flags != DEFAULT_FLAGS and self.run.compile_buckets and flags.num_prompt_logprobs < 0:
            int_pieces, float_pieces, layout = flat
            if (layout, options, flags) not in self._compiled:
                self._compile_later(layout, options, flags, kv_cache, prev_sampled, int_pieces, float_pieces, bucket)
                if options.num_steps > 1:
                    return self._steps_one_by_one(kv_cache, prev_sampled, model_input, sampling, options, flags)
                return self._resampled(kv_cache, prev_sampled, model_input, sampling, options, flags, flat)
        return self._run(kv_cache, prev_sampled, model_input, sampling, options, flags, flat)[:3]

    def _run(self, kv_cache, prev_sampled, model_input: ModelInput, sampling: SamplingInputs,
             options: RuntimeOptions, flags: SamplerFlags, flat: tuple | None = None):
        """The step's own programs -> (kv_cache, sampled-token buffer, results, the sampled rows' hidden states
        or None). flat: the inputs as step_inputs.flatten gives them, where the caller has them already."""
        int_pieces, float_pieces, layout = flat or flatten((model_input, sampling), self.run.input_align)
        slot = self.host_inputs.write(int_pieces, float_pieces)
        out = self.run_packed(kv_cache, prev_sampled, *slot.arrays, layout=layout, options=options, flags=flags)
        slot.fence = out[2]       # the slot is free again once this step's results are
        return out

    def _resampled(self, kv_cache, prev_sampled, model_input: ModelInput, sampling: SamplingInputs,
                   options: RuntimeOptions, flags: SamplerFlags, flat: tuple | None = None):
        """One step of a sampler variant without its own compiled step: the default variant's step on the
        inputs without the variant's extras (so they have the layout it was compiled for), then
        layerwise.resample on the full inputs, which overwrites the sampled-token buffer. flat: the full
        inputs flattened, where the caller has them already (as _run's)."""
        kv_cache, prev_sampled, _, h = self._run(kv_cache, prev_sampled, model_input, _plain_sampling(sampling),
                                                 options, DEFAULT_FLAGS)
        int_pieces, float_pieces, layout = flat or flatten((model_input, sampling), self.run.input_align)
        slot = self.host_inputs.write(int_pieces, float_pieces)
        resampler = self._resampler(layout, flags, head_options(self.cfg, options), h, prev_sampled, *slot.arrays)
        prev_sampled, result = resampler(self.head_params, h, prev_sampled, *slot.arrays)
        slot.fence = result
        return kv_cache, prev_sampled, result

    def _resampler(self, layout: tuple, flags: SamplerFlags, head_opts, h, prev_sampled, ints, floats):
        """The compiled layerwise.resample for these inputs (arrays, or their shapes): the warm-up's, else
        the executable cache's, else compiled now, in the engine loop, and said so in the log."""
        key = ("resample", layout, flags, head_opts, h.shape, str(h.dtype))
        compiled = self._resamplers.get(key)
        if compiled is None:
            t0 = time.perf_counter()
            compiled = self._resamplers[key] = self._compile_resampler(key, h, prev_sampled, ints, floats)
            logger.info("Compiled the head and sampler of variant %s for %d tokens in the engine loop in %.2f s",
                        flags, h.shape[0], time.perf_counter() - t0)
        return compiled

    @property
    def _variant_cache(self) -> ExecutableCache | None:
        """The executable cache for the programs compiled after the warm-up (sampler variants'), which run
        without the warm-up's check that a loaded program runs: not on the CPU, where some deserialized
        programs fail when they run ("Function ... not found"; its cache is on only in tests)."""
        return self.exec_cache if self.run.platform != "cpu" else None

    def _compile_resampler(self, key: tuple, h, prev_sampled, ints, floats):
        cache = self._variant_cache
        compiled = cache.load(key) if cache is not None else None
        if compiled is None:
            compiled = self._compile_transient(key, self._resample_spec(key, h, prev_sampled, ints, floats).lower())
        return compiled

    def _compile_transient(self, key: tuple, lowered):
        """XLA-compile a head-and-sampler program (NO_AUTOTUNE_GPU_COMPILER_OPTIONS) into the variant cache."""
        compiled = self._compile(key, lowered, self._no_autotune_options)
        if self._variant_cache is not None:
            self._variant_cache.store(key, compiled)
        return compiled

    def _resample_spec(self, key: tuple, h, prev_sampled, ints, floats) -> ProgramSpec:
        _, layout, flags, head_opts, *_ = key
        return ProgramSpec(layerwise.resample, (self.head_params, h, prev_sampled, ints, floats),
                           dict(layout=layout, cfg=self.cfg, dtype=self.dtype, flags=flags, head_opts=head_opts), (2,))

    def resample_spec(self, bucket: Bucket, options: RuntimeOptions, flags: SamplerFlags, h,
                      prev_sampled=None) -> tuple[tuple, ProgramSpec]:
        """-> (its key, the ProgramSpec) of the head-and-sampler program of a sampler variant for a single-step
        bucket's dummy inputs (packed as the step packs them) and its sampled rows' hidden states `h` (a
        shape); prev_sampled: the sampled-token buffer's shape (default: this engine's, unplaced)."""
        host_ints, host_floats, layout = pack(self.dummy_inputs(bucket, flags), self.run.input_align)
        ints, floats = (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.host_inputs.sharding)
                        for x in (host_ints, host_floats))
        if prev_sampled is None:
            prev_sampled = jax.ShapeDtypeStruct((self.max_rows,), jnp.int32)
        key = ("resample", layout, flags, head_options(self.cfg, options), h.shape, str(h.dtype))
        return key, self._resample_spec(key, h, prev_sampled, ints, floats)

    def _steps_one_by_one(self, kv_cache, prev_sampled, model_input: ModelInput, sampling: SamplingInputs,
                          options: RuntimeOptions, flags: SamplerFlags):
        """A multi-step batch (multi_step.decode_steps) of a sampler variant without its own compiled
        program: its decode steps one at a time (_resampled), each one's inputs advanced on the host as
        decode_steps advances them on the device; the results stacked as a multi-step program's."""
        single = dataclasses.replace(options, num_steps=1, in_loop=self.layer_groups is None)
        meta = model_input.meta
        live = (meta.seq_lens > 0).astype(np.int32)
        rows = np.arange(len(live))
        block_size = self.kv_cache_shape[4]
        results = []
        for k in range(options.num_steps):
            step_input, step_sampling = model_input, sampling
            if k:
                positions = meta.positions + k * live
                blocks = meta.block_tables[rows, positions // block_size]
                slots = np.where(live > 0, blocks * block_size + positions % block_size, 0).astype(np.int32)
                step_input = dataclasses.replace(
                    model_input, meta=AttentionMetadata(positions, slots, meta.block_tables, meta.seq_lens + k * live,
                                                        meta.query_start_loc),
                    # every live request's token is the one the last step sampled into its row
                    fill_token_idx=np.where(live > 0, rows, len(model_input.token_ids)).astype(np.int32),
                    fill_src_row=rows.astype(np.int32))
                step_sampling = dataclasses.replace(sampling, positions=sampling.positions + k)
            kv_cache, prev_sampled, result = self._resampled(kv_cache, prev_sampled, step_input, step_sampling,
                                                             single, flags)
            results.append(result[:5])
        # each field as the steps' arrays, stacked on the host (ModelRunner.fetch): no program to compile here
        return kv_cache, prev_sampled, (*zip(*results), None)

    def _compile_later(self, layout: tuple, options: RuntimeOptions, flags: SamplerFlags, kv_cache, prev_sampled,
                       int_pieces, float_pieces, bucket: Bucket | None) -> None:
        """Compile this sampler variant's own step on the background thread (once per variant), from the
        executable cache where it is there. Where the
        start-up has lowering workers and the variant's inputs have their bucket's plain layout (top-k/p,
        logprobs), a worker process lowers it: tracing and lowering the model here would hold the GIL, and with
        it the engine loop, for a second or more (qwen2-0.5b unrolled on the H200: the running streams' longest
        gap 1.2 s while it did)."""
        key = (layout, options, flags)
        if key in self._later:
            return
        self._later.add(key)
        sizes = (padded_len(sum(map(len, int_pieces))), padded_len(sum(map(len, float_pieces))))
        state = types.SimpleNamespace(kv_cache=abstract_like(kv_cache), prev_sampled=abstract_like(prev_sampled))
        if bucket is not None and (not self.run.lowering_processes
                                   or layout != self._layout(*self.dummy_inputs(bucket))):
            bucket = None         # lowered here
        self._background_compiler().submit(functools.partial(self._compile_variant, key, state, sizes, bucket))

    def _compile_variant(self, key: tuple, state, sizes: tuple[int, int], bucket: Bucket | None) -> None:
        """The variant's programs from the executable cache, else lowered by a worker for `bucket` (None: here)
        and compiled here; then the step made of them takes over (run_packed)."""
        layout, options, flags = key
        t0 = time.perf_counter()
        ints, floats = (jax.ShapeDtypeStruct((n,), dt, sharding=self.host_inputs.sharding)
                        for n, dt in zip(sizes, (jnp.int32, jnp.float32)))
        specs = self._specs(state, layout, ints, floats, options, flags)
        keys = self._program_keys(layout, options, flags)
        order = list(dict.fromkeys(keys))
        cache = self._variant_cache
        executables = {k: cache.load(k) if cache is not None else None for k in order}
        missing = [i for i, k in enumerate(order) if executables[k] is None]
        lowered = {}
        if missing and bucket is not None:
            work = StepWork(bucket, options.num_steps, tuple(missing), flags)
            for _, result in self._in_workers([work], 1, BACKGROUND_NICE):
                lowered[order[result.position]] = self._lowered(specs[order[result.position]], result)
        for i in missing:
            k = order[i]
            executables[k] = compiled = self._compile(k, lowered.pop(k, None) or specs[k].lower())
            if cache is not None:
                cache.store(k, compiled)
        self._compiled[key] = self._assemble([executables[k] for k in keys])
        logger.info("Compiled the step of sampler variant %s (%d decode steps) in the background in %.1f s%s",
                    flags, options.num_steps, time.perf_counter() - t0,
                    " (lowered by a worker process)" if missing and bucket is not None else "")

    def wait_for_background_compiles(self) -> None:
        """Block until every compile queued on the background thread is done (tests, benchmarks)."""
        if self._background is not None:
            self._background.join()

    def run_packed(self, kv_cache, prev_sampled, ints, floats, *, layout, options: RuntimeOptions,
                   flags: SamplerFlags):
        """The step on already packed inputs (step_inputs.pack) -> (kv_cache, sampled-token buffer, results,
        the sampled rows' hidden states or None): the programs warm-up made for it, else through jit."""
        compiled = self._compiled.get((layout, options, flags))
        if compiled is not None:
            return compiled(kv_cache, prev_sampled, ints, floats)
        if self.layer_groups is None:
            return packed_step(self.params, kv_cache, prev_sampled, ints, floats, layout=layout, cfg=self.cfg,
                               dtype=self.dtype, options=options, flags=flags)
        return layerwise.step(self.params, self.layer_groups, kv_cache, prev_sampled, ints, floats, layout=layout,
                              cfg=self.cfg, dtype=self.dtype, options=options, flags=flags)

    @property
    def _grouped(self) -> bool:
        """Whether a step is several programs (per_layer dispatch over more than one layer group)."""
        return self.layer_groups is not None and len(self.layer_groups) > 1

    # ---- warm-up ------------------------------------------------------------------------------
    def warmup(self, state, variants: list[tuple[Bucket, int]], progress: bool = True) -> None:
        """Compile and run the step once per (bucket, decode steps) with the default sampler. `state` holds
        the pool and the sampled-token buffer (the runner), replaced by each run's outputs.

        With the executable cache, cached programs are deserialized on several threads at once; the others
        are traced and lowered here (Python, one at a time) and compiled by XLA on the threads, while this
        one lowers the next. A program that several buckets run (per_layer: an embedding or head of one
        input layout, a layer group of one size) is compiled once."""
        from tqdm.auto import tqdm
        flags = SamplerFlags()
        cache, pool = self.exec_cache, None
        programs: dict = {}       # program key -> its executable, as the buckets' steps get them
        compiling: dict = {}      # program key -> the future of its XLA compile on the start-up threads
        if cache is not None and len(variants) > 1:
            keys = [self._program_keys(self._layout(*self.dummy_inputs(b)), self.options(b, steps), flags)
                    for b, steps in variants]
            cache.load_many(list(dict.fromkeys(k for ks in keys for k in ks)), STARTUP_THREADS)
            # [(variant, its programs' keys in order without repeats, the keys it is the first to miss)]
            missing, seen = [], set()
            for variant, ks in zip(variants, keys):
                order = list(dict.fromkeys(ks))
                new = [k for k in order if not cache.prefetched(k) and k not in seen]
                seen.update(new)
                if new:
                    missing.append((variant, order, new))
            if missing:
                pool = concurrent.futures.ThreadPoolExecutor(STARTUP_THREADS, thread_name_prefix="jaxpaged-compile")
                if self.run.lowering_processes and len(missing) > 1:
                    head_jobs = {}
                    if self.run.warm_sampler_variants:     # the heads' exports too, lowered here before serving
                        head_jobs = self._head_jobs(state, [(b, self.options(b, n), self._sampled_hidden(b, state))
                                                            for b, n in variants if n == 1])
                    self._lower_in_workers(state, missing, flags, pool, compiling, progress, head_jobs)
                else:
                    for (bucket, steps), _, new in tqdm(missing, desc="Lowering buckets", disable=not progress):
                        specs = self.program_specs(state, bucket, self.options(bucket, steps), flags)
                        for key in new:
                            compiling[key] = pool.submit(self._compile, key, specs[key].lower())
        heads = []                # (bucket, options, its sampled rows' hidden states' shape) of each single-step bucket
        try:
            for bucket, steps in tqdm(variants, desc="Compiling buckets", disable=not progress):
                h = self._warm_one(state, bucket, steps, flags, programs, compiling)
                if h is not None:
                    heads.append((bucket, self.options(bucket, steps), h))
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
            if largest := self.largest_temporaries():      # (also when a step ran out of memory)
                logger.info("Largest temporaries of the compiled step programs: %s", ", ".join(
                    f"{temp / 2**30:.2f} GiB ({bucket})" for bucket, temp in largest))
        if self.run.warm_sampler_variants:
            self._warm_resamplers(state, heads, progress)
        if self.compile_seconds:
            logger.info("XLA compile seconds by program (count), summed over threads: %s", ", ".join(
                f"{kind} {sum(t):.1f} ({len(t)})" for kind, t in sorted(self.compile_seconds.items())))

    def _warm_resamplers(self, state, heads: list, progress: bool = False) -> None:
        """The head and sampler of each of WARM_SAMPLER_VARIANTS for every single-step bucket, compiled (or loaded
        from the executable cache) on STARTUP_THREADS threads: here, before the engine is ready, or with
        RunConfig.variants_in_background (large layers) on the background thread while it serves, so a cold
        start-up is ready without them (about 15 s sooner for llama3-8b on the H200, 84 programs), and a
        variant's request that comes first compiles its own in the loop."""
        jobs = self._head_jobs(state, heads)
        if self.run.variants_in_background:
            self._background_compiler().submit(functools.partial(self._compile_resamplers, jobs))
        else:
            self._compile_resamplers(jobs, progress, background=False)

    def _head_jobs(self, state, heads: list) -> dict:
        """[(bucket, options, its sampled rows' hidden states' shape)] -> {the head-and-sampler program's key of
        each WARM_SAMPLER_VARIANTS variant: (its ProgramSpec, what a lowering worker is sent to export it)}."""
        prev = abstract_like(state.prev_sampled)
        jobs: dict = {}
        for bucket, options, h in heads:
            for flags in WARM_SAMPLER_VARIANTS:
                key, spec = self.resample_spec(bucket, options, flags, h, prev)
                jobs.setdefault(key, (spec, HeadWork(bucket, options.num_steps, flags, (h.shape, str(h.dtype)))))
        return jobs

    def _sampled_hidden(self, bucket: Bucket, state) -> jax.ShapeDtypeStruct:
        """What a single-step bucket's step hands out as its sampled rows' hidden states (before the final
        norm), on the device the steps run on: the shape the warm-up's run then gives (_warm_one)."""
        return jax.ShapeDtypeStruct((bucket.padded_num_reqs, self.cfg.hidden_size), self.dtype,
                                    sharding=state.prev_sampled.sharding)

    def _compile_resamplers(self, jobs: dict, progress: bool = False, background: bool = True) -> None:
        """The warm-up's head-and-sampler programs: from the variant cache, else lowered at start-up
        (_lower_in_workers), else lowered by lowering workers where the engine has them (traced here while the
        engine serves, they would hold the GIL from its loop, whose per-layer dispatch is Python:
        bench/results/NOTES.md), and compiled on STARTUP_THREADS threads (BACKGROUND_THREADS at most in the
        background). background: on the background thread while the engine serves (its workers at
        BACKGROUND_NICE), else at start-up (progress: a bar)."""
        from tqdm.auto import tqdm
        t0 = time.perf_counter()
        cache = self._variant_cache
        missing, prelowered = [], {}
        for key in jobs:
            if key not in self._resamplers:
                compiled = cache.load(key) if cache is not None else None
                if compiled is not None:
                    self._resamplers.setdefault(key, compiled)
                elif key in self._head_lowered:
                    prelowered[key] = self._head_lowered[key]
                else:
                    missing.append(key)
        self._head_lowered.clear()
        n = min(self.run.lowering_processes, len(missing))
        here = 0.0                # seconds of this thread lowering the workers' exports (it holds the GIL)
        threads = min(STARTUP_THREADS, BACKGROUND_THREADS) if background else STARTUP_THREADS
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="jaxpaged-compile") as pool:
            futures = {key: pool.submit(self._compile_transient, key, lowered) for key, lowered in prelowered.items()}
            if n:
                for index, result in self._in_workers([jobs[k][1] for k in missing], n,
                                                      BACKGROUND_NICE if background else 0):
                    key = missing[index]
                    t1 = time.perf_counter()
                    lowered = self._lowered(jobs[key][0], result)
                    here += time.perf_counter() - t1
                    futures[key] = pool.submit(self._compile_transient, key, lowered)
            else:
                futures.update({key: pool.submit(lambda k: self._compile_transient(k, jobs[k][0].lower()), key)
                                for key in missing})
            failed = []
            for key, future in tqdm(futures.items(), desc="Compiling sampler variants", total=len(futures),
                                    disable=not progress or not futures):
                try:
                    self._resamplers.setdefault(key, future.result())
                except Exception:  # noqa: BLE001 - that variant's bucket compiles its head when first used
                    logger.exception("Compiling the head and sampler of %s failed", key[2])
                    failed.append(key)
        logger.info("Compiled the head and sampler of the common sampler variants (%d programs%s) %s in %.1f s "
                    "(%d lowered at start-up%s)", len(futures) - len(failed),
                    f", {len(failed)} failed" if failed else "",
                    "in the background" if background else "before serving", time.perf_counter() - t0, len(prelowered),
                    f"; {len(missing)} by {n} worker processes, their exports' lowering here {here:.1f} s" if n else "")

    @property
    def _no_autotune_options(self) -> dict | None:
        """NO_AUTOTUNE_GPU_COMPILER_OPTIONS on GPUs; None (XLA's defaults) elsewhere."""
        return NO_AUTOTUNE_GPU_COMPILER_OPTIONS if self.run.platform == "gpu" else None

    @property
    def step_compiler_options(self) -> dict | None:
        """XLA's compiler options for the step programs: without autotuning where the run says so."""
        return None if self.run.step_autotune else self._no_autotune_options

    def _background_compiler(self) -> _BackgroundCompiler:
        if self._background is None:
            self._background = _BackgroundCompiler()
        return self._background

    def _compile(self, key: tuple, lowered, compiler_options: dict | None = None):
        """XLA-compile one program, its seconds kept by program kind (key[0]: step, pre, layers, post) for
        the start-up log: what a cold start-up spends where. compiler_options: XLA's (default: the step
        programs', step_compiler_options). A failed child-process launch is tried again (COMPILE_ATTEMPTS);
        with the executable cache on a GPU, JAX's persistent cache does not keep a second copy."""
        if compiler_options is None:
            compiler_options = self.step_compiler_options
        t0 = time.perf_counter()
        for attempt in range(1, COMPILE_ATTEMPTS + 1):
            try:
                with _without_jax_cache_write() if self._variant_cache is not None else contextlib.nullcontext():
                    compiled = lowered.compile(compiler_options)
                break
            except Exception as e:
                if attempt == COMPILE_ATTEMPTS or not _child_launch_failed(e):
                    raise
                logger.warning("Compiling a %s program: %s; trying again (%d of %d)", key[0],
                               str(e).splitlines()[0], attempt + 1, COMPILE_ATTEMPTS)
                time.sleep(COMPILE_RETRY_S)
        self.compile_seconds.setdefault(key[0], []).append(time.perf_counter() - t0)
        if temp := _temporary_bytes(compiled):
            self.temp_bytes[key] = temp
        return compiled

    def largest_temporaries(self, count: int = 3) -> list[tuple[str, int]]:
        """(the program's bucket, bytes) of the count compiled programs with the most temporary bytes."""
        top = sorted(self.temp_bytes.items(), key=lambda kv: -kv[1])[:count]
        return [(self._bucket_of.get(key, str(key[0])), temp) for key, temp in top]

    def _lower_in_workers(self, state, missing: list, flags: SamplerFlags, pool, compiling: dict,
                          progress: bool, heads: dict) -> None:
        """The missing programs lowered by worker processes (runner/lowering_workers.py), a share of the
        buckets each: every export that comes back is lowered here as a call of the exported program (no
        model tracing) and compiled on the start-up threads; a program a worker could not export is
        lowered here as usual. heads (_head_jobs'): head-and-sampler programs the workers export after their
        steps, lowered here as they come and compiled in the background once the engine serves
        (_compile_resamplers): lowered while the engine serves, they would hold the GIL from its loop."""
        from tqdm.auto import tqdm
        n = min(self.run.lowering_processes, len(missing))
        positions = [tuple(order.index(k) for k in new) for _, order, new in missing]
        head_keys = list(heads)   # after the steps: each worker exports its heads once its steps are sent
        work = ([StepWork(bucket, steps, positions[i], flags) for i, ((bucket, steps), _, _) in enumerate(missing)]
                + [heads[k][1] for k in head_keys])
        specs: dict = {}          # index into missing -> this process's ProgramSpecs of that bucket's step
        left = [len(p) for p in positions]
        bar = tqdm(total=len(missing), desc=f"Lowering buckets ({n} processes)", disable=not progress)
        try:
            for i, result in self._in_workers(work, n):
                if i >= len(missing):
                    key = head_keys[i - len(missing)]
                    self._head_lowered[key] = self._lowered(heads[key][0], result)
                    continue
                (bucket, steps), order, _ = missing[i]
                if i not in specs:
                    specs[i] = self.program_specs(state, bucket, self.options(bucket, steps), flags)
                key = order[result.position]
                compiling[key] = pool.submit(self._compile, key, self._lowered(specs[i][key], result))
                left[i] -= 1
                bar.update(left[i] == 0)
        finally:
            bar.close()

    def _in_workers(self, work: list, processes: int, nice: int = 0) -> Iterator[tuple[int, Result]]:
        """Export `work` (StepWork, HeadWork) on `processes` lowering workers, dealt round-robin (each worker
        keeps the list's order), at `nice` -> (index into work, Result) for each program as it comes."""
        shares = [range(first, len(work), processes) for first in range(processes)]
        workers = LoweringWorkers([self._lowering_job([work[i] for i in share], nice) for share in shares])
        try:
            for job, result in workers.results():
                yield shares[job][result.item], result
        finally:
            workers.close()

    def _lowering_job(self, work: list, nice: int) -> LoweringJob:
        """A lowering worker's job: this step's configuration and shapes, its work (StepWork, HeadWork), and the
        nice value it runs at (BACKGROUND_NICE while the engine serves)."""
        layers = None if self.layer_groups is None else [lp for group, *_ in self.layer_groups for lp in group]
        params = abstract(self.params if layers is None else dict(self.params, layers=layers))
        return LoweringJob(self.cfg, jnp.dtype(self.dtype).name, self.run, self.kv_cache_shape,
                           self.max_blocks_per_req, self.max_rows, params, jax.devices()[0].device_kind, work, nice)

    @staticmethod
    def _lowered(spec: ProgramSpec, result: Result):
        """A worker's export of `spec` lowered here, else `spec` lowered here from the start."""
        if result.blob is not None:
            try:
                return spec.lower_exported(result.blob, result.out_tree)
            except Exception as e:  # noqa: BLE001 - the program still compiles, lowered here
                result = result._replace(error=f"{type(e).__name__}: {e}")
        logger.warning("A lowering worker's program was unusable (%s); lowering it here", result.error)
        return spec.lower()

    def _warm_one(self, state, bucket: Bucket, steps: int, flags: SamplerFlags, programs: dict,
                  compiling: dict) -> jax.ShapeDtypeStruct | None:
        """Compile (or load) and run one bucket's step -> its sampled rows' hidden states' shape (None: several
        decode steps)."""
        mi, si = self.dummy_inputs(bucket)
        options = self.options(bucket, steps)
        keys = self._program_keys(self._layout(mi, si), options, flags)
        for key in keys:        # (for the start-up log)
            self._bucket_of.setdefault(key, _bucket_label(bucket, steps))
        cache = self.exec_cache
        loaded = self._load_or_compile(cache, state, bucket, options, flags, programs, compiling) if cache else []
        try:
            state.kv_cache, state.prev_sampled, res, h = self._run(state.kv_cache, state.prev_sampled, mi, si,
                                                                   options, flags)
            jax.block_until_ready(res)
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" in str(e):
                temp = max((self.temp_bytes.get(k, 0) for k in keys), default=0)
                raise RuntimeError(
                    f"The step of {_bucket_label(bucket, steps)} ran out of device memory at start-up"
                    + (f": its temporaries take {temp / 2**30:.2f} GiB" if temp else "")
                    + " beside the weights and the KV pool. Lower --gpu-memory-utilization (the pool's share) or "
                    f"--max-num-batched-tokens. ({str(e).splitlines()[0]})") from e
            if not loaded or cache is None:
                raise
            # A loaded executable that does not run (XLA:CPU cannot run some deserialized bf16 programs):
            # forget those of this step that came from disk and trace the step as usual; a later bucket
            # that runs one of them compiles it. The pool holds nothing yet, so it is simply remade.
            logger.warning("A cached executable failed to run (%s); compiling it instead", e)
            for key in loaded:
                cache.discard(key)
                del programs[key]
            del self._compiled[self._layout(mi, si), options, flags]
            state.reset_buffers()
            state.kv_cache, state.prev_sampled, res, h = self._run(state.kv_cache, state.prev_sampled, mi, si,
                                                                   options, flags)
            jax.block_until_ready(res)
        return None if h is None else abstract_like(h)

    def _layout(self, mi, si) -> tuple:
        """The step inputs' layout (step_inputs.flatten): with the options and flags, what picks its programs."""
        return flatten((mi, si), self.run.input_align)[2]

    def _program_keys(self, layout: tuple, options: RuntimeOptions, flags: SamplerFlags) -> list[tuple]:
        """What each program of a step is stored under, in the order the step runs them: which program it
        is, its inputs' layout, runtime options and sampler flags (those it takes)."""
        if self._grouped:
            return layerwise.program_keys(self.layer_groups, layout=layout, options=options, flags=flags).flat()
        return [("step", layout, options, flags)]

    def _load_or_compile(self, cache: ExecutableCache, state, bucket: Bucket, options: RuntimeOptions,
                         flags: SamplerFlags, programs: dict, compiling: dict) -> list[tuple]:
        """The step's programs: each one an earlier bucket got, else from the on-disk cache, else from
        `compiling` (the start-up threads), else traced and compiled here, and stored on disk; the step
        made of them is what run_packed calls. Returns the keys of those that came from disk (they have
        not run yet)."""
        layout = self._layout(*self.dummy_inputs(bucket))
        keys = self._program_keys(layout, options, flags)
        from_disk, specs = [], None
        for key in dict.fromkeys(keys):
            if key in programs:
                continue
            compiled = cache.load(key)
            if compiled is not None:
                from_disk.append(key)
                if temp := _temporary_bytes(compiled):
                    self.temp_bytes[key] = temp
            else:
                future = compiling.pop(key, None)
                if future is not None:
                    compiled = future.result()
                else:
                    specs = specs or self.program_specs(state, bucket, options, flags)
                    compiled = self._compile(key, specs[key].lower())
                cache.store(key, compiled)
            programs[key] = compiled
        self._compiled[layout, options, flags] = self._assemble([programs[k] for k in keys])
        return from_disk

    def _assemble(self, executables: list):
        """The step as run_packed calls it, (kv_cache, prev_sampled, ints, floats) -> outputs, from its
        programs' executables (in _program_keys' order)."""
        if self._grouped:
            return functools.partial(layerwise.GroupedStep.of(executables), self.params, self.layer_groups)
        if self.layer_groups is None:
            return functools.partial(executables[0], self.params)
        return functools.partial(executables[0], self.params, self.layer_groups[0][0])

    def program_specs(self, state, bucket: Bucket, options: RuntimeOptions, flags: SamplerFlags) -> dict:
        """Program key -> the ProgramSpec of that program of the bucket's step, for inputs as the steps are
        given them: packed, in pinned host memory. `state` holds the pool and the sampled-token buffer (the
        runner; a lowering worker passes their shapes)."""
        host_ints, host_floats, layout = pack(self.dummy_inputs(bucket, flags), self.run.input_align)
        ints, floats = self.host_inputs.write(host_ints, host_floats).arrays
        return self._specs(state, layout, ints, floats, options, flags)

    def _specs(self, state, layout: tuple, ints, floats, options: RuntimeOptions, flags: SamplerFlags) -> dict:
        """program_specs for packed inputs of this layout (arrays, or their shapes)."""
        kw = dict(layout=layout, cfg=self.cfg, dtype=self.dtype, options=options, flags=flags)
        keys = self._program_keys(layout, options, flags)
        if self._grouped:
            return dict(zip(keys, layerwise.program_specs(self.params, self.layer_groups, state.kv_cache,
                                                          state.prev_sampled, ints, floats, **kw).flat()))
        if self.layer_groups is None:
            spec = ProgramSpec(packed_step, (self.params, state.kv_cache, state.prev_sampled, ints, floats), kw,
                               (1, 2))
        else:
            spec = ProgramSpec(layerwise.whole_step, (self.params, self.layer_groups[0][0], state.kv_cache,
                                                      state.prev_sampled, ints, floats), kw, (2, 3))
        return {keys[0]: spec}

    def dummy_inputs(self, bucket: Bucket, flags: SamplerFlags = DEFAULT_FLAGS) -> tuple[ModelInput, SamplingInputs]:
        """A bucket's inputs with no real request: every token is padding, writes go to the null block; a
        prompt target for every token where `flags` asks for prompt logprobs."""
        T, R = bucket.padded_num_tokens, bucket.padded_num_reqs
        z = lambda *s: np.zeros(s, np.int32)
        meta = AttentionMetadata(z(T), z(T), z(R, self.max_blocks_per_req), z(R), z(R + 1))
        f = lambda v: np.full(R, v, np.float32)
        e = np.full((R, 0), -1, np.int32)
        si = SamplingInputs(f(0), z(R), f(1), f(0), np.zeros(R, np.uint32), z(R), f(0), f(0), f(1), e, e, e,
                            np.zeros((R, 0), np.float32))
        targets = z(T) if flags.num_prompt_logprobs >= 0 else z(0)
        return ModelInput(z(T), meta, z(R), np.full(R, T, np.int32), z(R), targets), si


@functools.partial(jax.jit, static_argnames=("layout", "cfg", "dtype", "options", "flags"),
                   donate_argnames=("kv_cache", "prev_sampled"))
def packed_step(params, kv_cache, prev_sampled, ints, floats, *, layout, cfg, dtype, options: RuntimeOptions,
                flags: SamplerFlags):
    """The one jitted step under the layer scan: model forward over the flat batch, then sampling -> (kv_cache,
    sampled-token buffer, results, the sampled rows' hidden states before the final norm, or None for several
    decode steps). The pool and the sampled-token buffer are donated (updated in place: their addresses stay those
    the step's CUDA graphs hold).

    A module-level function whose static arguments are plain hashable values (no runner instance), so
    JAX's caches never keep a runner, and with it a KV pool of many GiB, alive.
    """
    model_input, sampling = unpack(ints, floats, layout)
    model = DecoderModel(cfg, dtype, options)
    if options.num_steps > 1:
        return (*decode_steps(lambda tokens, kv, meta: model.apply({"params": params}, tokens, kv, meta,
                                                                   model_input.logits_indices)[:2],
                              kv_cache, prev_sampled, model_input, sampling, options.num_steps, flags), None)
    logits, kv_cache, prompt, h = model.apply({"params": params}, fill_input_tokens(model_input, prev_sampled),
                                              kv_cache, model_input.meta, model_input.logits_indices,
                                              model_input.prompt_target_ids, prompt_head(flags))
    return (kv_cache, *sample_and_keep(logits, prompt, sampling, flags, prev_sampled), h)
