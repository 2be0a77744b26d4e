"""The platform switch, case descriptions and inputs shared by the kernel tests in this folder.

Every test class here runs on either platform, its test bodies the same on both:

  CPU  INTERPRET = True: the Triton kernels in Pallas interpret mode, the Mosaic GPU kernels in JAX's
       Mosaic GPU interpreter; small shapes only (interpret mode runs the grid one program at a time).
  GPU  INTERPRET = False: the compiled kernels on the same small shapes, plus the real sizes
       (`gpu_only(...)` cases: the head layouts of qwen2-0.5b and llama3-8b, 64 requests of up to 4k tokens,
       mixed prefill chunks and decodes) that bench/bench_kernels.py's check part used to cover.

On the GPU run `JAX_PLATFORMS=cuda python -m pytest tests/kernels` (tests/conftest.py defaults
JAX_PLATFORMS to cpu), from a folder where the installed jaxpaged is the one imported.

Inputs are fresh random numbers for each case (never zeros), seeded from the case's id (`Case.rng`), so a
failure reproduces. Interpret mode fills every kernel output with NaN before the kernel runs (Pallas
poisons uninitialised outputs; the Mosaic GPU interpreter does with uninitialized_memory="nan"), so an
element a kernel forgets to write shows up as NaN: the checks assert every element finite and close.
"""
from __future__ import annotations

import os

# The Mosaic GPU interpreter runs each simulated warpgroup on an XLA CPU worker thread that blocks while it
# waits on a barrier: with the default pool (one thread per core) a 2-core machine deadlocks. The pool size
# is read once, when the CPU backend starts, so it is raised here, before INTERPRET below starts it (every
# module of this folder imports this one first). Harmless on the GPU (the CPU client's thread pool).
_NPROC_PRESET = "PJRT_NPROC" in os.environ or "NPROC" in os.environ
os.environ.setdefault("PJRT_NPROC", "8")

import dataclasses  # noqa: E402
import math  # noqa: E402
import zlib  # noqa: E402
from typing import NamedTuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax._src import xla_bridge  # noqa: E402

from jaxpaged import pallas_kernels as pk  # noqa: E402  (jaxpaged.envs sets allocator defaults first)

_STARTED_EARLY = xla_bridge.backends_are_initialized()
INTERPRET = jax.default_backend() == "cpu"
# The CPU backend started before this module could raise its pool (another test module ran first) on a
# small machine: the Mosaic GPU interpreter tests run in a fresh process instead (test_mosaic_gpu.py).
POOL_TOO_SMALL = INTERPRET and _STARTED_EARLY and not _NPROC_PRESET and (os.cpu_count() or 1) < 4

LAYER = 1                  # every pool has 2 layers; the kernels read the second (a non-zero layer offset)
# Relative error (norm) of the Triton kernels against their references: f32 runs IEEE dots
# (Precision.HIGHEST), bf16 rounds q, K, V and the probabilities.
TOL = {"float32": 1e-5, "bfloat16": 1e-2}


