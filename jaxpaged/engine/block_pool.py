"""The host side of the paged KV cache: block ids, reference counts, the free queue and the prefix cache.

Plain Python; never imports jax. Block 0 is the null block: it is never handed out, padded block-table
entries point at it, and only padding tokens ever write into it.
"""
from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterable, Sequence


# Identity of a full block's contents: SHA-256 over the parent block's hash and this block's tokens, so equal
# only when the whole prefix up to this block is equal (a collision is as unlikely as SHA-256's). The digest
# alone is kept, as vLLM keeps it: a cached block outlives its request, and a copy of its tokens beside the
# hash would hold about five times the host memory per cached block, growing with the pool's cached blocks.
BlockHash = bytes


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], extra: object = None) -> BlockHash:
    """hash(parent_hash, block_token_ids): equal only when the whole prefix up to this block is equal."""
    return hashlib.sha256(pickle.dumps((parent or b"", tuple(token_ids), extra), protocol=5)).digest()


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None   # set once the block is full and cached
        self.prev_free: KVCacheBlock | None = None  # free-queue links (None when not in the queue)
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks in eviction order (LRU first), with O(1) removal from the middle.

    Freed blocks go to the tail, so the least recently used cached block is evicted first. A prefix-cache
    hit on a free block takes it out of the middle in O(1).
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        self._head = KVCacheBlock(-1)   # sentinels keep the link updates branch-free
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        if self.num_free_blocks == 0:
            raise ValueError("no free blocks")
        block = self._head.next_free
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        out, b = [], self._head.next_free
        while b is not self._tail:
            out.append(b.block_id)
            b = b.next_free
        return out


class BlockPool:
    """All KV blocks of the pool. `get_new_blocks` evicts cached free blocks in LRU order."""

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1            # never free, never handed out
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of allocatable blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (removing free ones from the queue)."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def get_new_blocks(self, num: int) -> list[KVCacheBlock]:
        if num > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num} blocks: {self.num_free_blocks} free")
        out = []
        for _ in range(num):
            b = self.free_queue.popleft()
            self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full block under its hash (a no-op when an equal block is already cached)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching zero go to the free queue's tail (most recently used).

        Callers pass a request's blocks in reverse order, so a request's tail blocks are evicted before
        its head blocks, which other prompts are more likely to share.
        """
        for b in blocks:
            if b is self.null_block:
                continue
            b.ref_cnt -= 1
            if b.ref_cnt < 0:
                raise AssertionError(f"double free of block {b.block_id}")
            if b.ref_cnt == 0:
                if b.block_hash is None or not self.enable_caching:
                    self._evict(b)
                self.free_queue.append(b)

    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for b in list(self.cached.values()):
            b.block_hash = None
        self.cached.clear()
        return True
