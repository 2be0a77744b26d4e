"""Turns a SchedulerOutput into padded device arrays, runs the one jitted step (model + sampler, the
KV pool donated), and fetches the sampled ids with one device_get."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import operator
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged import envs
from jaxpaged.config import LAYER_DISPATCHES
from jaxpaged.engine.scheduler import SchedulerOutput
from jaxpaged.models import AttentionMetadata, DecoderModel, LoadedModel, RuntimeOptions, kv_cache_shape
from jaxpaged.runner.buckets import Bucket, BucketPolicy
from jaxpaged.runner import layerwise
from jaxpaged.runner.exec_cache import ExecutableCache, fingerprint
from jaxpaged.runner.multi_step import decode_steps
from jaxpaged.runner.step_inputs import MOSAIC_ALIGN, HostInputs, fill_input_tokens, flatten, pack, unpack
from jaxpaged.runner.sampler import SamplerFlags, SamplingInputs, prompt_logprobs, sample

logger = logging.getLogger("jaxpaged.runner")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelInput:
    token_ids: jax.Array          # i32[T]
    meta: AttentionMetadata       # positions, slot_mapping, block_tables, seq_lens, query_start_loc
    logits_indices: jax.Array     # i32[R]  last scheduled token of each request
    # Async scheduling: tokens sampled by the previous step are not on the host yet. Token
    # fill_token_idx[i] of this batch takes prev_sampled[fill_src_row[i]] (index T: nothing to fill).
    fill_token_idx: jax.Array     # i32[R]
    fill_src_row: jax.Array       # i32[R]
    # prompt_logprobs only (else shape [0]): the next prompt token after each token of the batch, -1: none
    prompt_target_ids: jax.Array  # i32[T] or i32[0]


class InFlight(NamedTuple):
    """A dispatched step whose results have not been fetched."""
    sched: SchedulerOutput
    result: tuple                 # device arrays from sample()
    rows: dict[str, int]          # request id -> row of its sample in this step
    prompt_rows: dict[str, tuple[int, int, int]]  # request id -> (first token, count, first prompt index)
    prepare_s: float              # host time building the padded inputs
    launch_s: float               # host time packing them and dispatching the step


class PreparedInputs(NamedTuple):
    model_input: ModelInput
    bucket: Bucket
    prompt_rows: dict[str, tuple[int, int, int]]  # prompt_logprobs: request id -> (first token, count, index)


class RunnerOutput(NamedTuple):
    """Host-side results of one step, rows in SchedulerOutput.scheduled order."""
    sampled_ids: np.ndarray       # i32[R]
    logprobs: np.ndarray          # f32[R]   logprob of the sampled token (zeros when not asked)
    ranks: np.ndarray             # i32[R]
    top_ids: np.ndarray           # i32[R, X]
    top_logprobs: np.ndarray      # f32[R, X]
    prompt: tuple | None = None   # (logprob f32[T], rank i32[T], top ids i32[T, P], top logprobs f32[T, P])


# Columns of the per-request static sampler rows: Request.sampling_row, then the seed.
SAMPLING_COLUMNS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "logprobs", "prompt_logprobs", "needs_bias", "seed")
_PROMPT_LOGPROBS = SAMPLING_COLUMNS.index("prompt_logprobs")
# per-request reads in C loops: np.fromiter(map(_NUM_TOKENS, reqs)) beats a generator expression
_REQUEST_ID = operator.attrgetter("request_id")
_NUM_COMPUTED = operator.attrgetter("num_computed_tokens")
_NUM_TOKENS = operator.attrgetter("num_tokens")
_NUM_OUTPUT = operator.attrgetter("num_output_tokens")
_NUM_PLACEHOLDERS = operator.attrgetter("num_output_placeholders")
_PADDING_ROW = (0.0, 0, 1.0, 0.0, 0.0, 0.0, 1.0, -1, -1, 0, 0)      # greedy, nothing extra


def _logprobs_width(most: float) -> int:
    """Static top-k width for the largest request: -1 none asked, 0 only the chosen token's, else a power of 2."""
    return -1 if most < 0 else (_pow2(int(most), 1) if most > 0 else 0)


def _pow2(n: int, lo: int = 1) -> int:
    b = lo
    while b < n:
        b *= 2
    return b


