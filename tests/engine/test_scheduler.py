"""The token-budget scheduler over the real KVCacheManager, driven by a fake "model" that appends one
token per request whose scheduled chunk reached its end. Pure Python: milliseconds, exact values."""
import logging
import types
import zlib

import numpy as np
import pytest

from jaxpaged.engine.kv_cache_manager import KVCacheManager
from jaxpaged.engine.input_processor import InputProcessor
from jaxpaged.engine.messages import CoreInfo
from jaxpaged.engine.request import Request, RequestStatus
from jaxpaged.engine.scheduler import Scheduler, SchedulerConfig, max_kv_slots
from jaxpaged.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, num_cpu_blocks=0, caching=True, **cfg):
    kv = KVCacheManager(num_blocks, block_size, caching, num_cpu_blocks)
    return Scheduler(SchedulerConfig(**cfg), kv)


def prompt_tokens(rid, n):
    """n tokens in [1000, 1500) drawn from a generator seeded by the request id: the same for one id in every
    process (never Python's salted hash()), and for two ids a shared first block is a 1 in 500**4 chance."""
    return np.random.default_rng(zlib.crc32(rid.encode())).integers(1000, 1500, n).tolist()


def req(rid, prompt, max_tokens=8, block_size=4, priority=0, arrival=0.0, **sp):
    tokens = list(prompt) if not isinstance(prompt, int) else prompt_tokens(rid, prompt)
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, **sp), block_size=block_size,
                   priority=priority, arrival_time=arrival)


def fake_token(r):
    return 7 + (len(r.all_token_ids) * 31 + len(r.request_id)) % 97


def step(s):
    """schedule() then what the engine does with the sampled ids: one token per finished chunk and decode
    step, the tokens after a stop dropped."""
    out = s.schedule()
    for r in [s.requests[rid] for rid in out.req_ids]:
        if r.request_id not in out.sampling_ids:
            continue
        s.settle(r, out.num_steps)
        for _ in range(out.num_steps):
            r.append_output_token(fake_token(r))
            status = s.check_stop(r)
            if status is not None:
                s.finish_request(r, status)
                break
    return out


def run_all(s, max_steps=10_000):
    outs = []
    while s.has_unfinished():
        outs.append(step(s))
        assert len(outs) < max_steps
    return outs


def sched_map(out):
    return {rid: out.num_scheduled_tokens[rid] for rid in out.req_ids}


def test_token_budget_and_chunked_prefill_beside_decodes():
    s = make(max_num_batched_tokens=16)
    a = req("a", 3, max_tokens=10)
    s.add_request(a)
    assert sched_map(step(s)) == {"a": 3}
    b = req("b", 40)
    s.add_request(b)
    # running decodes first, then the long prompt in chunks with what is left of the budget
    out = step(s)
    assert sched_map(out) == {"a": 1, "b": 15} and out.total_num_scheduled_tokens == 16
    assert s.kv.get_block_ids("a") == [1] and s.kv.get_block_ids("b") == [2, 3, 4, 5]
    assert b.num_output_tokens == 0
    assert sched_map(step(s)) == {"a": 1, "b": 15}
    assert sched_map(step(s)) == {"a": 1, "b": 10}
    assert b.num_output_tokens == 1 and b.num_computed_tokens == 40
    assert sched_map(step(s)) == {"a": 1, "b": 1}
    run_all(s)
    assert a.status == RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 10
    assert s.kv.pool.num_free_blocks == 63


def test_chunked_prefill_off_waits_for_room_for_the_whole_prompt():
    s = make(max_num_batched_tokens=40, enable_chunked_prefill=False)
    a = req("a", 3, max_tokens=4)
    s.add_request(a)
    step(s)
    s.add_request(req("b", 40))
    s.add_request(req("c", 5))
    # b (40 tokens) does not fit beside a's decode (39 left): it waits, and FCFS keeps c behind it
    assert sched_map(step(s)) == {"a": 1}
    assert sched_map(step(s)) == {"a": 1}
    assert sched_map(step(s)) == {"a": 1}      # a's 4th token: finished
    assert sched_map(step(s)) == {"b": 40}
    assert sched_map(step(s)) == {"b": 1, "c": 5}


