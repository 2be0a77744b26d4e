"""Per-request block lists over the BlockPool: prefix-cache lookups, slot allocation, copy-on-write of a
shared partly filled block (beam forks), swap to host memory, and memory-waste accounting. With a sliding
window on every layer (Mistral), blocks that fall wholly out of a request's window go back to the pool (the
null block takes their place in its table) and a prefix-cache hit needs only the blocks inside the window,
as vLLM's sliding-window manager does. No jax."""
from __future__ import annotations

from typing import NamedTuple

from jaxpaged.engine.block_pool import BlockPool, KVCacheBlock
from jaxpaged.engine.request import Request


class ComputedBlocks(NamedTuple):
    blocks: list[KVCacheBlock]     # prefix-cache hits, in order
    num_tokens: int                # tokens they hold


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, num_cpu_blocks: int = 0,
                 sliding_window: int | None = None):
        self.block_size = block_size
        self.sliding_window = sliding_window      # every layer's window, or None (full attention)
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.blocks_to_copy: list[tuple[int, int]] = []          # (src, dst) pending copy-on-write copies
        self.free_cpu_blocks = list(range(num_cpu_blocks - 1, -1, -1))
        self.num_cpu_blocks = num_cpu_blocks
        self.swapped: dict[str, list[int | None]] = {}            # request -> host block ids (None: null)
        self.num_cached_blocks: dict[str, int] = {}               # leading blocks already registered
        self.num_dropped: dict[str, int] = {}     # leading blocks out of the window, nulled (sliding window)
        self.replaced: set[str] = set()        # requests whose earlier block ids changed (copy-on-write)
        self.prefix_cache_queries = 0          # tokens looked up in the prefix cache (count_prefix_lookup)
        self.prefix_cache_hits = 0             # tokens it served

    # ---- prefix cache -------------------------------------------------------------------------
    def _reads_prefix_cache(self, request: Request) -> bool:
        # prompt logprobs need every prompt position's logits, so such a request computes its whole prompt
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest cached prefix of full blocks. At least one token is always left to compute, since the
        step must produce logits for the request's next token.

        When every block hits (a prompt of 512 tokens, block size 16, cached whole), all 32 blocks are
        shared and only the last token is recomputed: it rewrites its own K/V (the same values) into the
        shared last block. So n samples of one prompt hold its blocks once, not the last one n times.
        """
        if not self._reads_prefix_cache(request):
            return ComputedBlocks([], 0)
        max_blocks = request.num_tokens // self.block_size
        if self.sliding_window is not None:
            return self._window_hits(request, max_blocks)
        hits: list[KVCacheBlock] = []
        for h in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return ComputedBlocks(hits, self._hit_tokens(request, hits))

    def _window_hits(self, request: Request, max_blocks: int) -> ComputedBlocks:
        """The longest prefix of n blocks whose blocks inside the window of the next token to compute are
        cached; the blocks before them may be gone (the null block stands in), as in vLLM.

        # window 20, block size 8, blocks 0-1 evicted, 2-4 cached: 5 blocks hit (the next token, position
        #   40, attends keys 21-40: blocks 2-4 and its own), returned as [null, null, b2, b3, b4]
        """
        window = self.sliding_window
        assert window is not None

        def first_needed(n: int) -> int:
            """The first block the next token attends to after a hit of n blocks."""
            next_pos = min(n * self.block_size, request.num_tokens - 1)
            return max(0, next_pos - window + 1) // self.block_size

        found = [self.pool.get_cached_block(h) for h in request.block_hashes[:max_blocks]]
        best, run = 0, 0                      # run: cached blocks ending at block i
        for i, block in enumerate(found):
            run = run + 1 if block is not None else 0
            if run >= i + 1 - first_needed(i + 1):
                best = i + 1
        start = first_needed(best)
        hits = [self.pool.null_block] * start + [b for b in found[start:best] if b is not None]
        return ComputedBlocks(hits, self._hit_tokens(request, hits))

    def count_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """vLLM's prefix cache counters, in tokens: a request admitted for the first time queried all of its
        tokens and was served num_hit_tokens of them. The scheduler calls this once per request, so the
        lookups repeated while it waits for blocks, and a preempted request's lookup on its way back (vLLM
        counts those apart, as preempted queries), are not counted again."""
        if self._reads_prefix_cache(request):
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def _hit_tokens(self, request: Request, hits: list[KVCacheBlock]) -> int:
        # 32 hits of 16 on a 512-token request -> 511: the last token is computed again for its logits
        return min(len(hits) * self.block_size, request.num_tokens - 1)

    # ---- allocation ---------------------------------------------------------------------------
    def num_blocks_needed(self, request: Request, num_new_tokens: int,
                          new_computed: list[KVCacheBlock] | None = None) -> int:
        blocks = self.req_to_blocks.get(request.request_id, [])
        new_computed = new_computed or []
        total = request.num_computed_tokens + self._hit_tokens(request, new_computed) + num_new_tokens
        return max(0, cdiv(total, self.block_size) - len(blocks) - len(new_computed))

    def append_in_place(self, request: Request, end: int) -> bool:
        """The common decode case: tokens up to `end` fit in blocks the request already owns, and the
        block the next token lands in is its own (no copy-on-write). Then registers the blocks that are
        full now and returns True; otherwise changes nothing and returns False (call allocate_slots)."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None or end > len(blocks) * self.block_size:
            return False
        if self._needs_copy_on_write(request, blocks):
            return False
        if self.enable_caching and end // self.block_size > self.num_cached_blocks.get(request.request_id, 0):
            self._cache_full_blocks(request, blocks, end)
        self._drop_out_of_window(request, blocks)
        return True

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed: list[KVCacheBlock] | None = None) -> list[KVCacheBlock] | None:
        """Blocks for `num_new_tokens` more tokens after the computed ones; None when the pool is short.

        new_computed: prefix-cache hits to attach first (the request's num_computed_tokens does not yet
        count them).
        """
        if not new_computed and self.append_in_place(request, request.num_computed_tokens + num_new_tokens):
            return []
        new_computed = new_computed or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if not new_computed:    # blocks behind the window go first: the window and the step are all it holds
            self._drop_out_of_window(request, blocks)
        num_new = self.num_blocks_needed(request, num_new_tokens, new_computed)
        cow = self._needs_copy_on_write(request, blocks) if not new_computed else False
        # Hits on free cached blocks take those blocks out of the free queue too.
        evictable_hits = sum(1 for b in new_computed if b.ref_cnt == 0)
        if num_new + int(cow) > self.pool.num_free_blocks - evictable_hits:
            return None
        self.pool.touch([b for b in new_computed if b is not self.pool.null_block])
        blocks.extend(new_computed)
        if cow:
            self._copy_on_write(request, blocks)
        fresh = self.pool.get_new_blocks(num_new)
        blocks.extend(fresh)
        self._cache_full_blocks(request, blocks, request.num_computed_tokens
                                + self._hit_tokens(request, new_computed) + num_new_tokens)
        if new_computed:        # the hits' blocks behind the window of the first token after them
            self._drop_out_of_window(request, blocks, self._hit_tokens(request, new_computed))
        return fresh

    def _drop_out_of_window(self, request: Request, blocks: list[KVCacheBlock], num_new_hits: int = 0) -> None:
        """Sliding window: the blocks whose every position precedes the window of this step's first token
        (at num_computed_tokens, plus the prefix hits just attached) go back to the pool, the null block in
        their place; a cached one stays in the prefix cache until it is evicted. The step reads the new
        table (take_replaced)."""
        if self.sliding_window is None:
            return
        first_pos = request.num_computed_tokens + num_new_hits
        end = min(max(0, first_pos - self.sliding_window + 1) // self.block_size, len(blocks))
        start = self.num_dropped.get(request.request_id, 0)
        if end <= start:
            return
        dropped = [b for b in blocks[start:end] if b is not self.pool.null_block]
        blocks[start:end] = [self.pool.null_block] * (end - start)
        self.num_dropped[request.request_id] = end
        if dropped:
            self.pool.free_blocks(dropped)
            self.replaced.add(request.request_id)

    def _needs_copy_on_write(self, request: Request, blocks: list[KVCacheBlock]) -> bool:
        idx = request.num_computed_tokens // self.block_size
        return idx < len(blocks) and blocks[idx].ref_cnt > 1

    def _copy_on_write(self, request: Request, blocks: list[KVCacheBlock]) -> None:
        """The block the next token lands in is shared and partly filled: give this request its own copy."""
        idx = request.num_computed_tokens // self.block_size
        shared = blocks[idx]
        (own,) = self.pool.get_new_blocks(1)
        self.blocks_to_copy.append((shared.block_id, own.block_id))
        self.pool.free_blocks([shared])
        blocks[idx] = own
        self.replaced.add(request.request_id)

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Register blocks that are full once this step's tokens are in (their token ids are all known)."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        start = self.num_cached_blocks.get(request.request_id, 0)
        for i in range(start, num_full):        # only the newly full ones: O(1) per step, not O(blocks)
            if blocks[i] is not self.pool.null_block:
                self.pool.cache_block(blocks[i], request.block_hashes[i])
        if num_full > start:
            self.num_cached_blocks[request.request_id] = num_full

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent (beam search); copy-on-write splits them later."""
        blocks = list(self.req_to_blocks.get(parent.request_id, []))
        self.pool.touch(blocks)
        self.req_to_blocks[child.request_id] = blocks
        self.num_cached_blocks[child.request_id] = self.num_cached_blocks.get(parent.request_id, 0)
        self.num_dropped[child.request_id] = self.num_dropped.get(parent.request_id, 0)

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.num_dropped.pop(request.request_id, None)
        self.replaced.discard(request.request_id)
        # Tail first, so the LRU queue evicts a request's last blocks before its shared prefix.
        self.pool.free_blocks(reversed(blocks))
        self.free_cpu_blocks.extend(h for h in self.swapped.pop(request.request_id, []) if h is not None)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        """The copy-on-write copies (src, dst) decided since the last call; the step runs them first."""
        copies, self.blocks_to_copy = self.blocks_to_copy, []
        return copies

    def take_replaced(self, request_id: str) -> bool:
        """Whether an earlier block id of the request changed since the last call (copy-on-write)."""
        if request_id in self.replaced:
            self.replaced.discard(request_id)
            return True
        return False

    # ---- swapping -----------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        held = [b for b in self.req_to_blocks.get(request.request_id, []) if b is not self.pool.null_block]
        return len(held) <= len(self.free_cpu_blocks)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Free the request's device blocks; returns (device block, host block) pairs to copy first. Table
        entries behind a sliding window (the null block) have no host block (None) and come back null."""
        blocks = self.req_to_blocks.pop(request.request_id)
        self.num_cached_blocks.pop(request.request_id, None)
        self.replaced.discard(request.request_id)
        null = self.pool.null_block
        host = [None if b is null else self.free_cpu_blocks.pop() for b in blocks]
        self.swapped[request.request_id] = host
        mapping = [(b.block_id, h) for b, h in zip(blocks, host) if h is not None]
        self.pool.free_blocks(reversed(blocks))
        return mapping

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Device blocks for a swapped request; returns (host block, device block) pairs, or None."""
        host = self.swapped[request.request_id]
        held = [h for h in host if h is not None]
        if len(held) > self.pool.num_free_blocks:
            return None
        fresh = iter(self.pool.get_new_blocks(len(held)))
        blocks = [self.pool.null_block if h is None else next(fresh) for h in host]
        self.req_to_blocks[request.request_id] = blocks
        del self.swapped[request.request_id]
        self.free_cpu_blocks.extend(held)
        self._cache_full_blocks(request, blocks, request.num_computed_tokens)
        return [(h, b.block_id) for h, b in zip(host, blocks) if h is not None]

    # ---- accounting ---------------------------------------------------------------------------
    def slot_usage(self, requests) -> tuple[int, int]:
        """(allocated, used) token slots of the given running requests."""
        blocks = self.req_to_blocks
        allocated = used = 0
        for r in requests:
            n = len(blocks.get(r.request_id, ())) * self.block_size
            allocated += n
            used += min(r.num_computed_tokens, n)
        return allocated, used

    def memory_waste(self, requests) -> float:
        """(allocated - used) token slots over allocated, over the given running requests."""
        allocated, used = self.slot_usage(requests)
        return 0.0 if allocated == 0 else (allocated - used) / allocated
