"""The scheduler -> runner hand-off and the runner's host inputs: the runner's own per-request state
(InputBatch), kept only from each step's plain-data SchedulerOutput, always equals the scheduler's block
lists and tokens (through allocation, copy-on-write, forks, swaps, preemption and finishes), and its
vectorised inputs equal a per-request reference built from the scheduler's requests on mixed steps with
chunked prefill, prefix hits, n > 1, prompt logprobs, preemption and async placeholders."""
import itertools

import numpy as np
import pytest

from jaxpaged import SamplingParams
from jaxpaged.engine.kv_cache_manager import KVCacheManager
from jaxpaged.engine.request import Request, RequestStatus
from jaxpaged.config import MOSAIC_INPUT_ALIGN
from jaxpaged.engine.scheduler import Scheduler, SchedulerConfig
from jaxpaged.runner.input_batch import InputBatch

pytestmark = pytest.mark.cost(70)


def check_batch(batch: InputBatch, s: Scheduler, kv: KVCacheManager) -> None:
    """Every request the runner holds is running (or finished since the last step: the next step's
    finished_req_ids tell the runner), with the scheduler's block ids and tokens; free rows are zeroed
    (row 0, the padding row, too)."""
    running = {r.request_id: r for r in s.running}
    assert set(batch.rows) <= set(running) | s.finished_req_ids
    for rid, row in batch.rows.items():
        if rid in s.finished_req_ids:
            continue
        ids = kv.get_block_ids(rid)
        assert batch.block_table[row, :len(ids)].tolist() == ids and not batch.block_table[row, len(ids):].any()
        assert batch.num_blocks[row] == len(ids)
        assert batch.token_ids[row] == running[rid].all_token_ids
    free = [r for r in range(len(batch.num_blocks)) if r not in batch.rows.values()]
    assert 0 in free and not batch.block_table[free].any() and not batch.num_blocks[free].any()