class ModelRunner:
    def __init__(self, model: LoadedModel, num_blocks: int, block_size: int, max_model_len: int,
                 buckets: BucketPolicy, attn_backend: str, num_cpu_blocks: int = 0,
                 layer_dispatch: str = "scan", exec_cache_root: str | None = None):
        self.cfg = model.config
        self.dtype = model.dtype
        if layer_dispatch not in LAYER_DISPATCHES:
            raise ValueError(f"layer dispatch must be one of {', '.join(LAYER_DISPATCHES)}, got {layer_dispatch!r}")
        if layer_dispatch in ("per_layer", "unrolled"):
            # Each layer's weights as their own arrays (runner/layerwise.py), before the KV pool is
            # allocated; model.params["layers"] is deleted on the way. Unrolled: all layers in one group,
            # which layerwise.step runs as one program with embedding, head and sampler.
            self.params, self.layer_params = layerwise.split_params(model.params)
            self.layer_ids = [jnp.asarray(i, jnp.int32) for i in range(len(self.layer_params))]
            self.layer_group = (len(self.layer_params) if layer_dispatch == "unrolled"
                                else envs.JAXPAGED_LAYER_GROUP or layerwise.LAYERS_PER_DISPATCH)
        else:
            self.params, self.layer_params, self.layer_ids = model.params, None, None
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.buckets = buckets
        self.attn_backend = attn_backend
        # The pool and the sampled-token buffer are made committed to the device, as the step's outputs that
        # replace them are: else the first bucket compiled at warm-up (uncommitted arguments) would not be
        # the program later steps look up, and would compile again.
        self._device = jax.devices()[0]
        self.kv_cache = jnp.zeros(kv_cache_shape(self.cfg, num_blocks, block_size), self.dtype, device=self._device)
        # Host memory for swapped-out blocks: [L, 2, num_cpu_blocks, K, S, D].
        self.cpu_cache = (np.zeros(kv_cache_shape(self.cfg, num_cpu_blocks, block_size),
                                   jnp.dtype(self.dtype)) if num_cpu_blocks else None)
        self.compiled_keys: set = set()
        self.max_rows = buckets.max_rows
        self.prev_sampled = jnp.zeros((self.max_rows,), jnp.int32, device=self._device)   # donated to each step
        self.host_inputs = HostInputs() if envs.JAXPAGED_PINNED_INPUTS else None
        # Packed inputs on the 256-byte grid where XLA hands the Mosaic GPU calls slices of them (unrolled
        # layers); elsewhere back to back (step_inputs.MOSAIC_ALIGN says why).
        self.input_align = envs.JAXPAGED_INPUT_ALIGN or (MOSAIC_ALIGN if layer_dispatch == "unrolled" else 1)
        self.prev_rows: dict[str, int] = {}      # rows of the last dispatched step's samples
        # Each request's static sampler row (SAMPLING_COLUMNS), written once into a persistent table
        # and gathered by slot every step. Slots are keyed by the Request object (a reused request id
        # never sees a stale row) and come back when the scheduler reports the request finished.
        self._sampling_slots: dict = {}                 # Request -> its row of _sampling_table
        self._sampling_owner: dict = {}                 # request id -> Request holding a slot
        self._sampling_table = np.zeros((64, len(SAMPLING_COLUMNS)), np.float64)
        self._free_sampling_slots: list[int] = list(range(63, -1, -1))
        self._batch_cache: tuple = (None, None, None)   # (SchedulerOutput, request ids, static sampler rows)
        # Compiled steps by (layout, options, flags), filled at warm-up; read from disk when a start-up
        # with the same fingerprint made them before (exec_cache.py). Single-program steps only (the
        # layer scan, unrolled layers): per-layer dispatch runs several programs a step.
        self._compiled: dict = {}
        self.exec_cache = None
        if exec_cache_root is not None and self._single_program:
            shapes = jax.tree.map(lambda x: (x.shape, str(x.dtype)), (self.params, self.layer_params))
            self.exec_cache = ExecutableCache(exec_cache_root, fingerprint(
                self.cfg, str(jnp.dtype(self.dtype)), attn_backend,
                (layer_dispatch, "pinned inputs" if self.host_inputs is not None else "host arrays"),
                self.kv_cache.shape,
                self.max_blocks_per_req, self.max_rows, shapes))

    @property
    def _single_program(self) -> bool:
        """Whether a step is one compiled program (the scan, or every layer in one group)."""
        return self.layer_params is None or len(self._layer_groups) == 1

    @property
    def layer_group(self) -> int:
        """Layers per dispatch (per-layer dispatch only); setting it regroups the layers once."""
        return self._layer_group

    @layer_group.setter
    def layer_group(self, group: int) -> None:
        self._layer_groups = layerwise.group_layers(self.layer_params, self.layer_ids, group)
        self._layer_group = group
        if getattr(self, "_compiled", None):      # executables of the previous grouping no longer apply
            self._compiled.clear()

    # ---- the jitted step ----------------------------------------------------------------------
    def _step(self, params, kv_cache, prev_sampled, model_input: ModelInput, sampling: SamplingInputs, *,
              options: RuntimeOptions, flags: SamplerFlags):
        slot = None
        if self.host_inputs is not None:     # the pieces go straight into a pinned slot: one copy
            int_pieces, float_pieces, layout = flatten((model_input, sampling), self.input_align)
            slot = self.host_inputs.write(int_pieces, float_pieces)
            ints, floats = slot.arrays
        else:
            ints, floats, layout = pack((model_input, sampling), self.input_align)
        out = self.run_packed(params, kv_cache, prev_sampled, ints, floats, layout=layout, options=options,
                              flags=flags)
        if slot is not None:
            slot.fence = out[2]       # the slot is free again once this step's results are
        return out

    def run_packed(self, params, kv_cache, prev_sampled, ints, floats, *, layout, options: RuntimeOptions,
                   flags: SamplerFlags):
        """The step on already packed inputs (host or device arrays, see step_inputs.pack)."""
        compiled = self._compiled.get((layout, options, flags)) if self._compiled else None
        if self.layer_params is not None:
            if compiled is not None:         # unrolled, loaded from the executable cache
                return compiled(params, self._layer_groups[0][0], kv_cache, prev_sampled, ints, floats)
            return layerwise.step(params, self._layer_groups, kv_cache, prev_sampled, ints, floats, layout=layout,
                                  cfg=self.cfg, dtype=self.dtype, options=options, flags=flags)
        if compiled is not None:
            return compiled(params, kv_cache, prev_sampled, ints, floats)
        return _packed_step(params, kv_cache, prev_sampled, ints, floats, layout=layout, cfg=self.cfg,
                            dtype=self.dtype, options=options, flags=flags)

    # ---- inputs -------------------------------------------------------------------------------
    def _batch(self, out: SchedulerOutput) -> tuple[list[str], np.ndarray]:
        """The batch's request ids and static sampler rows f64[n, len(SAMPLING_COLUMNS)], once per step."""
        if self._batch_cache[0] is not out:
            for rid in out.finished_ids:
                self._release_sampling_slot(rid)
            reqs = out.scheduled
            slots = self._sampling_slots
            rows = list(map(slots.get, reqs, itertools.repeat(-1, len(reqs))))
            if -1 in rows:
                rows = [s if s >= 0 else self._new_sampling_slot(r) for s, r in zip(rows, reqs)]
            self._batch_cache = (out, list(map(_REQUEST_ID, reqs)), self._sampling_table[rows])
        return self._batch_cache[1], self._batch_cache[2]

    def release_finished(self, request_ids) -> None:
        """Drop what the runner holds for finished requests now (the engine calls this when it goes idle;
        otherwise the next step's finished_ids do it), including the last batch it remembers."""
        for rid in request_ids:
            self._release_sampling_slot(rid)
        self._batch_cache = (None, [], None)

    def _release_sampling_slot(self, request_id: str) -> None:
        req = self._sampling_owner.get(request_id)
        if req is not None and req.is_finished:
            del self._sampling_owner[request_id]
            self._free_sampling_slots.append(self._sampling_slots.pop(req))

    def _new_sampling_slot(self, req) -> int:
        if not self._free_sampling_slots:
            # finished requests whose ids never reached the runner (an empty step) give theirs back first
            for r in [r for r in self._sampling_slots if r.is_finished]:
                self._free_sampling_slots.append(self._sampling_slots.pop(r))
                if self._sampling_owner.get(r.request_id) is r:
                    del self._sampling_owner[r.request_id]
            cap = len(self._sampling_table)
            if len(self._free_sampling_slots) < cap // 4:
                self._sampling_table = np.concatenate([self._sampling_table, np.zeros_like(self._sampling_table)])
                self._free_sampling_slots.extend(range(2 * cap - 1, cap - 1, -1))
        slot = self._free_sampling_slots.pop()
        self._sampling_table[slot] = req.sampling_row + (req.sample_seed,)
        self._sampling_slots[req] = slot
        self._sampling_owner[req.request_id] = req
        return slot

    def prepare_inputs(self, out: SchedulerOutput, block_ids) -> PreparedInputs:
        """block_ids: the KV cache manager's BlockTableView (one gather of persistent rows), or any
        mapping request id -> block id list."""
        reqs = out.scheduled
        num_reqs = len(reqs)
        rids, static = self._batch(out)
        n_sched = np.fromiter(map(out.num_scheduled_tokens.__getitem__, rids), np.int32, num_reqs)
        # the scheduler already advanced num_computed_tokens past this step's tokens (all num_steps of them
        # under multi-step: the inputs describe the first step, the program advances them on the device)
        seq_lens = np.fromiter(map(_NUM_COMPUTED, reqs), np.int32, num_reqs)
        if out.num_steps > 1:
            seq_lens -= out.num_steps - 1
        starts = seq_lens - n_sched
        num_tokens = int(n_sched.sum())
        decode_only = bool((n_sched == 1).all())
        bucket = self.buckets.pick(num_tokens, num_reqs, decode_only)
        T, R = bucket.padded_num_tokens, bucket.padded_num_reqs

        qsl = np.full(R + 1, num_tokens, np.int32)
        qsl[0] = 0
        np.cumsum(n_sched, out=qsl[1:num_reqs + 1])
        positions = np.zeros(T, np.int32)
        if decode_only:
            req_of_token = np.arange(num_reqs)
            positions[:num_tokens] = starts
        else:
            # token -> request row: n_sched [2, 5, 3] -> [0, 0, 1, 1, 1, 1, 1, 2, 2, 2]
            req_of_token = np.repeat(np.arange(num_reqs), n_sched)
            positions[:num_tokens] = starts[req_of_token] + (np.arange(num_tokens) - qsl[req_of_token])
        token_ids = np.zeros(T, np.int32)
        fill_idx = np.full(R, T, np.int32)
        fill_src = np.zeros(R, np.int32)
        # Input tokens already on the host: all_token_ids[start:start + known]. The rest (at most the
        # last one) was sampled by the previous step and is still on the device: the step reads it there.
        # After a multi-step batch the host lags by several tokens, but only the last one is an input
        # (the others' K/V is in the cache already): known is 0 then.
        host_tokens = np.fromiter(map(_NUM_TOKENS, reqs), np.int32, num_reqs)
        known = np.clip(host_tokens - starts, 0, n_sched)
        if (known < n_sched - 1).any():
            raise ValueError("more than one input token of a request is not on the host")
        missing = np.flatnonzero(known < n_sched)
        if missing.size:
            fill_idx[missing] = qsl[missing + 1] - 1
            prev = self.prev_rows
            if missing.size == num_reqs:       # decode steps under async scheduling: every row
                fill_src[:num_reqs] = np.fromiter(map(prev.__getitem__, rids), np.int32, num_reqs)
            else:
                fill_src[missing] = [prev[rids[i]] for i in missing.tolist()]
        single = np.flatnonzero(known == 1)
        if single.size:
            token_ids[qsl[single]] = [reqs[i].all_token_ids[s]
                                      for i, s in zip(single.tolist(), starts[single].tolist())]
        for i in np.flatnonzero(known > 1).tolist():
            s, k, q = int(starts[i]), int(known[i]), int(qsl[i])
            token_ids[q:q + k] = reqs[i].all_token_ids[s:s + k]
        gather = getattr(block_ids, "gather", None)
        if gather is not None:
            tables = gather(rids, R, self.max_blocks_per_req)
        else:
            tables = _tables_from_lists([block_ids[rid] for rid in rids], R, self.max_blocks_per_req)
        slots = np.zeros(T, np.int32)      # padding tokens write into the null block
        pos = positions[:num_tokens]
        slots[:num_tokens] = tables[req_of_token, pos // self.block_size] * self.block_size + pos % self.block_size
        lens = np.zeros(R, np.int32)
        lens[:num_reqs] = seq_lens
        logits_idx = np.zeros(R, np.int32)
        logits_idx[:num_reqs] = qsl[1:num_reqs + 1] - 1
        meta = AttentionMetadata(positions, slots, tables, lens, qsl)
        targets = np.zeros(0, np.int32)
        prompt_rows: dict[str, tuple[int, int, int]] = {}
        if num_reqs and static[:, _PROMPT_LOGPROBS].max() >= 0:
            targets = np.full(T, -1, np.int32)
            for i, (r, s, n) in enumerate(zip(reqs, starts.tolist(), n_sched.tolist())):
                count = min(s + n, r.num_prompt_tokens - 1) - s   # token p predicts prompt token p + 1
                if r.sampling_params.prompt_logprobs is not None and count > 0:
                    targets[qsl[i]:qsl[i] + count] = r.prompt_token_ids[s + 1:s + 1 + count]
                    prompt_rows[r.request_id] = (int(qsl[i]), count, s + 1)
        return PreparedInputs(ModelInput(token_ids, meta, logits_idx, fill_idx, fill_src, targets), bucket,
                              prompt_rows)

    def prepare_sampling(self, out: SchedulerOutput, padded_reqs: int) -> tuple[SamplingInputs, SamplerFlags]:
        reqs = out.scheduled
        R = padded_reqs
        n = len(reqs)
        # Each request's parameters were packed into a row once (Request.sampling_row + seed, see
        # SAMPLING_COLUMNS) and sit in a persistent table: one gather, then the output index being sampled.
        _, static = self._batch(out)
        table = np.empty((R, len(SAMPLING_COLUMNS)), np.float64)
        table[:n] = static
        table[n:] = _PADDING_ROW        # padding: greedy, nothing extra
        temperature, top_p, min_p = (table[:, c].astype(np.float32) for c in (0, 2, 3))
        pres, freq, rep = (table[:, c].astype(np.float32) for c in (4, 5, 6))
        top_k = table[:, 1].astype(np.int32)
        seeds = table[:, 10].astype(np.uint32)
        # output index of the token being sampled: the placeholder this step just added is that token
        positions = np.zeros(R, np.int32)
        positions[:n] = np.fromiter(map(_NUM_OUTPUT, reqs), np.int32, n)
        positions[:n] += np.fromiter(map(_NUM_PLACEHOLDERS, reqs), np.int32, n)
        np.maximum(positions - out.num_steps, 0, out=positions)   # multi-step: the first step's token
        penalties = bool((pres != 0).any() or (freq != 0).any() or (rep != 1).any())
        flags = SamplerFlags(
            top_k_p=bool((top_k > 0).any() or (top_p < 1).any() or (min_p > 0).any()),
            penalties=penalties,
            num_logprobs=_logprobs_width(table[:, 7].max()),
            num_prompt_logprobs=_logprobs_width(table[:, _PROMPT_LOGPROBS].max()),
        )
        out_ids = prompt_ids = np.full((R, 0), -1, np.int32)
        if penalties:
            out_ids = _pad_rows([r.output_token_ids for r in reqs], R)
            prompt_ids = _pad_rows([r.prompt_token_ids for r in reqs], R)
        bias_rows = {i: self._bias_entries(reqs[i]) for i in np.flatnonzero(table[:n, 9])}
        bias_rows = {i: row for i, row in bias_rows.items() if row}
        if bias_rows:
            flags = dataclasses.replace(flags, logit_bias=True)
            width = _pow2(max(len(b) for b in bias_rows.values()), 4)
            bias_ids = np.full((R, width), -1, np.int32)
            bias_vals = np.zeros((R, width), np.float32)
            for i, row in bias_rows.items():
                bias_ids[i, :len(row)] = [t for t, _ in row]
                bias_vals[i, :len(row)] = [v for _, v in row]
        else:
            bias_ids, bias_vals = np.full((R, 0), -1, np.int32), np.zeros((R, 0), np.float32)
        inputs = SamplingInputs(temperature, top_k, top_p, min_p, seeds, positions, pres, freq, rep,
                                out_ids, prompt_ids, bias_ids, bias_vals)
        return inputs, flags

    def _bias_entries(self, req) -> list[tuple[int, float]]:
        sp = req.sampling_params
        row = list((sp.logit_bias or {}).items())
        if req.num_output_tokens + req.num_output_placeholders - 1 < sp.min_tokens:
            # min_tokens: EOS and stop tokens may not be sampled yet
            banned = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(req.eos_token_ids))
            row += [(t, -np.inf) for t in sorted(banned)]
        return [(t, v) for t, v in row if 0 <= t < self.cfg.vocab_size]

    # ---- execution ----------------------------------------------------------------------------
    def dispatch(self, out: SchedulerOutput, block_ids: dict[str, list[int]]) -> InFlight:
        """Prepare and launch one step without waiting for it (JAX dispatch is asynchronous)."""
        return self.launch(self.prepare(out, block_ids))

    def options(self, bucket: Bucket, num_steps: int) -> RuntimeOptions:
        """The static choices of a bucket's program. Its layers run inside a while loop under the layer
        scan, and under any dispatch when the program loops over several decode steps."""
        return RuntimeOptions(self.attn_backend, bucket.decode_only, num_steps=num_steps,
                              in_loop=self.layer_params is None or num_steps > 1)

    def prepare(self, out: SchedulerOutput, block_ids: dict[str, list[int]]) -> tuple:
        """The host half of dispatch: the step's padded inputs (Python and numpy work)."""
        t0 = time.perf_counter()
        self._apply_block_moves(out)
        model_input, bucket, prompt_rows = self.prepare_inputs(out, block_ids)
        sampling, flags = self.prepare_sampling(out, bucket.padded_num_reqs)
        options = self.options(bucket, out.num_steps)
        self.compiled_keys.add((bucket, flags, out.num_steps))
        rids, _ = self._batch(out)
        if len(out.sampling_ids) == len(rids):      # every request samples a token (decode steps)
            rows = dict(zip(rids, range(len(rids))))
        else:
            rows = {rid: i for i, rid in enumerate(rids) if rid in out.sampling_ids}
        return out, model_input, sampling, options, flags, rows, prompt_rows, time.perf_counter() - t0

    def launch(self, prepared: tuple) -> InFlight:
        """The device half of dispatch: pack and launch the step. Touches only the pool, prev_sampled and
        prev_rows, so it may run on another thread while the engine processes the previous step."""
        out, model_input, sampling, options, flags, rows, prompt_rows, prepare_s = prepared
        t1 = time.perf_counter()
        self.kv_cache, self.prev_sampled, result = self._step(
            self.params, self.kv_cache, self.prev_sampled, model_input, sampling, options=options, flags=flags)
        self.prev_rows = rows
        return InFlight(out, result, rows, prompt_rows, prepare_s=prepare_s, launch_s=time.perf_counter() - t1)

    def fetch(self, inflight: InFlight) -> RunnerOutput:
        """Block on a dispatched step's sampled ids (one device_get)."""
        ids, lp, rank, top_ids, top_lp, prompt = jax.device_get(inflight.result)
        return RunnerOutput(ids, lp, rank, top_ids, top_lp, prompt if inflight.prompt_rows else None)

    def execute(self, out: SchedulerOutput, block_ids: dict[str, list[int]]) -> RunnerOutput:
        return self.fetch(self.dispatch(out, block_ids))

    def _apply_block_moves(self, out: SchedulerOutput) -> None:
        if out.blocks_to_swap_out:
            dev = np.array([d for d, _ in out.blocks_to_swap_out])
            host = np.array([h for _, h in out.blocks_to_swap_out])
            self.cpu_cache[:, :, host] = np.asarray(jax.device_get(self.kv_cache[:, :, dev]))
        if out.blocks_to_swap_in:
            host = np.array([h for h, _ in out.blocks_to_swap_in])
            dev = np.array([d for _, d in out.blocks_to_swap_in])
            self.kv_cache = _set_blocks(self.kv_cache, *_pad_pair(dev, self.cpu_cache[:, :, host]))
        if out.blocks_to_copy:
            src = np.array([s for s, _ in out.blocks_to_copy])
            dst = np.array([d for _, d in out.blocks_to_copy])
            self.kv_cache = _copy_blocks(self.kv_cache, *_pad_ids(src, dst))

    # ---- warm-up ------------------------------------------------------------------------------
    def warmup(self, buckets: list[Bucket], progress: bool = True, num_steps: int = 1) -> float:
        """Compile the step for every bucket (default sampler variant) before serving; with num_steps > 1
        (multi-step scheduling) also each decode bucket's multi-step program."""
        from tqdm.auto import tqdm
        t0 = time.perf_counter()
        flags = SamplerFlags()
        variants = [(b, 1) for b in buckets] + [(b, num_steps) for b in buckets if b.decode_only and num_steps > 1]
        threads = envs.JAXPAGED_STARTUP_THREADS
        pool, compiling = None, {}          # compiling: key -> the future of its XLA compile
        if self.exec_cache is not None and threads > 1 and len(variants) > 1:
            # The cached executables are deserialized on several threads at once; the others are traced and
            # lowered here (Python, one at a time) and compiled by XLA on the threads, while this one lowers
            # the next. The loop below then runs each bucket once, in order, taking what the threads made.
            keys = [self._cache_key(*self._dummy_inputs(b), self.options(b, steps), flags) for b, steps in variants]
            self.exec_cache.load_many(keys, threads)
            missing = [(v, k) for v, k in zip(variants, keys) if not self.exec_cache.prefetched(k)]
            if missing:
                pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="jaxpaged-compile")
                for (bucket, steps), key in tqdm(missing, desc="Lowering buckets", disable=not progress):
                    lowered = self._lower(*self._dummy_inputs(bucket), self.options(bucket, steps), flags)
                    compiling[key] = pool.submit(lowered.compile)
        try:
            self._warm(variants, flags, progress, compiling)
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        return time.perf_counter() - t0

    def _warm(self, variants, flags: SamplerFlags, progress: bool, compiling: dict) -> None:
        from tqdm.auto import tqdm
        for bucket, steps in tqdm(variants, desc="Compiling buckets", disable=not progress):
            mi, si = self._dummy_inputs(bucket)
            options = self.options(bucket, steps)
            loaded = self._load_or_compile(mi, si, options, flags, compiling) if self.exec_cache is not None else None
            for attempt in (0, 1):
                try:
                    self.kv_cache, self.prev_sampled, res = self._step(
                        self.params, self.kv_cache, self.prev_sampled, mi, si, options=options, flags=flags)
                    jax.block_until_ready(res)
                    break
                except jax.errors.JaxRuntimeError as e:
                    if attempt or loaded is None:
                        raise
                    # A loaded executable that does not run (XLA:CPU cannot serialize some bf16 programs):
                    # forget it and trace as usual. The pool holds nothing yet, so it is simply remade.
                    logger.warning("A cached executable failed to run (%s); compiling it instead", e)
                    self.exec_cache.discard(loaded)
                    del self._compiled[loaded]
                    self.kv_cache = jnp.zeros(kv_cache_shape(self.cfg, self.num_blocks, self.block_size), self.dtype,
                                              device=self._device)
                    self.prev_sampled = jnp.zeros((self.max_rows,), jnp.int32, device=self._device)
            self.compiled_keys.add((bucket, flags, steps))

    def _cache_key(self, mi, si, options: RuntimeOptions, flags: SamplerFlags) -> tuple:
        """What a step's executable is stored under: its inputs' layout, runtime options and sampler flags."""
        return (flatten((mi, si), self.input_align)[2], options, flags)

    def _load_or_compile(self, mi, si, options: RuntimeOptions, flags: SamplerFlags,
                         compiling: dict) -> tuple | None:
        """The bucket's executable from the on-disk cache, else from `compiling` (key -> the future of the
        XLA compile warmup started on a thread), else traced and compiled here; stored on disk. Returns its
        key when it came from disk (it has not run yet), else None."""
        key = self._cache_key(mi, si, options, flags)
        compiled = self.exec_cache.load(key)
        from_disk = compiled is not None
        if not from_disk:
            future = compiling.pop(key, None)
            compiled = future.result() if future is not None else self._lower(mi, si, options, flags).compile()
            self.exec_cache.store(key, compiled)
        self._compiled[key] = compiled
        return key if from_disk else None

    def _lower(self, mi, si, options: RuntimeOptions, flags: SamplerFlags):
        """The step traced and lowered for these inputs, as the steps are called: inputs packed, in pinned
        host memory when HostInputs is on."""
        ints, floats, layout = pack((mi, si), self.input_align)
        if self.host_inputs is not None:     # compiled for inputs in pinned host memory, as the steps pass them
            ints, floats = self.host_inputs.write(ints, floats).arrays
        kw = dict(layout=layout, cfg=self.cfg, dtype=self.dtype, options=options, flags=flags)
        if self.layer_params is None:
            traced = _packed_step.trace(self.params, self.kv_cache, self.prev_sampled, ints, floats, **kw)
        else:
            traced = layerwise.whole_step.trace(self.params, self._layer_groups[0][0], self.kv_cache,
                                                self.prev_sampled, ints, floats, **kw)
        return traced.lower()

    def _dummy_inputs(self, bucket: Bucket):
        T, R = bucket.padded_num_tokens, bucket.padded_num_reqs
        z = lambda *s: np.zeros(s, np.int32)
        qsl = z(R + 1)   # no real request: every token is padding, writes go to the null block
        meta = AttentionMetadata(z(T), z(T), z(R, self.max_blocks_per_req), z(R), qsl)
        f = lambda v: np.full(R, v, np.float32)
        e = np.full((R, 0), -1, np.int32)
        si = SamplingInputs(f(0), z(R), f(1), f(0), np.zeros(R, np.uint32), z(R), f(0), f(0), f(1), e, e, e,
                            np.zeros((R, 0), np.float32))
        return ModelInput(z(T), meta, z(R), np.full(R, T, np.int32), z(R), z(0)), si


