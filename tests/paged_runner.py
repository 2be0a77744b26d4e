"""PagedRunner: the decoder driven one request at a time through a paged KV cache, for the model tests against HF
transformers (tests/models/) and the quantized layers' (tests/quantization/)."""
import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.models import AttentionMetadata, DecoderModel, kv_cache_shape


class PagedRunner:
    """Drives the decoder one request at a time through a paged cache with shuffled physical blocks."""

    def __init__(self, loaded, block_size=4, num_blocks=64):
        self.cfg, self.params = loaded.config, loaded.params
        self.block_size = block_size
        self.kv = jnp.zeros(kv_cache_shape(self.cfg, num_blocks, block_size), jnp.float32)
        # Physical blocks deliberately out of order; block 0 stays the null block.
        self.block_ids = list(np.random.default_rng(1).permutation(np.arange(1, num_blocks))[:16])
        self.model = DecoderModel(self.cfg, jnp.float32)
        self.apply = jax.jit(self.model.apply)       # one compile per step shape (prefill, then decode)
        self.num_computed = 0

    def meta(self, n, start=0):
        """Metadata of one request's tokens start..start+n-1 (start 0: a fresh prefill) in this runner's
        shuffled blocks."""
        pos = np.arange(start, start + n)
        slots = np.array([self.block_ids[p // self.block_size] * self.block_size + p % self.block_size
                          for p in pos])
        table = np.zeros((1, 20), np.int32)
        used = -(-(start + n) // self.block_size)
        table[0, :used] = self.block_ids[:used]
        return AttentionMetadata(jnp.asarray(pos, jnp.int32), jnp.asarray(slots, jnp.int32), jnp.asarray(table),
                                 jnp.asarray([start + n], jnp.int32), jnp.asarray([0, n], jnp.int32))

    def step(self, token_ids):
        n = len(token_ids)
        meta = self.meta(n, self.num_computed)
        # logits at every token, to compare the whole prefill
        logits, self.kv, _, _ = self.apply({"params": self.params}, jnp.asarray(token_ids, jnp.int32), self.kv,
                                        meta, jnp.arange(n, dtype=jnp.int32))
        self.num_computed += n
        return np.asarray(logits)