def test_max_num_seqs():
    s = make(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        s.add_request(req(f"r{i}", 5, max_tokens=2))
    assert sched_map(step(s)) == {"r0": 5, "r1": 5}
    assert s.num_running == 2 and s.num_waiting == 1
    assert sched_map(step(s)) == {"r0": 1, "r1": 1}
    assert sched_map(step(s)) == {"r2": 5}


def test_priority_policy_admits_and_preempts_by_priority():
    s = make(policy="priority", max_num_seqs=2, max_num_batched_tokens=64)
    for rid, prio, t in [("low", 5, 0.0), ("high", 0, 1.0), ("mid", 1, 2.0)]:
        s.add_request(req(rid, 5, max_tokens=3, priority=prio, arrival=t))
    out = step(s)
    assert out.req_ids == ["high", "mid"]
    # priority preemption picks the lowest priority (largest value), then the latest arrival
    s2 = make(num_blocks=5, policy="priority", max_num_batched_tokens=64)
    hi, lo = req("hi", 7, max_tokens=6, priority=0, arrival=1.0), req("lo", 7, max_tokens=6, priority=3, arrival=0.0)
    s2.add_request(lo)
    s2.add_request(hi)
    step(s2)
    step(s2)
    out = step(s2)         # each needs a third block; only 4 exist
    assert out.preempted_req_ids == ["lo"] and lo.status == RequestStatus.PREEMPTED
    run_all(s2)
    assert hi.num_output_tokens == lo.num_output_tokens == 6


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_when_blocks_run_out(mode, caplog):
    # 4 usable blocks of 4 tokens; two 7-token prompts take 2 each, the first decode that crosses into a
    # third block must preempt the newest request.
    s = make(num_blocks=5, num_cpu_blocks=8 if mode == "swap" else 0, preemption_mode=mode,
             max_num_batched_tokens=64)
    a, b = req("a", 7, max_tokens=6), req("b", 7, max_tokens=6)
    s.add_request(a)
    s.add_request(b)
    assert sched_map(step(s)) == {"a": 7, "b": 7}
    assert sched_map(step(s)) == {"a": 1, "b": 1}          # tokens 8 fill the second blocks
    assert s.kv.pool.num_free_blocks == 0
    with caplog.at_level(logging.WARNING, logger="jaxpaged.scheduler"):
        out = step(s)
    assert out.preempted_req_ids == ["b"] and sched_map(out) == {"a": 1}
    assert s.num_preemptions == 1 and b.num_preemptions == 1
    assert f"Request b preempted by {mode} (total preemptions 1)" in caplog.text
    assert s.kv.get_block_ids("a") == [1, 2, 4]     # b freed tail first: the queue was [4, 3]
    if mode == "swap":
        assert b.status == RequestStatus.SWAPPED
        assert out.blocks_to_swap_out == [(3, 0), (4, 1)]
        assert b.num_computed_tokens == 8                   # its K/V survive on the host
    else:
        assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
        assert out.blocks_to_swap_out == []
    outs = run_all(s)
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert a.num_output_tokens == b.num_output_tokens == 6
    if mode == "swap":
        assert [o.blocks_to_swap_in for o in outs if o.blocks_to_swap_in] == [[(0, 3), (1, 4)]]
        # a: 3 more decodes; b: 4 more after swap-in, nothing recomputed (24 = 2 * (7 + 5) in all)
        assert sum(o.total_num_scheduled_tokens for o in outs) == 7
    else:
        # b recomputes its 9 tokens: 4 come back from the prefix cache (block 3 survived), 5 are computed
        assert [sched_map(o)["b"] for o in outs if "b" in sched_map(o)] == [5, 1, 1, 1]
    assert s.kv.pool.num_free_blocks == 4 and sorted(s.kv.free_cpu_blocks) == list(range(8 if mode == "swap" else 0))


def test_prefix_cache_counters_are_tokens_once_per_request():
    """vLLM's prefix_cache_queries / hits, in tokens: each request's tokens once, at its first admission. Not
    the lookups repeated while it waits for blocks, nor the one on its way back from a preemption (vLLM
    counts those apart, as preempted queries)."""
    s = make(num_blocks=5, max_num_batched_tokens=64)        # 4 blocks of 4
    a, b, c = req("a", 7, max_tokens=6), req("b", 7, max_tokens=6), req("c", 5, max_tokens=1)
    for r in (a, b, c):
        s.add_request(r)
    run_all(s)
    # c waited for blocks over several steps; b was preempted and came back with 4 tokens from the cache
    assert b.num_preemptions == 1 and s.num_preemptions == 1
    assert (s.kv.prefix_cache_queries, s.kv.prefix_cache_hits) == (7 + 7 + 5, 0)
    s = make(num_blocks=64)
    x = req("x", 10, max_tokens=2)
    s.add_request(x)
    step(s)
    s.add_request(req("y", x.prompt_token_ids, max_tokens=2))        # x's two full blocks: 8 tokens
    s.add_request(req("z", x.prompt_token_ids[:8], max_tokens=2))    # a full hit leaves its last token: 7
    run_all(s)
    assert (s.kv.prefix_cache_queries, s.kv.prefix_cache_hits) == (10 + 10 + 8, 8 + 7)
    off = make(num_blocks=64, caching=False)                          # no lookups, no counts
    off.add_request(req("x", 10, max_tokens=2))
    run_all(off)
    assert (off.kv.prefix_cache_queries, off.kv.prefix_cache_hits) == (0, 0)


def test_preempted_requests_produce_the_same_tokens():
    def tokens(num_blocks, mode):
        s = make(num_blocks=num_blocks, num_cpu_blocks=64, preemption_mode=mode, max_num_batched_tokens=32)
        rs = [req(f"r{i}", 5 + 3 * i, max_tokens=12) for i in range(5)]
        for r in rs:
            s.add_request(r)
        run_all(s)
        assert s.kv.pool.num_free_blocks == num_blocks - 1
        return [r.output_token_ids for r in rs], s.num_preemptions
    ref, n0 = tokens(200, "recompute")
    assert n0 == 0
    for mode in ("recompute", "swap"):
        got, n = tokens(9, mode)
        assert got == ref and n > 0


def validate(num_blocks=9, block_size=4, max_model_len=64):
    """The API process's checks (InputProcessor) against a core of these sizes."""
    info = CoreInfo("m", "LlamaForCausalLM", "float32", 1000, (2,), max_model_len, 8, 20, block_size, num_blocks, 1,
                    "", 0.0)
    return InputProcessor(types.SimpleNamespace(eos_token_id=None), info).validate_prompt


NEVER_FITS = "more than the whole KV cache holds: 32 tokens \\(8 blocks of 4\\), so it could never run"


def test_request_that_can_never_fit_is_refused_on_arrival():
    check = validate()                                            # 8 blocks of 4: 32 slots
    check(list(range(30)), SamplingParams(max_tokens=3))          # 32 slots: its 3rd token is never computed
    with pytest.raises(ValueError, match="needs up to 33 tokens of KV cache \\(30 in the prompt, max_tokens=4\\), "
                       + NEVER_FITS):
        check(list(range(30)), SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=NEVER_FITS):
        check(list(range(40)), SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="needs up to 63 tokens .*no max_tokens: up to max_model_len=64"):
        check(list(range(10)), SamplingParams(max_tokens=None))
    with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
        check(list(range(64)), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="maximum context length"):
        check(list(range(10)), SamplingParams(max_tokens=60))
    with pytest.raises(ValueError, match="cannot be empty"):
        check([], SamplingParams())
    with pytest.raises(ValueError, match="out of vocabulary"):
        check([5, 1000], SamplingParams())


@pytest.mark.parametrize("steps", [1, 4])
def test_max_kv_slots_is_what_a_request_needs_alone(steps):
    """A request alone on a pool of exactly max_kv_slots runs to its end, holding all of it at its peak; one
    block fewer and it never ends: what the API process refuses on arrival. With 4 decode steps per program
    a decode near the end wants slots past max_tokens and preempts the request, whose recompute (one step)
    samples a token: slower, but it ends."""
    for prompt, max_tokens in [(5, 1), (9, 2), (9, 6), (16, 10), (13, 14)]:
        slots = max_kv_slots(prompt, max_tokens, 256)
        assert slots == prompt + max_tokens - 1
        usable = -(-slots // 4)
        s = make(num_blocks=usable + 1, num_scheduler_steps=steps, max_model_len=256, max_num_batched_tokens=64)
        r = req("a", prompt, max_tokens=max_tokens)
        s.add_request(r)
        peak = 0

        def schedule(real=s.schedule):       # the blocks held once each step is scheduled
            nonlocal peak
            out = real()
            peak = max(peak, len(s.kv.get_block_ids("a")))
            return out

        s.schedule = schedule
        run_all(s)
        assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == max_tokens
        assert peak == usable, (prompt, max_tokens)
        if steps == 1:
            assert s.num_preemptions == 0
        s = make(num_blocks=usable, num_scheduler_steps=steps, max_model_len=256, max_num_batched_tokens=64)
        r = req("a", prompt, max_tokens=max_tokens)
        s.add_request(r)
        for _ in range(50):
            step(s)
        assert s.has_unfinished() and r.num_output_tokens < max_tokens, (prompt, max_tokens)
    assert max_kv_slots(10, None, 64) == 63                      # no max_tokens: up to max_model_len


def sharegpt_like(n=1000, seed=0):
    rng = np.random.default_rng(seed)
    inp = np.clip(rng.lognormal(np.log(148), 1.0, n), 4, 1024).astype(int)
    out = np.clip(rng.lognormal(np.log(123), 1.0, n), 4, 2048 - inp).astype(int)
    return inp, out, rng


def test_memory_waste_under_4_percent_on_sharegpt_like():
    inp, out, rng = sharegpt_like()
    assert (int(inp.sum()), int(out.sum())) == (215213, 199600)
    s = make(num_blocks=4096, block_size=16, max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=2048)
    for i, (n_in, n_out) in enumerate(zip(inp, out)):
        s.add_request(Request(f"r{i}", rng.integers(0, 32000, n_in).tolist(),
                              SamplingParams(max_tokens=int(n_out), ignore_eos=True), block_size=16))
    allocated = wasted = steps = 0
    while s.has_unfinished():
        step(s)
        steps += 1
        n_alloc = sum(len(s.kv.req_to_blocks.get(r.request_id, [])) * 16 for r in s.running)
        allocated += n_alloc
        wasted += s.kv.memory_waste(s.running) * n_alloc
    assert s.kv.pool.num_free_blocks == 4095
    waste = wasted / allocated
    assert waste < 0.04, waste
    print(f"sharegpt-like: {steps} steps, slot-weighted waste {waste:.4f}")


def test_n4_samples_share_the_prompt_blocks():
    """512-token prompt, n = 4, 64 new tokens, block size 16: the prompt's 32 blocks once plus each
    sample's own 4 (tokens 512..574 hold K/V; the 64th sampled token is never computed)."""
    s = make(num_blocks=200, block_size=16, max_num_batched_tokens=2048, max_model_len=2048)
    prompt = list(range(100, 612))
    kids = [Request(f"{i}_p", prompt, SamplingParams(max_tokens=64, seed=i), block_size=16) for i in range(4)]
    for k in kids:
        s.add_request(k)
    out = step(s)
    # sample 0 computes the prompt; the others share all 32 blocks and compute only the last token
    assert sched_map(out) == {"0_p": 512, "1_p": 1, "2_p": 1, "3_p": 1}
    assert all(s.kv.get_block_ids(k.request_id) == list(range(1, 33)) for k in kids)
    peak = 0
    while all(k.num_output_tokens < 63 for k in kids):
        step(s)
        peak = max(peak, 199 - s.kv.pool.num_free_blocks)
    assert peak == 32 + 4 * 4 == 48          # four copies of the prompt would be 4 * 36 = 144
    assert [len(set(s.kv.get_block_ids(k.request_id)[32:])) for k in kids] == [4, 4, 4, 4]
    run_all(s)
    assert s.kv.pool.num_free_blocks == 199


def test_request_whose_output_can_never_fit_is_refused_on_arrival():
    r = req("a", list(range(5)), max_tokens=10)                 # needs 14 slots
    check = validate(num_blocks=3)                              # 2 blocks of 4 = 8 token slots
    with pytest.raises(ValueError, match="needs up to 14 tokens of KV cache"):
        check(r.prompt_token_ids, r.sampling_params)