def gpu_only(cases) -> list:
    """The real-size cases: compiled kernels only (interpret mode would take hours on them)."""
    return [] if INTERPRET else list(cases)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Block size, head layout and dtype of a case."""
    block_size: int
    head_dim: int
    num_heads: int
    num_kv_heads: int
    dtype: str
    name: str = ""                      # the model whose layout it is, for the real sizes

    @property
    def id(self) -> str:
        dims = f"S{self.block_size}-D{self.head_dim}-N{self.num_heads}-K{self.num_kv_heads}-{self.dtype}"
        return f"{self.name}-{dims}" if self.name else dims


# (block size, head dim, query heads, kv heads, dtype) of the small cases: block sizes 8/16/32, head dims
# 64/128, GQA ratios 1/2/4/7/8, both dtypes.
SMALL_LAYOUTS = (Layout(8, 64, 4, 4, "float32"), Layout(16, 128, 8, 4, "bfloat16"), Layout(32, 64, 8, 2, "float32"),
                 Layout(16, 64, 14, 2, "bfloat16"), Layout(8, 128, 16, 2, "float32"), Layout(16, 64, 7, 1, "float32"))
# The head layouts of bench/bench_kernels.py (LAYOUTS) at the engine's block size, bf16.
REAL_LAYOUTS = (Layout(16, 64, 14, 2, "bfloat16", "qwen2-0.5b"), Layout(16, 128, 32, 8, "bfloat16", "llama3-8b"))


@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """One query token per request, seq_lens[r] tokens of context (this step's included)."""
    name: str
    max_blocks: int                       # M: block-table columns
    seq_lens: tuple[int, ...] = ()
    num_random: int = 0                   # instead: this many lengths in [1, M * S], request 3 a padding one
    full_tables: bool = False             # every table entry a real block, past seq_lens too (see make_tables)

    def lens(self, rng, block_size: int) -> np.ndarray:
        if not self.num_random:
            return np.asarray(self.seq_lens)
        lens = rng.integers(1, self.max_blocks * block_size + 1, self.num_random)
        lens[3] = 0
        return lens


# 64 requests of 1..4096 tokens of context, one a padding request (seq_len 0): the size bench_kernels.py
# checked at before these tests ran on the GPU.
REAL_DECODE = DecodeBatch("64x4k", max_blocks=4096 // 16, num_random=64, full_tables=True)


@dataclasses.dataclass(frozen=True)
class RaggedBatch:
    """Requests of q_lens new tokens after ctx_lens cached ones, then pad_tokens of bucket padding."""
    name: str
    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]
    pad_tokens: int
    full_tables: bool = False


def mixed_batch(block_size: int) -> RaggedBatch:
    """A decode, a prefill from position 0, a chunk starting mid-sequence (not block aligned), a padding
    request (q_len 0, seq_len 0), a chunk ending exactly on a block, and 5 bucket-padding tokens."""
    return RaggedBatch("mixed", (1, 2 * block_size + 3, 11, 0, block_size),
                       (3 * block_size + 2, 0, block_size + 5, 0, 2 * block_size), 5)


# Three prefill chunks (from position 0, mid-sequence, up to 5k tokens) and 40 decodes of random context
# (a fixed draw), 37 padding tokens: the size bench_kernels.py checked at before.
_DECODE_CTX = tuple(int(x) for x in np.random.default_rng(4096).integers(1, 4096, 40))
REAL_RAGGED = RaggedBatch("3chunks+40decodes", (700, 513, 1000) + (1,) * 40, (0, 1024, 4095) + _DECODE_CTX, 37,
                          full_tables=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """A layout, a batch and the attention options of one parametrized run; subclasses add kernel knobs."""
    layout: Layout
    batch: DecodeBatch | RaggedBatch
    sliding_window: int | None = None
    soft_cap: float | None = None
    alibi: bool = False             # ALiBi slopes, one per query head (spread 0.05 .. 0.6)

    @property
    def id(self) -> str:
        opts = "".join(f"-{k}{v}" for k, v in (("window", self.sliding_window), ("cap", self.soft_cap)) if v)
        return f"{self.layout.id}-{self.batch.name}{opts}" + ("-alibi" if self.alibi else "")

    @property
    def opts(self) -> dict:
        slopes = jnp.linspace(0.05, 0.6, self.layout.num_heads, dtype=jnp.float32) if self.alibi else None
        return dict(sliding_window=self.sliding_window, soft_cap=self.soft_cap, alibi_slopes=slopes)

    def rng(self) -> np.random.Generator:
        return seeded_rng(f"{type(self).__name__}/{self.id}")


def case_id(case) -> str:
    return case.id


def seeded_rng(name: str) -> np.random.Generator:
    """Deterministic random numbers for the case `name` (crc32 of it: hash() of a str is salted per process)."""
    return np.random.default_rng(zlib.crc32(name.encode()))


# ------------------------------------------------------------------------------------------------- inputs
def normal(rng, shape, dtype) -> jax.Array:
    """Standard normal numbers: NumPy's for small arrays; on the device (jax.random, keyed from rng) past
    4M elements, where NumPy would take seconds for a real-size pool."""
    if math.prod(shape) <= 1 << 22:
        return jnp.asarray(rng.standard_normal(shape), dtype)
    return jax.random.normal(jax.random.key(int(rng.integers(1 << 31))), shape, dtype)


def make_pool(rng, num_layers, num_blocks, layout: Layout) -> jax.Array:
    """dtype[L, 2, B, K, S, D], random everywhere (the null block too)."""
    return normal(rng, (num_layers, 2, num_blocks, layout.num_kv_heads, layout.block_size, layout.head_dim),
                  layout.dtype)


SPARE_BLOCKS = 5            # pool blocks besides the null block that no table points at


def make_tables(rng, max_blocks, seq_lens, block_size, full=False) -> tuple[jax.Array, int]:
    """(i32[R, M] block tables, B the pool's block count): distinct random blocks for each request's used
    blocks; the unused tail points at the null block 0, or with `full` at more distinct blocks (as a table
    the engine reuses: the kernel must stop at seq_lens, and a padding request's blocks are real ones).
    The pool is just big enough (the Mosaic GPU interpreter's time grows with it)."""
    used = np.arange(max_blocks)[None, :] < -(-np.asarray(seq_lens)[:, None] // block_size)
    if full:
        used[:] = True
    num_blocks = int(used.sum()) + 1 + SPARE_BLOCKS
    tables = np.zeros(used.shape, np.int32)
    tables[used] = rng.permutation(np.arange(1, num_blocks))[: used.sum()]
    return jnp.asarray(tables), num_blocks


class DecodeInputs(NamedTuple):
    q: jax.Array              # dtype[R, N, D]
    kv_cache: jax.Array       # dtype[2, 2, B, K, S, D]
    block_tables: jax.Array   # i32[R, M]
    seq_lens: jax.Array       # i32[R]

    @property
    def args(self) -> tuple:
        """The decode arguments, layer LAYER: (q, kv_cache, layer, block_tables, seq_lens)."""
        return self.q, self.kv_cache, jnp.int32(LAYER), self.block_tables, self.seq_lens


def decode_inputs(rng, layout: Layout, batch: DecodeBatch) -> DecodeInputs:
    seq_lens = batch.lens(rng, layout.block_size)
    tables, num_blocks = make_tables(rng, batch.max_blocks, seq_lens, layout.block_size, batch.full_tables)
    pool = make_pool(rng, 2, num_blocks, layout)
    q = normal(rng, (len(seq_lens), layout.num_heads, layout.head_dim), layout.dtype)
    return DecodeInputs(q, pool, tables, jnp.asarray(seq_lens, jnp.int32))


class RaggedInputs(NamedTuple):
    q: jax.Array                # dtype[T, N, D]
    kv_cache: jax.Array         # dtype[2, 2, B, K, S, D]
    block_tables: jax.Array     # i32[R, M]
    seq_lens: jax.Array         # i32[R]
    query_start_loc: jax.Array  # i32[R + 1]
    num_real_tokens: int        # tokens past this are bucket padding: their output must be zeros

    @property
    def args(self) -> tuple:
        """The attention arguments, layer LAYER: (q, kv_cache, layer, block_tables, seq_lens, query_start_loc)."""
        return self.q, self.kv_cache, jnp.int32(LAYER), self.block_tables, self.seq_lens, self.query_start_loc


def ragged_inputs(rng, layout: Layout, batch: RaggedBatch) -> RaggedInputs:
    q_lens = np.asarray(batch.q_lens)
    seq_lens = q_lens + np.asarray(batch.ctx_lens)
    max_blocks = -(-int(seq_lens.max()) // layout.block_size) + 2        # + two padding columns
    tables, num_blocks = make_tables(rng, max_blocks, seq_lens, layout.block_size, batch.full_tables)
    pool = make_pool(rng, 2, num_blocks, layout)
    num_real = int(q_lens.sum())
    q = normal(rng, (num_real + batch.pad_tokens, layout.num_heads, layout.head_dim), layout.dtype)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    return RaggedInputs(q, pool, tables, jnp.asarray(seq_lens, jnp.int32), qsl, num_real)


def bad_inputs(bad: str) -> tuple:
    """(q, kv_cache, block_tables, seq_lens, query_start_loc) with one thing wrong, as `bad` names it."""
    q = jnp.ones((2, 8, 64), jnp.float32)
    pool = jnp.ones((1, 2, 4, 2, 16, 64), jnp.float32)
    tables = jnp.zeros((2, 3), jnp.int32)
    if bad == "heads":
        q = jnp.ones((2, 7, 64), jnp.float32)
    elif bad == "dtype":
        q = q.astype(jnp.bfloat16)
    elif bad == "tables":
        tables = jnp.zeros((3, 3), jnp.int32)
    elif bad == "head_dim":
        q, pool = jnp.ones((2, 8, 48), jnp.float32), jnp.ones((1, 2, 4, 2, 16, 48), jnp.float32)
    return q, pool, tables, jnp.ones((2,), jnp.int32), jnp.arange(3, dtype=jnp.int32)


BAD_INPUTS = ["heads", "dtype", "tables", "head_dim"]


# --------------------------------------------------------------------------------------------- references
def reference(fn, *args, **kwargs):
    """fn(*args, **kwargs) with f32 matmuls at full precision: on the GPU XLA's default runs them in TF32
    (about 1e-3 relative), too coarse for the f32 cases' 1e-5. A no-op on the CPU, exact there already."""
    with jax.default_matmul_precision("highest"):
        return fn(*args, **kwargs)


def chunked_reference(q, kv_cache, layer_idx, block_tables, seq_lens, query_start_loc, **kwargs):
    """The XLA path in f32, for the real sizes: ragged_paged_attention_reference gathers every token's whole
    block table (T * M * S * K * D elements: 24 GB for llama3-8b's REAL_RAGGED)."""
    return pk.ragged_paged_attention_xla(q.astype(jnp.float32), kv_cache.astype(jnp.float32), layer_idx,
                                         block_tables, seq_lens, query_start_loc, **kwargs)


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref||, in float64."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def max_rel_err(out, ref) -> float:
    """max |out - ref| / max |ref|: the Mosaic GPU tests' measure."""
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def lowered_calls(fn, *args, names=("__gpu$xla.gpu.triton",)) -> tuple[int, ...]:
    """How many custom calls of each name fn(*args) holds, lowered for CUDA (no GPU needed)."""
    from jax import export
    checks = [export.DisabledSafetyCheck.custom_call(n) for n in names]
    text = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()
    return tuple(text.count(n) for n in names)