@functools.partial(jax.jit, static_argnames=("layout", "cfg", "dtype", "options", "flags"),
                   donate_argnames=("kv_cache", "prev_sampled"))
def _packed_step(params, kv_cache, prev_sampled, ints, floats, *, layout, cfg, dtype, options: RuntimeOptions,
                 flags: SamplerFlags):
    """The one jitted step: model forward over the flat batch, then sampling; the pool and the sampled-token
    buffer are donated (updated in place: their addresses stay those the step's CUDA graphs hold).

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


# ---- pieces of the step shared with per-layer dispatch (runner/layerwise.py) --------------------------
def prompt_head(flags: SamplerFlags):
    """The prompt-logprob head the model applies to every token's logits in bounded chunks, or None."""
    return (functools.partial(prompt_logprobs, k=flags.num_prompt_logprobs)
            if flags.num_prompt_logprobs >= 0 else None)


def sample_and_keep(logits, prompt, sampling: SamplingInputs, flags: SamplerFlags, prev_sampled):
    """(sampled ids in a fixed-size device buffer for the next step's inputs, the step's results)."""
    result = sample(logits, sampling, flags)
    sampled_buf = jnp.zeros_like(prev_sampled).at[:logits.shape[0]].set(result[0])
    return sampled_buf, (*result, prompt)


