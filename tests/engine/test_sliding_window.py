"""A sliding window on every layer (Mistral): blocks that fall wholly behind a request's window go back to the
pool (the null block takes their place in its table), a prefix-cache hit needs only the blocks inside the
window, and a request longer than the whole pool runs when its window fits, with HF's greedy tokens."""
import numpy as np
import torch

from jaxpaged.engine.kv_cache_manager import KVCacheManager
from jaxpaged.engine.request import Request
from jaxpaged.sampling_params import SamplingParams

BS = 4


def req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=64), block_size=BS)


def step(kv, r, n):
    """The scheduler's allocation of n more tokens (first admission: prefix hits first)."""
    hit = kv.get_computed_blocks(r) if r.num_computed_tokens == 0 else None
    new = kv.allocate_slots(r, n - (hit.num_tokens if hit else 0), hit.blocks if hit else None)
    assert new is not None
    r.num_computed_tokens += n
    return hit


def test_blocks_behind_the_window_return_to_the_pool():
    kv = KVCacheManager(num_blocks=12, block_size=BS, sliding_window=6)
    r = req("a", range(40))
    step(kv, r, 8)                                   # positions 0-7: blocks 1, 2
    assert kv.get_block_ids("a") == [1, 2] and kv.pool.num_free_blocks == 9
    free = []
    for _ in range(16):                              # chunks of 2 tokens up to position 39
        step(kv, r, 2)
        free.append(kv.pool.num_free_blocks)
        first = r.num_computed_tokens - 2           # this step's first token attends keys first - 5 ..
        ids = kv.get_block_ids("a")
        assert all(b == 0 for b in ids[:max(0, first - 5) // BS])        # behind the window: the null block
        assert all(b != 0 for b in ids[max(0, first - 5) // BS:])
    assert len(kv.get_block_ids("a")) == 10          # 40 positions, 10 table entries ...
    assert sum(b != 0 for b in kv.get_block_ids("a")) <= 3                # ... at most 3 blocks held
    assert max(free) == free[-1] >= 8 and kv.take_replaced("a")
    kv.free(r)
    assert kv.pool.num_free_blocks == 11


def test_a_prefix_hit_needs_only_the_blocks_inside_the_window():
    kv = KVCacheManager(num_blocks=16, block_size=BS, sliding_window=6)
    a = req("a", range(24))
    step(kv, a, 24)                                  # all 6 blocks cached
    kv.free(a)
    for i in (0, 1, 2):                              # evict the first three blocks' hashes
        kv.pool._evict(kv.pool.get_cached_block(a.block_hashes[i]))
    b = req("b", list(range(24)) + [99])
    hit = kv.get_computed_blocks(b)
    # the next token (position 24) attends keys 19-24: blocks 4-5 and its own; blocks 0-3 may be gone
    cached = [kv.pool.get_cached_block(h) for h in a.block_hashes]
    assert hit.num_tokens == 24
    assert hit.blocks == [kv.pool.null_block] * 4 + cached[4:]
    kv.pool._evict(cached[4])                        # a block inside the window gone: no hit reaches past it
    assert kv.get_computed_blocks(b).num_tokens < 16


def test_a_request_longer_than_the_pool_runs_within_its_window(tmp_path):
    """Tiny Mistral (window 40) with 9 blocks of 8 tokens: a 130-token prompt and 32 more tokens (162 positions,
    over twice the pool) run in chunks of 16, and equal HF's greedy continuation. 72 slots is what a windowed
    request holds at most (the window, a chunk and two partial blocks): the blocks behind the window go back
    before a step's new ones are taken."""
    from conftest import save_tiny_model
    from jaxpaged import LLM
    hf = save_tiny_model("mistral", tmp_path, initializer_range=0.2)
    import shutil

    from jaxpaged.engine.llm_engine import resolve_model_path
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{resolve_model_path(None)}/{f}", tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", max_model_len=256, block_size=8, max_num_batched_tokens=16,
              num_gpu_blocks_override=10, seed=0)
    prompt = np.random.default_rng(3).integers(0, 320, 130).tolist()
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)[0]
    gen = list(out.outputs[0].token_ids)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + gen])).logits[0, len(prompt) - 1:-1]
    assert gen == logits.argmax(-1).tolist()
    pool = llm.llm_engine.kv_manager.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_swapping_keeps_only_the_blocks_inside_the_window():
    kv = KVCacheManager(num_blocks=12, block_size=BS, sliding_window=6, num_cpu_blocks=4)
    r = req("a", range(40))
    step(kv, r, 8)
    for _ in range(8):
        step(kv, r, 2)                               # up to position 23: blocks 0-3 behind the window
    ids = kv.get_block_ids("a")
    held = [b for b in ids if b != 0]
    assert kv.can_swap_out(r) and len(held) < len(ids)
    out = kv.swap_out(r)
    assert [d for d, _ in out] == held and kv.pool.num_free_blocks == 11
    back = kv.swap_in(r)
    ids_back = kv.get_block_ids("a")
    assert len(back) == len(held) and [b == 0 for b in ids_back] == [b == 0 for b in ids]
    kv.free(r)
    assert kv.pool.num_free_blocks == 11 and len(kv.free_cpu_blocks) == 4


def test_blocks_behind_the_window_go_back_before_a_step_takes_new_ones():
    """4 usable blocks, window 6, chunks of 8: the third chunk (positions 16-23) needs 2 new blocks, and only the
    2 behind its window (positions 0-7) can give them."""
    kv = KVCacheManager(num_blocks=5, block_size=BS, sliding_window=6)
    r = req("a", range(24))
    step(kv, r, 8)
    step(kv, r, 8)
    assert kv.pool.num_free_blocks == 0
    step(kv, r, 8)
    assert kv.get_block_ids("a")[:2] == [0, 0] and kv.pool.num_free_blocks == 0