@pytest.mark.parametrize("mode,caching", [("recompute", True), ("swap", True), ("recompute", False)])
def test_runner_state_follows_every_block_list_change(mode, caching):
    """A random workload over a small pool: prefix hits, forks (beam-style, with copy-on-write of the
    shared partly filled block), preemption by recompute or swap, aborts and finishes. The runner's state
    sees only the SchedulerOutputs (and appends the tokens it samples, as the runner does)."""
    rng = np.random.default_rng(0)
    kv = KVCacheManager(48, 4, caching, num_cpu_blocks=64 if mode == "swap" else 0)
    s = Scheduler(SchedulerConfig(max_num_seqs=12, max_num_batched_tokens=40, max_model_len=96,
                                  preemption_mode=mode), kv)
    batch = InputBatch(max_blocks_per_req=24)
    base = rng.integers(100, 200, 9).tolist()
    ids = itertools.count()
    forks = replaced = 0
    for step in range(400):
        if rng.random() < 0.3 and len(s.requests) < 16:
            prompt = (base if rng.random() < 0.5 else []) + rng.integers(100, 200, int(rng.integers(1, 20))).tolist()
            s.add_request(Request(f"r{next(ids)}", prompt, SamplingParams(max_tokens=int(rng.integers(2, 30))),
                                  block_size=4))
        out = s.schedule()
        batch.apply(out)
        replaced += len(out.scheduled_cached_reqs.replaced_block_ids)
        assert set(out.req_ids) <= set(batch.rows)
        allocated = sum(len(kv.req_to_blocks.get(r.request_id, ())) * 4 for r in s.running)
        used = sum(min(r.num_computed_tokens, len(kv.req_to_blocks.get(r.request_id, ())) * 4) for r in s.running)
        assert kv.slot_usage(s.running) == (allocated, used)
        for r in [s.requests[rid] for rid in out.req_ids]:
            if r.request_id not in out.sampling_ids:
                continue
            s.settle(r, 1)
            token = int(rng.integers(100, 200))
            r.append_output_token(token)
            batch.token_ids[batch.rows[r.request_id]].append(token)       # the runner's own copy
            status = s.check_stop(r)
            if status is None and rng.random() < 0.02:
                status = RequestStatus.FINISHED_ABORTED
            if status is not None:
                s.finish_request(r, status)
            elif rng.random() < 0.15 and len(s.running) < 12 and r.num_output_placeholders == 0:
                child = Request(f"r{next(ids)}", r.prompt_token_ids, r.sampling_params, block_size=4)
                for t in r.output_token_ids:
                    child.append_output_token(t)
                s.add_forked(r, child)
                forks += 1
        check_batch(batch, s, kv)
    while s.has_unfinished():
        for r in list(s.running) + list(s.waiting):
            s.finish_request(r, RequestStatus.FINISHED_ABORTED)
    batch.apply(s.schedule())          # the finished ids reach the runner with the next step
    check_batch(batch, s, kv)
    assert forks > 5 and s.num_preemptions > 0 and replaced > 0      # parents copy-on-write after forks
    assert not batch.rows and not batch.block_table.any() and kv.pool.num_free_blocks == 47


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempting_a_request_scheduled_earlier_in_the_step_undoes_its_tokens(mode):
    """Running requests' tokens are committed as they are scheduled; a priority victim that sat before
    the request that needs its blocks gets them back: num_computed_tokens and the placeholder."""
    kv = KVCacheManager(5, 4, num_cpu_blocks=8)
    s = Scheduler(SchedulerConfig(policy="priority", max_num_batched_tokens=64, preemption_mode=mode), kv)
    lo = Request("lo", list(range(100, 105)), SamplingParams(max_tokens=6), priority=3, arrival_time=0.0, block_size=4)
    hi = Request("hi", list(range(200, 208)), SamplingParams(max_tokens=6), priority=0, arrival_time=1.0, block_size=4)
    s.add_request(lo)
    out = s.schedule()                       # lo's prompt of 5 tokens: two blocks
    s.settle(lo, 1)                          # its sample arrives
    lo.append_output_token(5)
    s.add_request(hi)
    out = s.schedule()                       # lo's token 6 in place; hi's prompt of 8: two blocks
    assert [r.request_id for r in s.running] == ["lo", "hi"] and kv.pool.num_free_blocks == 0
    # the samples are still in flight (async): lo 6 computed, 1 placeholder
    assert (lo.num_computed_tokens, lo.num_output_placeholders) == (6, 1)
    # lo's token 7 fits its second block (scheduled first), hi's token 9 needs a third: none is free
    out = s.schedule()
    assert out.preempted_req_ids == ["lo"] and out.req_ids == ["hi"]
    assert [n.req_id for n in out.scheduled_new_reqs] == [] and out.scheduled_cached_reqs.req_ids == ["hi"]
    assert out.sampling_ids == {"hi"} and hi.num_output_placeholders == 2
    assert lo.num_output_placeholders == 1   # undone: only the in-flight one is left
    assert lo.num_computed_tokens == (6 if mode == "swap" else 0)
    assert lo.status == (RequestStatus.SWAPPED if mode == "swap" else RequestStatus.PREEMPTED)


def test_request_counters_are_kept_as_attributes():
    r = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4, stop_token_ids=[9]), eos_token_ids=(2,),
                block_size=4)
    assert (r.num_prompt_tokens, r.num_tokens, r.num_output_tokens, r.is_finished) == (5, 5, 0, False)
    assert len(r.block_hashes) == 1
    for t in (7, 8, 9):
        r.append_output_token(t)
    assert (r.num_tokens, r.num_output_tokens) == (8, 3) and len(r.block_hashes) == 2
    r.status = RequestStatus.RUNNING
    assert not r.is_finished
    r.status = RequestStatus.FINISHED_STOPPED
    assert r.is_finished and r.status.finish_reason == "stop"
    s = Scheduler(SchedulerConfig(), KVCacheManager(8, 4))
    assert s.check_stop(r) == RequestStatus.FINISHED_STOPPED and r.stop_reason == 9
    ignore = Request("b", [1], SamplingParams(ignore_eos=True), eos_token_ids=(2,), block_size=4)
    ignore.append_output_token(2)
    assert s.check_stop(ignore) is None


# ---- the runner's inputs against the per-request reference -------------------------------------

