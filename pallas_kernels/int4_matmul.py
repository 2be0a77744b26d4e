"""W4A16: x @ W with W in 4-bit groups, unpacked inside a Pallas (Triton) kernel, with a plain-jnp reference.

Legend: M rows of x (tokens), K input features, N output features, G group size (input rows sharing one
scale and zero point per column), NS splits of K.

Weights are affine per group and column, in one of two forms that cover the int4 formats jaxpaged loads:
    zero points:  W[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n],   q in 0..15
    offsets:      W[k, n] = q[k, n] * scales[k // G, n] + mins[k // G, n]
Zero points: AWQ and asymmetric GPTQ store theirs, symmetric GPTQ's is 8. Every format stores them as 4-bit
integers, and they are held so, as uint8: the kernels compute with the checkpoint's zeros, not a rounded
-zero * scale, and the GEMV kernel builds its float operands from their bits (its 2**23 trick and its float16
pairs below), with no float conversion.
Offsets: GGUF's 4-bit blocks (Q4_0, Q4_1, Q4_K; jaxpaged/quantization/gguf_blocks.py), whose offset is a
float of its own (Q4_1's m, Q4_K's -dmin * min), held in float32 with their scales so that q * scale + min is
the file's weight exactly. The loaders repack each format into one device layout, declared here:

    qweight: i32[K/8, N]        slab t (input rows 128t..128t+127) is int32 rows 16t..16t+15; nibble j
                                (bits 4j..4j+3) of row 16t + r holds q of input row 128t + 16j + r
    scales, mins: dtype[K/G, N]; zeros: u8[K/G, N]

Why this order: nibble j of a slab's 16 int32 rows is 16 consecutive input rows, so one shift and mask of
the loaded [16, BN] tile is a ready [16, BN] operand of a tensor-core dot against x's matching 16
columns. No register shuffles, and the kernel reads a quarter of the bf16 bytes.

8-bit values (bits=8: GGUF's 5-, 6- and 8-bit types repacked, see gguf_blocks.int8_parts) take the same
layout with bytes for nibbles: i32[K/4, N], slab t is input rows 64t..64t+63, byte j of row 16t + r holds q
of input row 64t + 16j + r, q in 0..255; the kernels are the same code with the width as a parameter (the
GEMV in its f32 form), and read half of bf16's bytes.

Two kernels. Up to GEMV_MAX_ROWS rows (one decode row), the GEMV kernel, grid (N tiles, NS): no
tensor-core dot (whose operand layouts would cost more than the multiplies), one FMA per weight and row into
a [16, BN] accumulator, scaled once per group (its f32 form); a bf16 or fp16 row takes its f16x2 form, two
weights an instruction in float16 pairs (described above _int4_gemv_f16x2_kernel). More rows, the dot
kernel, grid (M tiles, N tiles, NS): per group the dot of x with the raw 4-bit values, then
sum_k x_k (q_k - z) s = s * (x . q - z * sum_k x_k) (offsets: s * (x . q) + m * sum_k x_k).
Each program walks its share of K's 128-row slabs. With NS > 1 each split writes f32 partial
sums and the caller's sum over splits is a small XLA reduction that fuses into whatever consumes the
output (a residual add, the SiLU).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_NIBBLE_ROWS = 16        # input rows of one value position of a slab (a tensor-core dot's K)
BITS = (4, 8)


def slab_rows(bits: int = 4) -> int:
    """Input rows of one packed slab: 16 int32 rows x (32 / bits) values a word (128 for 4 bits, 64 for 8)."""
    return _NIBBLE_ROWS * (32 // bits)


PACK_ROWS = slab_rows(4)  # the 4-bit slab


def check_group_size(in_features: int, group_size: int, bits: int = 4) -> str | None:
    """Why (K, G) cannot use this layout, or None: K a multiple of the slab (128 rows, 64 for 8 bits); G 16, 32,
    64 or a multiple of the slab that divides K."""
    slab = slab_rows(bits)
    if in_features % slab:
        return f"input features {in_features} not a multiple of {slab}"
    if group_size in (16, 32, 64) or (group_size % slab == 0 and in_features % group_size == 0):
        return None
    return f"group size {group_size} (supported: 16, 32, 64, or a multiple of {slab} dividing {in_features})"


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """Values u8[K, N] of `bits` bits -> i32[K * bits / 32, N] in the layout above (host side, at load)."""
    k, n = q.shape
    slab, per_word = slab_rows(bits), 32 // bits
    if k % slab:
        raise ValueError(f"input features {k} not a multiple of {slab}")
    # [K, N] -> [slab, value position j, row r, N]; int32 row (slab, r) = sum_j q[slab, j, r] << (bits j)
    q = q.astype(np.uint32).reshape(k // slab, per_word, _NIBBLE_ROWS, n)
    packed = np.zeros((k // slab, _NIBBLE_ROWS, n), np.uint32)
    for j in range(per_word):
        packed |= q[:, j] << np.uint32(bits * j)
    return packed.reshape(k // per_word, n).view(np.int32)


def pack_int4(q: np.ndarray) -> np.ndarray:
    """4-bit values u8[K, N] (0..15) -> i32[K/8, N]."""
    return pack_bits(q, 4)


def unpack_bits(qweight, bits: int = 4) -> jax.Array:
    """i32[K * bits / 32, N] -> the values i32[K, N] (jnp; the references and the large-M path)."""
    rows, n = qweight.shape
    per_word = 32 // bits
    slabs = qweight.reshape(rows // _NIBBLE_ROWS, 1, _NIBBLE_ROWS, n)
    shifts = (bits * jnp.arange(per_word, dtype=jnp.int32)).reshape(1, per_word, 1, 1)
    return ((slabs >> shifts) & ((1 << bits) - 1)).reshape(rows * per_word, n)


def unpack_int4(qweight) -> jax.Array:
    """i32[K/8, N] -> the 4-bit values i32[K, N]."""
    return unpack_bits(qweight, 4)


def _affine(zeros, mins):
    """(the zeros or mins operand, whether it holds offsets): exactly one of the two forms, zeros as integers."""
    if (zeros is None) == (mins is None):
        raise ValueError("give the zero points (zeros) or the offsets (mins), one of the two")
    if mins is None and not jnp.issubdtype(zeros.dtype, jnp.integer):
        raise ValueError(f"zeros are the checkpoint's integer zero points (uint8), not {zeros.dtype}")
    return (zeros, False) if mins is None else (mins, True)


def dequantize_int4(qweight, scales, zeros=None, dtype=jnp.float32, *, mins=None, bits: int = 4) -> jax.Array:
    """The dense weight dtype[K, N], per group (q - zero) * scale, or q * scale + min; computed in f32."""
    b, offsets = _affine(zeros, mins)
    q = unpack_bits(qweight, bits).astype(jnp.float32)
    groups = scales.shape[0]
    q = q.reshape(groups, q.shape[0] // groups, -1)
    s, b = scales.astype(jnp.float32)[:, None], b.astype(jnp.float32)[:, None]
    w = q * s + b if offsets else (q - b) * s
    return w.reshape(-1, w.shape[-1]).astype(dtype)


def int4_matmul_reference(x, qweight, scales, zeros=None, *, mins=None, bits: int = 4) -> jax.Array:
    """Plain jnp, f32 math: x dtype[M, K] -> dtype[M, N]."""
    w = dequantize_int4(qweight, scales, zeros, mins=mins, bits=bits)
    return jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST).astype(x.dtype)


def _int4_kernel(x_ref, w_ref, s_ref, z_ref, o_ref, *, group_size, slabs_per_split, block_m, block_n,
                 offsets, bits):
    # x_ref: dtype[M, K]
    # w_ref: i32[K/8, N]
    # s_ref: dtype[K/G, N]
    # z_ref: u8[K/G, N], the zero points, or with offsets the mins dtype[K/G, N]
    # o_ref: dtype[M, N] (one split) or f32[NS, M, N] (this split's partial sums)
    im, jn, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_rows = x_ref.shape[0]
    rows = im * block_m + jax.lax.broadcasted_iota(jnp.int32, (block_m, _NIBBLE_ROWS), 0)
    row_ok = rows < num_rows
    cols = pl.ds(jn * block_n, block_n)
    precision = jax.lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None
    slab_len, per_word, mask = slab_rows(bits), 32 // bits, (1 << bits) - 1
    groups_per_slab = max(1, slab_len // group_size)
    nibbles_per_group = per_word // groups_per_slab

    def body(i, acc):
        slab = split * slabs_per_split + i
        w = w_ref[pl.ds(slab * _NIBBLE_ROWS, _NIBBLE_ROWS), cols]                       # [16, BN] i32
        for g in range(groups_per_slab):
            part = jnp.zeros((block_m, block_n), jnp.float32)
            x_sum = jnp.zeros((block_m,), jnp.float32)
            for j in range(g * nibbles_per_group, (g + 1) * nibbles_per_group):
                xj = plgpu.load(x_ref.at[pl.ds(im * block_m, block_m),
                                         pl.ds(slab * slab_len + j * _NIBBLE_ROWS, _NIBBLE_ROWS)],
                                mask=row_ok, other=0.0)                                  # [BM, 16]
                qj = ((w >> (bits * j)) & mask).astype(xj.dtype)                         # [16, BN]
                part += plgpu.dot(xj, qj, precision=precision)
                x_sum += jnp.sum(xj.astype(jnp.float32), axis=1)
            group_row = (slab * slab_len + g * group_size) // group_size
            s = s_ref[group_row, cols].astype(jnp.float32)                               # [BN]
            z = z_ref[group_row, cols].astype(jnp.float32)
            if offsets:
                acc += part * s[None, :] + x_sum[:, None] * z[None, :]
            else:
                acc += (part - x_sum[:, None] * z[None, :]) * s[None, :]
        return acc

    acc = jax.lax.fori_loop(0, slabs_per_split, body, jnp.zeros((block_m, block_n), jnp.float32))
    out_rows = im * block_m + jax.lax.broadcasted_iota(jnp.int32, (block_m, block_n), 0)
    if len(o_ref.shape) == 2:
        plgpu.store(o_ref.at[pl.ds(im * block_m, block_m), cols], acc.astype(o_ref.dtype),
                    mask=out_rows < num_rows)
    else:
        plgpu.store(o_ref.at[split, pl.ds(im * block_m, block_m), cols], acc, mask=out_rows < num_rows)


# Rows up to which the GEMV kernel runs (no tensor-core dot: each row keeps its own accumulator), beyond them
# the dot kernel. One: from a few rows on, the dot kernel's 16-row tile is faster than a GEMV that repeats its
# arithmetic per row (bench_matmul.py; bench/results/NOTES.md has the figures of this and the constants below).
GEMV_MAX_ROWS = 1
# Warps of the GEMV kernel: one per 16 columns of a program, eight words of the [16, BN] tile a thread.
GEMV_COLUMNS_PER_WARP = 16


def gemv_warps(block_n: int) -> int:
    """The GEMV kernel's warps for a program of block_n columns."""
    return max(1, block_n // GEMV_COLUMNS_PER_WARP)


# Warps per SM the GEMV's splits of K aim at: eight programs of 4 warps (64 columns), four of 8 (128 columns).
GEMV_WARPS_PER_SM = 32
# The f16x2 form's columns a program: 128 on 8 warps, four programs per SM, ran llama3-8b's layers faster than 64
# on 4 warps. 256 on 8 warps did not: Triton then gives each thread 4 of the tile's rows, doubling x's work.
GEMV_F16X2_COLUMNS = 128
# The bits of the float 2**23: OR-ing a 4-bit q into its lowest mantissa bits gives the float 2**23 + q, so
# subtracting 2**23 + zero leaves q - zero exactly, without an int -> float conversion (a slow instruction).
# A nibble need not be shifted down first: at bits b..b+3 (b + 4 <= 23, inside the mantissa) the same OR
# gives 2**23 + q * 2**b, and subtracting 2**23 + zero * 2**b leaves (q - zero) * 2**b, which x's element
# times 2**-b turns back into x * (q - zero) exactly (whole numbers below 2**24, powers of two). So nibbles
# 0-4 of a word are masked in place and 5-7 after one shift by 20: one shift per word, not one per nibble
# (8-bit values alike: bytes 0-1 in place, 2-3 after a shift by 16). Why it matters: by count, the integer
# instructions (shift, and, or: about three a weight, on Hopper's half-rate integer pipe) bound this kernel
# before its bytes do.
_MAGIC_BITS = 0x4B000000
_MAGIC = 8388608.0


def _in_place(bits: int) -> int:
    """Values of a word masked in place (at bits b..b+bits-1 with b + bits <= 23): 5 nibbles, or 2 bytes."""
    return (23 - bits) // bits + 1


def _nibble_source(j: int, bits: int = 4) -> tuple[bool, int]:
    """Where value j of a word is masked: (from the word shifted right by bits * _in_place(bits), bit offset
    there)."""
    n = _in_place(bits)
    return (False, bits * j) if j < n else (True, bits * (j - n))


def _int4_gemv_kernel(x_ref, w_ref, s_ref, z_ref, o_ref, *, group_size, slabs_per_split, block_n,
                      slabs_per_iter, offsets, bits):
    # x_ref: dtype[M, K], M <= GEMV_MAX_ROWS
    # w_ref: i32[K/8, N]
    # s_ref: dtype[K/G, N]
    # z_ref: u8[K/G, N], the zero points, or with offsets the mins dtype[K/G, N]
    # o_ref: dtype[M, N] (one split) or f32[NS, M, N] (this split's partial sums)
    # Each row of x accumulates x_k * (q_k - z) into a [16, BN] tile (one FMA per weight, no dot), scaled once
    # per group; the 16 rows of the tile are summed at the end. With offsets the tile takes x_k * q_k, and a
    # [1, BN] accumulator per row takes min * sum_k x_k per group. Each iteration loads slabs_per_iter slabs
    # before it computes on any: more bytes in flight per program.
    jn, split = pl.program_id(0), pl.program_id(1)
    num_rows = x_ref.shape[0]
    cols = pl.ds(jn * block_n, block_n)
    slab_len, mask = slab_rows(bits), (1 << bits) - 1
    groups_per_slab = max(1, slab_len // group_size)
    nibbles_per_group = (32 // bits) // groups_per_slab
    tile = (_NIBBLE_ROWS, block_n)

    def slab_step(slab, w, accs, offs):
        w_high = w >> (bits * _in_place(bits))             # (arithmetic: the sign bits land above, masked off)
        for g in range(groups_per_slab):
            group_row = (slab * slab_len + g * group_size) // group_size
            s = s_ref[group_row, cols].astype(jnp.float32)[None, :]                      # [1, BN]
            z = z_ref[group_row, cols][None, :]                                          # [1, BN]
            zb: dict[int, jax.Array] = {}                                                 # 2**23 + z 2**b
            parts = [jnp.zeros(tile, jnp.float32) for _ in range(num_rows)]
            x_sums = [jnp.zeros((), jnp.float32) for _ in range(num_rows)]
            for j in range(g * nibbles_per_group, (g + 1) * nibbles_per_group):
                high, b = _nibble_source(j, bits)
                if b not in zb:
                    zb[b] = (jnp.full(z.shape, _MAGIC, jnp.float32) if offsets else
                             jax.lax.bitcast_convert_type((z.astype(jnp.int32) << b) | _MAGIC_BITS, jnp.float32))
                word = ((w_high if high else w) & (mask << b)) | _MAGIC_BITS
                qz = jax.lax.bitcast_convert_type(word, jnp.float32) - zb[b]             # [16, BN]: (q - z) 2**b
                for r in range(num_rows):
                    xj = x_ref[r, pl.ds(slab * slab_len + j * _NIBBLE_ROWS, _NIBBLE_ROWS)].astype(jnp.float32)
                    parts[r] += (xj * float(2.0 ** -b))[:, None] * qz
                    if offsets:
                        x_sums[r] += jnp.sum(xj)
            accs = [acc + part * s for acc, part in zip(accs, parts)]
            if offsets:
                offs = [off + x_sum * z.astype(jnp.float32) for off, x_sum in zip(offs, x_sums)]
        return accs, offs

    def body(i, carry):
        accs, offs = carry
        first = split * slabs_per_split + i * slabs_per_iter
        ws = [w_ref[pl.ds((first + t) * _NIBBLE_ROWS, _NIBBLE_ROWS), cols]             # [16, BN] i32 each
              for t in range(slabs_per_iter)]
        accs, offs = list(accs), list(offs)
        for t, w in enumerate(ws):
            accs, offs = slab_step(first + t, w, accs, offs)
        return tuple(accs), tuple(offs)

    zeros = tuple(jnp.zeros(tile, jnp.float32) for _ in range(num_rows))
    no_offs = tuple(jnp.zeros((1, block_n), jnp.float32) for _ in range(num_rows if offsets else 0))
    accs, offs = jax.lax.fori_loop(0, slabs_per_split // slabs_per_iter, body, (zeros, no_offs))
    for r, acc in enumerate(accs):
        out = jnp.sum(acc, axis=0)                                                        # [BN]
        if offsets:
            out += offs[r][0]
        if len(o_ref.shape) == 2:
            o_ref[r, cols] = out.astype(o_ref.dtype)
        else:
            o_ref[split, r, cols] = out


# The GEMV kernel's f16x2 form: two weights an instruction. The float16 pair 0x6400_6400 is (1024.0, 1024.0);
# OR-ing a nibble into bits 0-3 (or 4-7) of each half gives 1024 + q (or 1024 + 16 q) in each lane exactly, so a
# mask and an OR turn a word's nibbles j (low lane) and j + 4 (high lane) into a float16 pair without any
# conversion instruction, and one packed subtraction of (1024 + z, 1024 + z) leaves q - z exactly. Four such
# pairs cover a word's eight nibbles: (0, 4) and (1, 5) from the word, (2, 6) and (3, 7) from it shifted right
# by 8; the odd pairs come scaled by 16, which x's pair divided by 16 undoes exactly. One packed multiply and
# three packed FMAs fold the word into a float16 pair of lane sums (four products each), which two
# conversions and two float32 FMAs (by each lane's group scale) add to the accumulator: about 2.6 instructions
# a weight against 4 in the f32 form, the integer ones 1.1 against 2.4. The kernel still waits mostly on its
# loads' latency, not on its bytes. Float16 needs x in its range: each split's share of x is scaled by a power
# of two (exact) that puts its largest magnitude in [32, 64), read in a few wide loads before the loop, and the
# output is scaled back once (one scale a split, not a slab: a scale per slab needs a reduction across the
# program every slab).
_F16_PAIR_1024 = 0x64006400
_LANE_MASKS = (0x000F000F, 0x00F000F0)           # nibbles at bits 0-3 / 4-7 of each 16-bit lane
F16X2_MIN_GROUP = 32                             # a lane's four nibbles span two groups of 32 at most
# lop3's truth table for (a & b) | c (a = 0xF0, b = 0xCC, c = 0xAA): the mask and the OR in one instruction, which
# ptxas does not merge from two
_AND_OR_LUT = (0xF0 & 0xCC) | 0xAA


def _lane_groups(group_size: int) -> tuple[tuple[int, ...], ...]:
    """The f16x2 form's calls per word: each a tuple of pairs p (nibbles p and p + 4) whose low-lane nibbles
    share one group, and whose high-lane nibbles share one group."""
    return ((0, 1, 2, 3),) if group_size >= 64 else ((0, 1), (2, 3))


def _f16x2_asm(pairs: tuple[int, ...]) -> tuple[str, str]:
    """PTX for one word and the given pairs. Operands: $0 the accumulator out, $1 in; the word; one packed x pair
    per pair; the packed zero pairs (1024 + z, 1024 + 16 z); the low and high lanes' group scales. The
    accumulator takes low-lane sum * its scale + high-lane sum * its scale. (One output: jax 0.10.2's lowering
    of an inline asm with several outputs fails.)"""
    n = len(pairs)
    word, zlo, zhi, s_lo, s_hi = "$2", f"${3 + n}", f"${4 + n}", f"${5 + n}", f"${6 + n}"
    lines = ["{", ".reg .b32 w8, t, a;", ".reg .b16 h0, h1;", ".reg .f32 f0, f1, c;"]
    if any(p >= 2 for p in pairs):
        lines.append(f"shr.u32 w8, {word}, 8;")
    for i, p in enumerate(pairs):
        lines += [f"lop3.b32 t, {word if p < 2 else 'w8'}, {_LANE_MASKS[p % 2]}, {_F16_PAIR_1024}, {_AND_OR_LUT};",
                  f"sub.f16x2 t, t, {zlo if p % 2 == 0 else zhi};",
                  f"mul.rn.f16x2 a, t, ${3 + i};" if i == 0 else f"fma.rn.f16x2 a, t, ${3 + i}, a;"]
    lines += ["mov.b32 {h0, h1}, a;", "cvt.f32.f16 f0, h0;", "cvt.f32.f16 f1, h1;",
              f"fma.rn.f32 c, f0, {s_lo}, $1;", f"fma.rn.f32 $0, f1, {s_hi}, c;", "}"]
    return "\n".join(lines), ",".join(["=f", "f"] + ["r"] * (3 + n) + ["f", "f"])


def _f16_lanes(v):
    """int32 words -> their (low, high) 16-bit halves as float16 (the jnp form of the PTX's operands)."""
    lo = jax.lax.bitcast_convert_type((v & 0xFFFF).astype(jnp.uint16), jnp.float16)
    hi = jax.lax.bitcast_convert_type(((v >> 16) & 0xFFFF).astype(jnp.uint16), jnp.float16)
    return lo, hi


def _f16x2_jnp(acc, word, xs, zlo, zhi, s_lo, s_hi, pairs):
    """What _f16x2_asm computes, in jnp float16 (interpret mode, where no PTX runs). Each FMA rounds twice
    here (float32, then float16) where the PTX rounds once: the two differ in a last bit now and then."""
    a_lo = a_hi = None
    for i, p in enumerate(pairs):
        t_lo, t_hi = _f16_lanes(((word if p < 2 else word >> 8) & _LANE_MASKS[p % 2]) | _F16_PAIR_1024)
        z_lo, z_hi = _f16_lanes(zlo if p % 2 == 0 else zhi)
        x_lo, x_hi = _f16_lanes(xs[i])
        prods = ((t_lo - z_lo) * x_lo, (t_hi - z_hi) * x_hi)
        if i == 0:
            a_lo, a_hi = prods
        else:
            a_lo = (prods[0].astype(jnp.float32) + a_lo.astype(jnp.float32)).astype(jnp.float16)
            a_hi = (prods[1].astype(jnp.float32) + a_hi.astype(jnp.float32)).astype(jnp.float16)
    return acc + a_lo.astype(jnp.float32) * s_lo + a_hi.astype(jnp.float32) * s_hi


def _f16_bits(v):
    """float32 values -> the float16 bits in the low half of an int32."""
    return jax.lax.bitcast_convert_type(v.astype(jnp.float16), jnp.uint16).astype(jnp.int32)


# One conversion for two floats: lo to the low half, hi to the high half, each rounded to nearest even as
# _f16_bits does (ptxas otherwise converts x's pairs one float at a time and packs them with a permute).
_F16X2_CVT = "cvt.rn.f16x2.f32 $0, $2, $1;"


def _f16_pair(lo, hi, asm: bool):
    """float32 values -> int32 words holding the float16 pair (lo, hi): one PTX conversion a pair when compiled
    (asm), jnp when not."""
    if not asm:
        return _f16_bits(lo) | (_f16_bits(hi) << 16)
    [pair] = plgpu.elementwise_inline_asm(_F16X2_CVT, args=[lo, hi], constraints="=r,f,f", pack=1,
                                          result_shape_dtypes=[jax.ShapeDtypeStruct(lo.shape, jnp.int32)])
    return pair


def _zero_pairs(z_lo, z_hi=None):
    """Integer zero points of the low and high lanes' groups (z_hi None: the low lanes') -> int32 words of the float16
    pairs (1024 + z_lo, 1024 + z_hi) and (1024 + 16 z_lo, 1024 + 16 z_hi). From 1024 to 2048 float16 steps by one, so
    1024 + v is the bits 0x6400 | v for v < 1024 (v is z or 16 z, z < 16): shifts and ORs, no conversion."""
    lo = z_lo.astype(jnp.int32)
    both = lo | ((lo if z_hi is None else z_hi.astype(jnp.int32)) << 16)
    return both | _F16_PAIR_1024, (both << 4) | _F16_PAIR_1024


def _pow2_scale(amax):
    """(s, 1 / s), powers of two, with amax * s in [32, 64) (clamped for zero or extreme amax)."""
    biased = (jax.lax.bitcast_convert_type(amax, jnp.int32) >> 23) & 0xFF          # amax in [2**(b-127), 2**(b-126))
    e = jnp.clip(127 + 132 - biased, 1, 253)                                         # 2**(e-127) = 2**(132-b)
    return (jax.lax.bitcast_convert_type(e << 23, jnp.float32),
            jax.lax.bitcast_convert_type((254 - e) << 23, jnp.float32))


def _pow2_chunks(length: int, largest: int = 2048) -> list[tuple[int, int]]:
    """[0, length) as (start, size) chunks whose sizes are powers of two (a Triton block's shape), largest first."""
    chunks, start = [], 0
    while start < length:
        size = min(largest, 1 << ((length - start).bit_length() - 1))
        chunks.append((start, size))
        start += size
    return chunks


def _int4_gemv_f16x2_kernel(*refs, group_size, slabs_per_split, block_n, slabs_per_iter, offsets, asm, prepared):
    # Not prepared: x_ref dtype[1, K] (bf16 or f16). Prepared (prepare_gemv_x's operands): xp_ref i32[1, K/2] the
    # float16 pairs, a_ref f32[1] the bound of |x| they were scaled by (or f32[K/128], one a slab), and with
    # offsets xs_ref f32[1, K/G] x's group sums. w_ref: i32[K/8, N]; s_ref, z_ref: [K/G, N] (u8 zeros, or with
    # offsets mins). o_ref: dtype[1, N] (one split) or f32[NS, 1, N]. The f16x2 form above: a [16, BN] float32
    # accumulator takes each word's lane sums times its groups' scales; with offsets a [1, BN] one takes
    # min * sum_k x_k.
    if prepared:
        xp_ref, a_ref, *sums, w_ref, s_ref, z_ref, o_ref = refs
        xs_ref = sums[0] if offsets else None
    else:
        x_ref, w_ref, s_ref, z_ref, o_ref = refs
    jn, split = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(jn * block_n, block_n)
    tile = (_NIBBLE_ROWS, block_n)
    first = split * slabs_per_split
    calls = _lane_groups(group_size)
    one_group = group_size >= PACK_ROWS              # both lanes of a word in one group: its rows read once

    def group_row(slab, j):
        return (slab * PACK_ROWS + j * _NIBBLE_ROWS) // group_size

    def group_scale(row, slab_unscale):
        scale = s_ref[row, cols].astype(jnp.float32)[None, :]                            # [1, BN]
        return scale if slab_unscale is None else scale * slab_unscale

    def slab_unscales(slab0):
        # the inverse scales of slabs slab0.. (one iteration's), loaded an iteration ahead of their use: a
        # scalar load at its use held each slab's FMAs back (the down GEMV 15.2 against 13.0 us on the H100)
        last = first + slabs_per_split - 1
        return tuple(_pow2_scale(a_ref[jnp.minimum(slab0 + t, last)])[1] for t in range(slabs_per_iter))

    per_slab = prepared and a_ref.shape[0] > 1      # one bound a slab (silu_mul_gemv_x's), else one for all of x
    if per_slab:
        unscale = 1.0                                  # each slab's inverse scale goes into its groups' scales
    elif prepared:
        _, unscale = _pow2_scale(a_ref[0])
    else:
        # the split's power-of-two scale of x (its inverse applied to the output)
        amax = functools.reduce(jnp.maximum, [
            jnp.max(jnp.abs(x_ref[0, pl.ds(first * PACK_ROWS + start, size)].astype(jnp.float32)))
            for start, size in _pow2_chunks(slabs_per_split * PACK_ROWS)])
        scale, unscale = _pow2_scale(amax)

    def slab_step(slab, w, acc, off, slab_unscale=None):
        if prepared:
            x_pairs = [xp_ref[0, pl.ds((slab * 4 + p) * _NIBBLE_ROWS, _NIBBLE_ROWS)] for p in range(4)]
        else:
            xj = [x_ref[0, pl.ds(slab * PACK_ROWS + j * _NIBBLE_ROWS, _NIBBLE_ROWS)].astype(jnp.float32)
                  for j in range(8)]                                                     # [16] each
            scaled = [xj[j] * (scale * (1.0 / 16 if j % 2 else 1.0)) for j in range(8)]
            x_pairs = [_f16_pair(scaled[p], scaled[p + 4], asm) for p in range(4)]            # [16] int32 each
        for pairs in calls:
            g_lo, g_hi = group_row(slab, pairs[0]), group_row(slab, pairs[0] + 4)
            xs = [jnp.broadcast_to(x_pairs[p][:, None], tile) for p in pairs]
            if offsets:
                zlo = zhi = jnp.full(tile, _F16_PAIR_1024, jnp.int32)
            else:
                pairs_lo, pairs_hi = _zero_pairs(z_ref[g_lo, cols], None if one_group else z_ref[g_hi, cols])
                zlo, zhi = jnp.broadcast_to(pairs_lo[None, :], tile), jnp.broadcast_to(pairs_hi[None, :], tile)
            s_lo = jnp.broadcast_to(group_scale(g_lo, slab_unscale), tile)
            s_hi = s_lo if one_group else jnp.broadcast_to(group_scale(g_hi, slab_unscale), tile)
            if asm:
                asm_text, constraints = _f16x2_asm(pairs)
                [acc] = plgpu.elementwise_inline_asm(asm_text, args=[acc, w, *xs, zlo, zhi, s_lo, s_hi],
                                                     constraints=constraints, pack=1,
                                                     result_shape_dtypes=[jax.ShapeDtypeStruct(tile, jnp.float32)])
            else:
                acc = _f16x2_jnp(acc, w, xs, zlo, zhi, s_lo, s_hi, pairs)
        if offsets:
            for g in range(max(1, PACK_ROWS // group_size)):
                nib = range(8) if group_size >= PACK_ROWS else range(g * group_size // 16, (g + 1) * group_size // 16)
                x_sum = (xs_ref[0, group_row(slab, nib[0])] if prepared
                         else sum(jnp.sum(xj[j]) for j in nib))
                off += x_sum * z_ref[group_row(slab, nib[0]), cols].astype(jnp.float32)[None, :]
        return acc, off

    def body(i, carry):
        slab0 = first + i * slabs_per_iter
        ws = [w_ref[pl.ds((slab0 + t) * _NIBBLE_ROWS, _NIBBLE_ROWS), cols] for t in range(slabs_per_iter)]
        acc, off, unscales = carry
        ahead = slab_unscales(slab0 + slabs_per_iter) if per_slab else ()
        for t, w in enumerate(ws):                                                       # [16, BN] i32 each
            acc, off = slab_step(slab0 + t, w, acc, off, unscales[t] if per_slab else None)
        return acc, off, ahead

    init = (jnp.zeros(tile, jnp.float32), jnp.zeros((1, block_n), jnp.float32),
            slab_unscales(first) if per_slab else ())
    acc, off, _ = jax.lax.fori_loop(0, slabs_per_split // slabs_per_iter, body, init)
    out = jnp.sum(acc, axis=0) * unscale + off[0]                                        # [BN]
    if len(o_ref.shape) == 2:
        o_ref[0, cols] = out.astype(o_ref.dtype)
    else:
        o_ref[split, 0, cols] = out


def prepare_gemv_x(x, group_size: int, offsets: bool, amax=None):
    """x dtype[1, K] -> the f16x2 GEMV's x operands, made once before the kernel rather than by every program of
    it: (the float16 pairs i32[1, K/2], the bound of |x| they were scaled by f32[1], and for the offset form x's
    group sums f32[1, K/G]). Pair p of slab t, row r (word (4 t + p) 16 + r) holds x[128 t + 16 p + r] and
    x[128 t + 16 (p + 4) + r] times the power-of-two scale of the bound (and 1/16 for odd p), as the kernel builds
    them itself, there with one scale a split. amax: a bound of |x| known beforehand (a norm's, from its own
    reduction), else max |x|, one more reduction. Any bound within a few powers of two of the true maximum
    keeps float16's precision: the scale only keeps the products in float16's range."""
    xf = x.astype(jnp.float32)[0]
    k = xf.shape[0]
    amax = jnp.max(jnp.abs(xf)) if amax is None else jnp.asarray(amax, jnp.float32).reshape(())
    pairs = slab_pairs(xf.reshape(k // PACK_ROWS, 8, _NIBBLE_ROWS), jnp.broadcast_to(amax, (k // PACK_ROWS,)))
    sums = (xf.reshape(k // group_size, group_size).sum(axis=1).reshape(1, k // group_size),) if offsets else ()
    return (pairs.reshape(1, k // 2), amax.reshape(1), *sums)


def slab_pairs(values, amax):
    """values f32[S, 8, 16] ([slab, j, r]) -> the float16 pairs i32[S, 4, 16] ([slab, p, r]) the f16x2 GEMV takes,
    slab s scaled by the power of two of its bound amax[s] (and 1/16 for odd j)."""
    scale, _ = _pow2_scale(amax)
    odd = jnp.asarray([1.0, 1.0 / 16] * 4, jnp.float32)[None, :, None]
    v = values * scale[:, None, None] * odd
    return _f16_pair(v[:, :4], v[:, 4:], asm=False)


def use_f16x2(dtype, group_size: int) -> bool:
    """Whether the GEMV kernel takes the f16x2 form: half-precision x (a float32 x keeps float32 math, so a
    float32 model computes in float32) and groups of 32 rows or more."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and group_size >= F16X2_MIN_GROUP


def choose_int4_tiling(m: int, k: int, n: int, sms: int = 132, bits: int = 4, f16x2: bool = False,
                       block_n: int | None = None, num_warps: int | None = None) -> tuple[int, int, int]:
    """(block_m, block_n, num_splits): rows padded to a tensor-core tile (16) up to 64 (the GEMV kernel: all
    M rows in one program); K split until the programs fill the GPU (decode sizes leave too few N tiles for it
    alone): four programs per SM for the dot kernel, GEMV_WARPS_PER_SM warps per SM for the GEMV kernel.
    Columns (block_n None): 128 a program for the dot kernel; for the GEMV kernel 64 in its f32 form (faster than
    128 there) and GEMV_F16X2_COLUMNS in its f16x2 form (f16x2=True). num_warps None: the GEMV's one per
    GEMV_COLUMNS_PER_WARP columns."""
    gemv = m <= GEMV_MAX_ROWS
    block_m = m if gemv else min(64, max(16, 1 << max(0, (m - 1).bit_length())))
    if block_n is None and gemv:
        block_n = GEMV_F16X2_COLUMNS if f16x2 and n % GEMV_F16X2_COLUMNS == 0 else 64
    elif block_n is None:
        block_n = 64 if n % 128 else 128
    slabs = k // slab_rows(bits)
    programs = -(-m // block_m) * (n // block_n)
    if gemv:
        want = max(1, max(1, GEMV_WARPS_PER_SM // (num_warps or gemv_warps(block_n))) * sms // programs)
    else:
        want = max(1, 4 * sms // programs)
    # the largest divisor of the slab count not above want: every split walks the same number of slabs
    splits = max(d for d in range(1, slabs + 1) if slabs % d == 0 and d <= want)
    return block_m, block_n, splits


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "num_splits", "slabs_per_iter", "num_warps",
                                             "num_stages", "gemv_math", "bits", "keep_splits", "interpret"))
def int4_matmul(x, qweight, scales, zeros=None, *, mins=None, block_m: int | None = None,
                block_n: int | None = None, num_splits: int | None = None, slabs_per_iter: int = 1,
                num_warps: int | None = None, num_stages: int = 3, gemv_math: str | None = None,
                bits: int = 4, x_amax=None, x_pairs=None, keep_splits: bool = False,
                interpret: bool | None = None) -> jax.Array:
    """x dtype[M, K] @ W -> dtype[M, N], W given as qweight i32[K/8, N] and scales dtype[K/G, N] with either
    zero points (zeros, u8) or offsets (mins, floats) of scales' shape (the layout and both forms in the module
    docstring).
    Tiling None: choose_int4_tiling's; num_warps None: one per GEMV_COLUMNS_PER_WARP columns for the GEMV kernel, 4
    for the dot kernel.
    slabs_per_iter (GEMV kernel): slabs loaded per loop iteration; it must divide each split's slabs.
    gemv_math (GEMV kernel): "f32" (one float32 FMA a weight), "f16x2" (two weights an instruction: PTX when
    compiled, its jnp equivalent when interpreted), "f16x2-jnp" (that equivalent, compiled too: for tests);
    None: "f16x2" where use_f16x2 allows it, else "f32". bits: 4, or 8 (qweight i32[K/4, N], 64-row slabs; the
    GEMV's f32 form). x_amax f32[1] (the f16x2 GEMV only): a bound of |x| (its maximum, or a norm's bound of
    it); given, x's float16 pairs are made before the kernel by prepare_gemv_x (XLA fuses them into the ops that
    produce x) rather than by each of the kernel's programs, about 10% of the kernel's time at llama3-8b's
    sizes on the H100 (bench/results/NOTES.md). x_pairs (the same GEMV, zero points): those operands made already,
    (pairs i32[1, K/2], and f32[1] max |x| from int4_operands.rms_norm_gemv_x or f32[K/128] one a slab from its
    silu_mul_gemv_x); x
    then gives only the shape and dtype. keep_splits: the output as the splits' partial sums, f32[NS, M, N] (NS = 1:
    dtype[1, M, N]), for a consumer that sums them itself (silu_mul_gemv_x)."""
    zeros, offsets = _affine(zeros, mins)
    if bits not in BITS:
        raise ValueError(f"bits {bits}: 4 or 8")
    m, k = x.shape
    rows, n = qweight.shape
    per_word = 32 // bits
    if x.ndim != 2 or rows * per_word != k or qweight.dtype != jnp.int32:
        raise ValueError(f"x {x.shape} and qweight {qweight.shape} {qweight.dtype} do not match (qweight "
                         f"is int32 [K/{per_word}, N])")
    if scales.shape != zeros.shape or scales.ndim != 2 or scales.shape[1] != n or k % scales.shape[0]:
        raise ValueError(f"scales {scales.shape} / {'mins' if offsets else 'zeros'} {zeros.shape} do not match "
                         f"K {k}, N {n}")
    group_size = k // scales.shape[0]
    why = check_group_size(k, group_size, bits)
    if why is not None:
        raise ValueError(why)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if gemv_math is None:
        gemv_math = "f16x2" if bits == 4 and use_f16x2(x.dtype, group_size) else "f32"
    bm, bn, ns = choose_int4_tiling(m, k, n, bits=bits, f16x2=gemv_math != "f32", block_n=block_n,
                                    num_warps=num_warps)
    block_m, block_n, num_splits = block_m or bm, bn, num_splits or ns
    slabs = k // slab_rows(bits)
    if n % block_n or slabs % num_splits:
        raise ValueError(f"N {n} / {slabs} slabs do not divide into blocks of {block_n} / {num_splits} splits")
    if num_warps is None:
        num_warps = gemv_warps(block_n) if m <= GEMV_MAX_ROWS else 4
    if bits != 4 and gemv_math != "f32":
        raise ValueError(f"gemv_math {gemv_math!r} takes 4-bit weights; 8-bit ones take f32")
    if gemv_math not in ("f32", "f16x2", "f16x2-jnp"):
        raise ValueError(f"gemv_math {gemv_math!r}: f32, f16x2 or f16x2-jnp")
    if m <= GEMV_MAX_ROWS and (slabs // num_splits) % slabs_per_iter:
        raise ValueError(f"{slabs // num_splits} slabs per split do not divide into {slabs_per_iter} per iteration")
    prepared = False
    if m <= GEMV_MAX_ROWS and gemv_math != "f32":
        if m != 1 or group_size < F16X2_MIN_GROUP:
            raise ValueError(f"the f16x2 GEMV takes one row and groups of {F16X2_MIN_GROUP} or more, not {m} rows "
                             f"in groups of {group_size}")
        prepared = x_amax is not None or x_pairs is not None
        if x_pairs is not None and (offsets or x_amax is not None):
            raise ValueError("x_pairs takes the zero-point form, without x_amax (the pairs come with their maximum)")
        if x_pairs is not None and x_pairs[1].shape not in ((1,), (slabs,)):
            raise ValueError(f"x_pairs' bounds {x_pairs[1].shape}: one, or one for each of the {slabs} slabs")
        kernel = functools.partial(_int4_gemv_f16x2_kernel, group_size=group_size,
                                   slabs_per_split=slabs // num_splits, block_n=block_n,
                                   slabs_per_iter=slabs_per_iter, offsets=offsets,
                                   asm=gemv_math == "f16x2" and not interpret, prepared=prepared)
        grid: tuple[int, ...] = (n // block_n, num_splits)
    elif x_amax is not None or x_pairs is not None:
        raise ValueError("x_amax and x_pairs take the f16x2 GEMV (one half-precision row, groups of "
                         f"{F16X2_MIN_GROUP} or more, 4 bits)")
    elif m <= GEMV_MAX_ROWS:
        kernel = functools.partial(_int4_gemv_kernel, group_size=group_size, slabs_per_split=slabs // num_splits,
                                   block_n=block_n, slabs_per_iter=slabs_per_iter, offsets=offsets, bits=bits)
        grid = (n // block_n, num_splits)
    else:
        kernel = functools.partial(_int4_kernel, group_size=group_size, slabs_per_split=slabs // num_splits,
                                   block_m=block_m, block_n=block_n, offsets=offsets, bits=bits)
        grid = (pl.cdiv(m, block_m), n // block_n, num_splits)
    out_shape = (jax.ShapeDtypeStruct((m, n), x.dtype) if num_splits == 1
                 else jax.ShapeDtypeStruct((num_splits, m, n), jnp.float32))
    out = pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="int4_matmul",
    )(*(tuple(x_pairs) if x_pairs is not None else prepare_gemv_x(x, group_size, offsets, x_amax) if prepared
        else (x,)), qweight, scales, zeros)
    if keep_splits:
        return out if num_splits > 1 else out[None]
    return out if num_splits == 1 else jnp.sum(out, axis=0).astype(x.dtype)


__all__ = ["BITS", "F16X2_MIN_GROUP", "GEMV_MAX_ROWS", "PACK_ROWS", "check_group_size", "choose_int4_tiling",
           "dequantize_int4", "int4_matmul", "int4_matmul_reference", "pack_bits", "pack_int4", "prepare_gemv_x",
           "slab_rows", "unpack_bits", "unpack_int4", "use_f16x2"]