def _tables_from_lists(lists: list[list[int]], num_rows: int, width: int) -> np.ndarray:
    """int32[num_rows, width] block tables from block id lists, in one scatter:
    lens [2, 3] -> rows [0, 0, 1, 1, 1], cols [0, 1, 0, 1, 2]; the rest is the null block."""
    tables = np.zeros((num_rows, width), np.int32)
    lens = np.fromiter(map(len, lists), np.int64, len(lists))
    flat = np.fromiter(itertools.chain.from_iterable(lists), np.int32, int(lens.sum()))
    rows = np.repeat(np.arange(len(lists)), lens)
    tables[rows, np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)] = flat
    return tables


def _pad_rows(rows: list[list[int]], num_rows: int) -> np.ndarray:
    width = _pow2(max((len(r) for r in rows), default=1), 16)
    out = np.full((num_rows, width), -1, np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def _pad_ids(src: np.ndarray, dst: np.ndarray):
    """Pad block-id lists to a power of two (fewer compiles); padding copies null block onto itself."""
    n = _pow2(len(src))
    return np.pad(src, (0, n - len(src))), np.pad(dst, (0, n - len(dst)))


def _pad_pair(dst: np.ndarray, data: np.ndarray):
    n = _pow2(len(dst))
    pad = [(0, 0)] * data.ndim
    pad[2] = (0, n - len(dst))
    # padding rows write zeros into the null block, which holds nothing real
    return np.pad(dst, (0, n - len(dst))), np.pad(data, pad)


@functools.partial(jax.jit, donate_argnums=0)
def _copy_blocks(kv_cache, src, dst):
    return kv_cache.at[:, :, dst].set(kv_cache[:, :, src])


@functools.partial(jax.jit, donate_argnums=0)
def _set_blocks(kv_cache, dst, data):
    return kv_cache.at[:, :, dst].set(data.astype(kv_cache.dtype))