def reference_inputs(runner, out, reqs, block_ids, prev_rows):
    """One python pass per request over the scheduler's own requests (tokens, counters, block lists)."""
    n = len(reqs)
    n_sched = np.array([out.num_scheduled_tokens[r.request_id] for r in reqs], np.int32)
    seq_lens = np.array([r.num_computed_tokens for r in reqs], np.int32)
    starts = seq_lens - n_sched
    num_tokens = int(n_sched.sum())
    bucket = runner.buckets.pick(num_tokens, n, bool((n_sched == 1).all()))
    T, R = bucket.padded_num_tokens, bucket.padded_num_reqs
    qsl = np.full(R + 1, num_tokens, np.int32)
    qsl[0] = 0
    np.cumsum(n_sched, out=qsl[1:n + 1])
    req_of_token = np.repeat(np.arange(n), n_sched)
    positions = np.zeros(T, np.int32)
    positions[:num_tokens] = starts[req_of_token] + (np.arange(num_tokens) - qsl[req_of_token])
    token_ids = np.zeros(T, np.int32)
    fill_idx = np.full(R, T, np.int32)
    fill_src = np.zeros(R, np.int32)
    pieces = []
    for i, (r, s, k) in enumerate(zip(reqs, starts.tolist(), n_sched.tolist())):
        known = r.all_token_ids[s:s + k]
        if len(known) < k:
            fill_idx[i] = qsl[i] + k - 1
            fill_src[i] = prev_rows[r.request_id]
            known = known + [0]
        pieces.append(known)
    token_ids[:num_tokens] = np.concatenate(pieces)
    tables = np.zeros((R, runner.max_blocks_per_req), np.int32)
    for i, r in enumerate(reqs):
        ids = block_ids[r.request_id]
        tables[i, :len(ids)] = ids
    pos = positions[:num_tokens]
    slots = np.zeros(T, np.int32)
    slots[:num_tokens] = tables[req_of_token, pos // runner.block_size] * runner.block_size + pos % runner.block_size
    # prompt logprobs: the next prompt token for each scheduled prompt token; none at all (shape [0]) in a step
    # that scores no prompt token, even beside a request that asked for them (its prompt is done)
    targets = np.full(T, -1, np.int32)
    for i, (r, s, k) in enumerate(zip(reqs, starts.tolist(), n_sched.tolist())):
        count = min(s + k, r.num_prompt_tokens - 1) - s
        if r.sampling_params.prompt_logprobs is not None and count > 0:
            targets[qsl[i]:qsl[i] + count] = r.prompt_token_ids[s + 1:s + 1 + count]
    if (targets < 0).all():
        targets = np.zeros(0, np.int32)
    out_idx = np.array([r.num_output_tokens + r.num_output_placeholders - 1 for r in reqs] + [0] * (R - n))
    return dict(token_ids=token_ids, positions=positions, slot_mapping=slots, block_tables=tables,
                query_start_loc=qsl, fill_token_idx=fill_idx, fill_src_row=fill_src, prompt_target_ids=targets,
                sample_positions=np.maximum(out_idx, 0), seeds=np.array([r.sample_seed for r in reqs] + [0] * (R - n)),
                temperature=np.array([r.sampling_params.temperature for r in reqs] + [0.0] * (R - n), np.float32))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from conftest import tiny_llama_dir
    return tiny_llama_dir(tmp_path_factory, "tiny_llama_inputs", num_hidden_layers=1)


@pytest.mark.parametrize("kw", [dict(num_gpu_blocks_override=64, max_num_batched_tokens=48),
                                dict(num_gpu_blocks_override=14, preemption_mode="swap", swap_space=0.01),
                                dict(num_gpu_blocks_override=14, preemption_mode="recompute")],
                         ids=["chunked", "swap", "recompute"])
def test_runner_inputs_equal_the_per_request_reference(model_dir, kw):
    from jaxpaged import LLM
    args = dict(dtype="float32", max_model_len=128, max_num_seqs=8, block_size=8, compile_buckets=False)
    llm = LLM(model=model_dir, **{**args, **kw})
    eng = llm.llm_engine
    runner = eng.runner
    real_prepare = runner.prepare          # the engine builds each step's inputs through runner.prepare
    checked, scoring = [], []

    def prepare(out):
        reqs = [eng.scheduler.requests[rid] for rid in out.req_ids]
        block_ids = {rid: eng.kv_manager.get_block_ids(rid) for rid in out.req_ids}
        want = reference_inputs(runner, out, reqs, block_ids, dict(runner.prev_rows))
        prepared = real_prepare(out)
        mi, si = prepared.inputs.model_input, prepared.inputs.sampling
        got = dict(token_ids=mi.token_ids, positions=mi.meta.positions, slot_mapping=mi.meta.slot_mapping,
                   block_tables=mi.meta.block_tables, query_start_loc=mi.meta.query_start_loc,
                   fill_token_idx=mi.fill_token_idx, fill_src_row=mi.fill_src_row,
                   prompt_target_ids=mi.prompt_target_ids, sample_positions=si.positions, seeds=si.seeds,
                   temperature=si.temperature)
        for k, v in want.items():
            np.testing.assert_array_equal(np.asarray(got[k]), v, err_msg=k)
        # the sampler variant scores prompt tokens exactly where the step has some to score
        assert (prepared.inputs.flags.num_prompt_logprobs >= 0) == (len(want["prompt_target_ids"]) > 0)
        scoring.append(len(want["prompt_target_ids"]) > 0)
        checked.append(bool(mi.fill_token_idx.min() < len(mi.token_ids)))
        return prepared

    runner.prepare = prepare
    rng = np.random.default_rng(5)
    base = rng.integers(100, 40000, 20).tolist()
    prompts = [base + rng.integers(100, 40000, int(k)).tolist() for k in (3, 30, 11, 50, 1, 17)]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=25, ignore_eos=True, n=3),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=2),
              SamplingParams(temperature=0.5, seed=9, max_tokens=16, ignore_eos=True)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [20, 25, 25, 25, 12, 30, 8, 8, 16]
    assert len(checked) > 20 and any(checked)            # async steps read tokens from the device
    assert any(scoring) and not all(scoring)
    if "preemption_mode" in kw:
        assert eng.scheduler.num_preemptions > 0
    # the engine went idle: the runner dropped every request's state
    assert not runner.batch.rows and not runner.batch.block_table.any()


def test_steps_read_their_inputs_from_persistent_pinned_buffers(model_dir):
    """HostInputs: every step's packed inputs are written in place into pinned host buffers that JAX owns,
    a few per packed size used in turn, and the sampled-token buffer is donated and comes back in place.
    The tokens equal those of fresh host arrays handed to the step (the CPU backend has pinned host
    memory too; the GPU's own check is bench/gpu_e2e.py)."""
    from jaxpaged import LLM
    llm = LLM(model=model_dir, dtype="float32", max_model_len=128, max_num_seqs=4, block_size=8,
              num_gpu_blocks_override=64, compile_buckets=False)
    programs = llm.llm_engine.runner.programs
    real_run = programs.run_packed
    seen_inputs, seen_prev = set(), set()

    def run_packed(kv_cache, prev_sampled, ints, floats, **kw):
        assert ints.sharding.memory_kind == floats.sharding.memory_kind == "pinned_host"
        seen_inputs.add((ints.unsafe_buffer_pointer(), floats.unsafe_buffer_pointer()))
        out = real_run(kv_cache, prev_sampled, ints, floats, **kw)
        seen_prev.add(out[1].unsafe_buffer_pointer())
        return out

    programs.run_packed = run_packed
    rng = np.random.default_rng(11)
    # prompts long enough that a prefill step's packed inputs outgrow a decode step's (two packed sizes)
    prompts = [rng.integers(100, 40000, int(k)).tolist() for k in (5, 90, 100)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    pinned = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    slots = programs.host_inputs._slots
    assert len(slots) >= 2                                     # a prefill size and a decode size at least
    assert seen_inputs <= {(s.arrays[0].unsafe_buffer_pointer(), s.arrays[1].unsafe_buffer_pointer())
                           for ring in slots.values() for s in ring}
    assert len(seen_inputs) > len(slots)                       # a size's slots taken in turn
    assert len(seen_prev) == 1                                 # donated, returned in place
    # the same step on fresh host copies of the inputs gives the same tokens
    programs.run_packed = lambda kv, prev, ints, floats, **kw: real_run(kv, prev, np.array(ints), np.array(floats),
                                                                        **kw)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == pinned


def test_host_inputs_reuse_a_slot_only_after_its_step_finished():
    """A slot's buffers are rewritten only when the step that read them is done (its fence is ready), and
    what the step reads is what was written, at every turn of the ring."""
    import jax
    from jaxpaged.runner.step_inputs import HostInputs
    host = HostInputs(depth=2)
    step = jax.jit(lambda i, f: (jax.device_put(i, jax.memory.Space.Device) * 2,
                                 jax.device_put(f, jax.memory.Space.Device) + 1))
    rng = np.random.default_rng(3)
    waited = []
    real_block = jax.block_until_ready
    for n in range(6):
        ints = rng.integers(-1000, 1000, 256).astype(np.int32)
        floats = rng.standard_normal(512).astype(np.float32)
        jax.block_until_ready = lambda x: (waited.append(n), real_block(x))[1]
        try:
            slot = host.write(ints, floats)
        finally:
            jax.block_until_ready = real_block
        out = step(*slot.arrays)
        slot.fence = out
        np.testing.assert_array_equal(np.asarray(out[0]), ints * 2)
        np.testing.assert_allclose(np.asarray(out[1]), floats + 1, rtol=1e-6)
    assert waited == [2, 3, 4, 5]                              # the first two turns found empty slots
    assert len(host._slots[(256, 512)]) == 2


def test_host_inputs_reuse_the_slot_of_a_step_that_failed():
    """A step whose program failed (its results carry the error: a cached executable that cannot run, which the
    warm-up then compiles instead) has finished with its slot: the next write of that size takes the slot and
    raises nothing, so the step can be run again."""
    import jax
    from jaxpaged.runner.step_inputs import HostInputs

    class FailedResults:                      # what block_until_ready finds on a failed program's outputs
        def block_until_ready(self):
            raise jax.errors.JaxRuntimeError("NOT_FOUND: Function wrapped_iota not found")

    host = HostInputs(depth=1)
    ints, floats = np.arange(8, dtype=np.int32), np.ones(4, np.float32)
    slot = host.write(ints, floats)
    slot.fence = FailedResults()
    again = host.write(ints + 1, floats)
    assert again is slot and slot.fence is None
    np.testing.assert_array_equal(np.asarray(slot.arrays[0])[:8], ints + 1)


@pytest.mark.parametrize("align", [1, 64])
def test_packed_inputs_round_trip_and_start_on_their_grid(align):
    """pack / unpack give back every input exactly, each cut from its buffer at a multiple of `align`
    elements: 64 (256 bytes) for unrolled layers, where XLA may pass a slice of the packed buffer to the
    Mosaic GPU custom call as a pointer into it and the call rejects pointers off that grid (the unrolled
    dispatch's failure on the H100); 1 (back to back) elsewhere."""
    import jax
    import jax.numpy as jnp
    from jaxpaged.runner import step_inputs as si
    rng = np.random.default_rng(0)
    tree = {"a": rng.integers(-9, 9, (3, 5)).astype(np.int32), "b": rng.standard_normal(7).astype(np.float32),
            "c": rng.integers(0, 2**32, 3, dtype=np.uint32), "d": rng.integers(-9, 9, 130).astype(np.int64),
            "e": rng.standard_normal((2, 33)).astype(np.float32), "f": np.int32(rng.integers(1, 99))}
    ints, floats, layout = si.pack(tree, align)
    assert ints.dtype == np.int32 and floats.dtype == np.float32 and layout[2] == align
    off = {"i": 0, "f": 0}
    for kind, shape, dtype in layout[1]:
        start = -(-off[kind] // align) * align
        if align == MOSAIC_INPUT_ALIGN:
            assert start * 4 % 256 == 0
        off[kind] = start + int(np.prod(shape))
    got = jax.jit(lambda i, f: si.unpack(i, f, layout))(jnp.asarray(ints), jnp.asarray(floats))
    for k, want in tree.items():
        want = np.asarray(want)
        dtype = {np.dtype(np.int64): np.int32}.get(want.dtype, want.dtype)
        np.testing.assert_array_equal(np.asarray(got[k]), want.astype(dtype))
    # the pieces HostInputs writes lay out the same buffer as pack
    pieces_i, pieces_f, layout2 = si.flatten(tree, align)
    assert layout2 == layout
    np.testing.assert_array_equal(np.concatenate(pieces_i), ints[:sum(map(len, pieces_i))])
    np.testing.assert_array_equal(np.concatenate(pieces_f), floats[:sum(map(len, pieces_f))])
    assert sum(map(len, pieces_i)) == off["i"] and sum(map(len, pieces_f)) == off["f"]
    if align == 1:
        assert off["i"] == 15 + 3 + 130 + 1 and off["f"] == 7 + 66      # nothing between the pieces
