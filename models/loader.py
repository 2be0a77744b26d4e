"""Load an HF checkpoint folder (config.json + safetensors) into the Flax decoder's parameter tree.

HF parameter names map to Flax params in `LAYER_TABLE` / `TOP_TABLE` (one table for every family the
decoder supports). The layers' weights come in one of two layouts, whichever the step's layer dispatch
runs on: stacked on a leading [L] axis (the layer scan, `nn.scan`), or one tree per layer (per-layer and
unrolled dispatch), loaded that way rather than split from a stacked tree afterwards: splitting on the
device holds the weights twice and leaves the allocator fragmented for the KV pool, and splitting through
host memory took most of a large model's warm start-up.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import pathlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .config import DecoderConfig, decoder_config_from_hf
from .decoder import AttentionMetadata, DecoderModel, head_columns, held_dtype
from .param_tables import (FUSED_MODULES, GGUF_EMBEDDING, GGUF_LINEAR_OF, GGUF_LINEARS, GGUF_OUTPUT, KV_SCALES,
                           LAYER_PREFIX, LAYER_TABLE, LINEAR_MODULES, TOP_TABLE, table_name)
from .quant_loader import (CHECKPOINT_KINDS, checkpoint_quantization, quantize_online, quantized_layer_params,
                           quantized_tensor_names, weight_quant_of)

logger = logging.getLogger("jaxpaged.engine")

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
          "float": jnp.float32, "half": jnp.float16}


class LoadedModel(NamedTuple):
    config: DecoderConfig
    hf_config: dict
    params: Any          # Flax params tree; its "layers" stacked, or a list of one tree per layer (per_layer)
    dtype: Any


def read_hf_config(model_dir: os.PathLike) -> dict:
    path = pathlib.Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"Model folder {str(path)!r} does not exist (jaxpaged loads local HF folders).")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{str(cfg_file)!r} not found: a model folder needs config.json.")
    return json.loads(cfg_file.read_text())


def model_config(model_dir: os.PathLike, quantization: str | None = None,
                 kv_cache_dtype: str = "auto") -> DecoderConfig:
    """The decoder's config for a model folder, with the linear layers its quantization keeps quantized
    (checkpoint_quantization: the method asked for, else the one config.json declares) and the KV pool's
    dtype (fp8 and fp8_e4m3: "fp8")."""
    hf_config = read_hf_config(model_dir)
    method = checkpoint_quantization(hf_config, quantization)
    cfg = decoder_config_from_hf(hf_config)
    cfg = dataclasses.replace(cfg, kv_cache_dtype="fp8" if kv_cache_dtype.startswith("fp8") else "auto")
    if method is None:
        return cfg
    if method == "gguf":
        return dataclasses.replace(cfg, weight_quant=gguf_weight_quant(_gguf_reader(model_dir)))
    return dataclasses.replace(cfg, weight_quant=weight_quant_of(method, hf_config.get("quantization_config"), cfg))


def gguf_source(model_dir: os.PathLike) -> pathlib.Path:
    """The GGUF file a model folder was converted from (its CONVERTED_FROM, written by gguf_convert)."""
    marker = pathlib.Path(model_dir) / "CONVERTED_FROM"
    if not marker.exists():
        raise ValueError(f"quantization='gguf' serves the blocks of a GGUF file, and {str(model_dir)!r} was not "
                         "converted from one (it has no CONVERTED_FROM): run it without quantization")
    return pathlib.Path(marker.read_text().splitlines()[0])


def _gguf_reader(model_dir: os.PathLike):
    path = gguf_source(model_dir)
    return _open_gguf(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, mtime_ns: int):
    """One reader per file version for a load's several passes (parsing a file's metadata takes seconds: the
    tokenizer's vocabulary is read entry by entry); the tensors stay memory-mapped."""
    import gguf
    return gguf.GGUFReader(path)


class _GGUFTensors:
    """A GGUF file's tensors under their HF names, read as a safetensors file is (keys, get_tensor), each
    dequantized only when asked for (gguf_convert.gguf_hf_tensors): a folder converted without weights."""

    def __init__(self, reader):
        from .gguf_convert import gguf_hf_tensors
        self._tensors = dict(gguf_hf_tensors(reader))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def keys(self):
        return list(self._tensors)

    def get_tensor(self, name: str) -> jax.Array:
        return jnp.asarray(self._tensors[name]())


def _weight_files(model_dir: pathlib.Path, from_gguf: bool):
    """(file, opened reader) per weight file: the folder's safetensors, or the GGUF file it was converted from
    where the run serves that file's blocks or the folder holds no weights (file None)."""
    from safetensors import safe_open
    if from_gguf or ((model_dir / "CONVERTED_FROM").exists() and not list(model_dir.glob("*.safetensors"))):
        yield None, _GGUFTensors(_gguf_reader(model_dir))
        return
    for file in _safetensor_files(model_dir):
        # framework="flax" reads bf16 (numpy has no bf16); arrays go straight to the default device.
        yield file, safe_open(str(file), framework="flax")


def gguf_weight_quant(reader) -> tuple[tuple[str, str], ...]:
    """(linear name, scheme) for each linear layer that stays quantized: GGUF_INT4 where every tensor of it (its
    parts, every layer) is of a 4-bit type, whichever, else GGUF_INT8 with its group where every tensor is of a
    supported block type, in any mix (llama.cpp's Q4_K_M and Q5_K_M give some layers' v and down Q6_K): both
    repacked for the W4A16 kernel (4- or 8-bit values). The embedding, a lookup, keeps its blocks where one type
    holds it all; the LM head ("lm_head": a tied embedding's blocks once more, or an untied output tensor of a
    4-bit type) is repacked as a linear layer is. A bias (Qwen2's q/k/v) stays dense beside the weight. A tensor
    held as floats (F32, F16, BF16) makes its layer dense, dequantized from the file at load, and the log says so
    where it mixes with blocks; unsupported types are refused, naming what is supported."""
    from jaxpaged.quantization.gguf_blocks import BLOCK_SIZES, GGUF_INT4, GGUF_INT8, INT4_TYPES, int8_group
    floats = ("F32", "F16", "BF16")
    types: dict[str, set] = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        name = "embed_tokens" if t.name == GGUF_EMBEDDING else \
            GGUF_LINEAR_OF.get(parts[2]) if parts[0] == "blk" else None
        if name is not None and parts[-1] != "bias":
            types.setdefault(name, set()).add(t.tensor_type.name)
    # The LM head from its blocks in the W4A16 kernel, as the linear layers: a tied one (the embedding's blocks,
    # which it would otherwise expand whole every step), and an untied one of a 4-bit type (a quarter of a dense
    # copy's bytes). An untied head of a wider type (llama.cpp's usual Q6_K) stays a dense copy: the 8-bit GEMV
    # reads at about bf16's speed, and above INT4_KERNEL_MAX_ROWS rows the blocks would expand every step.
    by_name = {t.name: t for t in reader.tensors if t.name in (GGUF_OUTPUT, GGUF_EMBEDDING)}
    head = by_name.get(GGUF_OUTPUT, by_name.get(GGUF_EMBEDDING))          # untied, else the tied embedding
    if head is not None and head.name == GGUF_OUTPUT and head.tensor_type.name not in INT4_TYPES:
        head = None                                                     # a wider untied head stays dense
    if head is not None:
        types["lm_head"] = {head.tensor_type.name}
    out = []
    for linear, found in sorted(types.items()):
        unsupported = sorted(found - set(BLOCK_SIZES) - set(floats))
        if unsupported:
            raise ValueError(f"GGUF type {unsupported[0]} ({linear}) is not supported; supported: "
                             f"{', '.join(BLOCK_SIZES)}, F32, F16, BF16")
        if linear != "embed_tokens" and found <= set(INT4_TYPES):
            out.append((linear, GGUF_INT4))
        elif linear != "embed_tokens" and found <= set(BLOCK_SIZES):
            out.append((linear, f"{GGUF_INT8}{int8_group(found)}"))
        elif linear == "embed_tokens" and len(found) == 1 and not found <= set(floats):
            out.append((linear, next(iter(found))))
        elif not found <= set(floats):
            logger.warning("GGUF %s: its tensors come in several types (%s); it is held dense, dequantized at load",
                           linear, ", ".join(sorted(found)))
    return tuple(out)


def _gguf_repacked(raw_parts: list[tuple[object, str]], in_features: int, bits: int, group: int
                   ) -> dict[str, jax.Array]:
    """A linear layer's GGUF tensors ((uint8 [out, bytes], type) per part, concatenated on the output axis) in
    the W4A16 kernel's offset form with `bits`-bit values: qweight i32[Kp * bits / 32, N], scales and mins
    f32[Kp / group, N], the input axis padded to Kp, a multiple of the kernel's slab, with zero weights
    (DecoderConfig's Int4Linear pads x alike). Repacked on the host (the CPU backend for the parts)."""
    import numpy as np

    from jaxpaged.pallas_kernels.int4_matmul import pack_bits, slab_rows
    from jaxpaged.quantization.gguf_blocks import int4_parts, int8_parts
    with jax.default_device(jax.devices("cpu")[0]):
        pieces = [jax.device_get(int4_parts(raw, qtype) if bits == 4 else int8_parts(raw, qtype, group))
                  for raw, qtype in raw_parts]
    q, scales, mins = (np.concatenate([p[i] for p in pieces]).T for i in range(3))   # [K, N], [K/G, N] x 2
    pad = -in_features % slab_rows(bits)
    q = np.pad(q, ((0, pad), (0, 0)))
    scales, mins = (np.pad(a, ((0, pad // group), (0, 0))) for a in (scales, mins))
    return {"qweight": jnp.asarray(pack_bits(q, bits)), "scales": jnp.asarray(scales), "mins": jnp.asarray(mins)}


def gguf_blocks(model_dir: os.PathLike, cfg: DecoderConfig
                ) -> tuple[dict[tuple, list], jax.Array | None, dict[str, jax.Array] | None]:
    """The tensors cfg keeps quantized, in one pass over the file: (param path under a layer -> each layer's
    array: "qweight", "scales" and "mins" of a GGUF_INT4 or GGUF_INT8 layer in the W4A16 kernel's layout,
    e.g. ("self_attn", "qkv_proj", "qweight"); q and k rows in HF's rotary order (un-permuted where
    llama.cpp permuted them: the llama architecture), parts concatenated on the output axis; the embedding's
    blocks, or None when it is dense; the LM head's "qweight", "scales" and "mins" in the same layout, its
    columns padded to decoder.head_columns, or None when it is dense)."""
    import numpy as np

    from jaxpaged.quantization.gguf_blocks import repacked_form

    from .gguf_convert import gguf_architecture, unpermute_rope
    from .quant_loader import linear_inputs
    parts: dict[tuple[str, int], dict[str, tuple[np.ndarray, str]]] = {}
    embedding = None
    reader = _gguf_reader(model_dir)
    permuted = gguf_architecture(reader)[1].rope_permuted
    for t in reader.tensors:
        p = t.name.split(".")
        if t.name == GGUF_EMBEDDING and cfg.quant_of("embed_tokens"):
            embedding = jnp.asarray(np.asarray(t.data))
        elif p[0] == "blk" and p[-1] == "weight" and cfg.quant_of(GGUF_LINEAR_OF.get(p[2], "")):
            raw = np.asarray(t.data)
            if permuted and p[2] in ("attn_q", "attn_k"):
                raw = unpermute_rope(raw, cfg.num_heads if p[2] == "attn_q" else cfg.num_kv_heads)
            parts.setdefault((GGUF_LINEAR_OF[p[2]], int(p[1])), {})[p[2]] = (raw, t.tensor_type.name)
    layers: dict[tuple, list] = {}
    inputs = linear_inputs(cfg)
    for linear, (path, names) in GGUF_LINEARS.items():
        scheme = cfg.quant_of(linear)
        if scheme is None:
            continue
        bits, group = repacked_form(scheme)
        for i in range(cfg.num_layers):
            repacked = _gguf_repacked([parts[linear, i][n] for n in names], inputs[linear], bits, group)
            for leaf, array in repacked.items():
                layers.setdefault(path + (leaf,), []).append(array)
    head = None
    if cfg.quant_of("lm_head"):
        bits, group = repacked_form(cfg.quant_of("lm_head"))
        source = next(t for t in reader.tensors if t.name == (GGUF_EMBEDDING if cfg.tie_word_embeddings
                                                              else GGUF_OUTPUT))
        head = _gguf_repacked([(np.asarray(source.data), source.tensor_type.name)], cfg.hidden_size, bits, group)
        pad = head_columns(cfg.vocab_size) - cfg.vocab_size       # zero columns: padded logits, dropped
        head = {leaf: jnp.pad(a, ((0, 0), (0, pad))) for leaf, a in head.items()}
    return layers, embedding, head


def held_weight_dtype(dtype, platform: str) -> str | None:
    """DecoderConfig.weight_dtype for a model computing in dtype on platform: float32 for bf16 on the CPU."""
    return "float32" if platform == "cpu" and jnp.dtype(dtype) == jnp.bfloat16 else None


def resolve_dtype(dtype: str, cfg: DecoderConfig, platform: str = "cpu"):
    """vLLM's `--dtype auto`: the checkpoint's dtype, but float32 checkpoints run in bf16 on GPUs.
    platform: the JAX platform the model will run on ("cpu" | "gpu")."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; choose from auto, {', '.join(DTYPES)}")
        return DTYPES[dtype]
    ckpt = DTYPES.get(str(cfg.torch_dtype).replace("torch.", ""), jnp.float32)
    if platform == "cpu":
        return jnp.float32          # CPU bf16 matmuls are slow and less exact; CPU is for testing
    return jnp.bfloat16 if ckpt == jnp.float32 else ckpt


@functools.lru_cache(maxsize=4)
def param_shapes(cfg: DecoderConfig, dtype) -> Any:
    """The parameter tree's ShapeDtypeStructs (layers stacked), without running or allocating anything."""
    model = DecoderModel(cfg, dtype)
    num_blocks, block_size = 2, 4
    kv = jax.ShapeDtypeStruct((cfg.num_layers, 2, num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim), dtype)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    meta = AttentionMetadata(i32(4), i32(4), i32(1, 2), i32(1), i32(2))
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), i32(4), kv, meta, i32(1))
    return shapes["params"]


def layer_bytes(cfg: DecoderConfig, dtype) -> int:
    """Bytes of one decoder layer's weights (what the layer dispatch is chosen by), from the shapes alone."""
    return sum(math.prod(x.shape[1:]) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(param_shapes(cfg, dtype)["layers"]))


def unstack_layers(params, num_layers: int) -> dict:
    """A params tree whose "layers" leaves are lists of per-layer arrays -> "layers" a list of trees."""
    lists = params["layers"]
    per_layer = [jax.tree.map(lambda xs, i=i: xs[i], lists, is_leaf=lambda x: isinstance(x, list))
                 for i in range(num_layers)]
    return {**params, "layers": per_layer}


def _is_scale(name: str) -> bool:
    """Norm scales, k_scale / v_scale, fp8 weight and input scales: ones in dummy weights."""
    return name == "scale" or name.endswith("_scale")


def dummy_params(cfg: DecoderConfig, dtype, seed: int = 0, per_layer: bool = False) -> Any:
    """Random weights of the right shapes (vLLM's --load-format dummy): uniform(-1e-3, 1e-3), norms and
    scales 1. The
    same seed gives the same weights in either layout (per_layer: each layer's slice of the stacked draw)."""
    shapes = param_shapes(cfg, dtype)
    held = held_dtype(cfg, dtype)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    specs = [(sds.shape, sds.dtype, _is_scale(getattr(path[-1], "key", "")),
              per_layer and getattr(path[0], "key", None) == "layers") for path, sds in leaves]
    # quantized blocks (uint8) are zeros: scales of zero, so the weights they stand for are zeros too

    # One program for every leaf (one compile, kept by the persistent cache), not one per leaf: on a GPU
    # each small compile costs ~1 s and a model has ~17 leaves.
    @jax.jit
    def init(keys):
        out: list = []
        for i, (shape, dt, is_norm, split) in enumerate(specs):
            # weights held wider than the model's dtype hold values of that dtype (DecoderConfig.weight_dtype)
            rounded = dtype if dt == held != dtype else dt
            x = (jnp.ones(shape, dt) if is_norm else jnp.zeros(shape, dt) if jnp.issubdtype(dt, jnp.integer) else
                 jax.random.uniform(keys[i], shape, jnp.float32, -1e-3, 1e-3).astype(rounded).astype(dt))
            out.append([x[j] for j in range(shape[0])] if split else x)
        return out

    params = jax.tree_util.tree_unflatten(treedef, init(jax.random.split(jax.random.PRNGKey(seed), len(leaves))))
    return unstack_layers(params, cfg.num_layers) if per_layer else params


def _safetensor_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {str(model_dir)!r} "
                                "(use load_format='dummy' for random weights)")
    return files


def _set(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _held(shapes, path: tuple, dtype):
    """The dtype the parameter at path is held in (DecoderConfig.weight_dtype's, for matmul weights), or dtype
    where the tree has no such parameter (a kernel that quantization="fp8" quantizes after loading)."""
    for key in path:
        if key not in shapes:
            return dtype
        shapes = shapes[key]
    return shapes.dtype


def load_safetensors_params(model_dir: pathlib.Path, cfg: DecoderConfig, dtype, per_layer: bool = False,
                            quant_config: dict | None = None) -> Any:
    """The checkpoint's weights in the decoder's tree; linear layers that cfg keeps quantized come from the
    GGUF file's blocks (GGUF), the folder's quantized tensors (int4, int8 and fp8 checkpoints; quant_config is
    config.json's quantization_config), or its dense weights quantized here (fp8 without quant_config)."""
    import numpy as np

    from jaxpaged.quantization.fp8 import read_fp8_tensor
    shapes = param_shapes(cfg, dtype)
    layer_parts: dict[tuple, list] = {}
    gguf = any(not q.startswith(CHECKPOINT_KINDS) for _, q in cfg.weight_quant)
    online = not gguf and cfg.weight_quant and quant_config is None
    quant_names = quantized_tensor_names(cfg, quant_config)
    quant_modules = {m for path, modules in LINEAR_MODULES.items() if cfg.quant_of(path[-1])
                     for m in modules + ([FUSED_MODULES[path]] if path in FUSED_MODULES else [])}
    blocks, embedding, head = gguf_blocks(model_dir, cfg) if gguf else ({}, None, None)
    quant_tensors: dict[tuple[int, str], dict] = {}
    params: dict = {}
    for file, opened in _weight_files(model_dir, gguf):
        with opened as f:
            for stored in f.keys():
                name = table_name(cfg.family, stored)
                if name.startswith(LAYER_PREFIX):
                    rest = name[len(LAYER_PREFIX):]
                    idx, sub = rest.split(".", 1)
                    module, _, leaf = sub.rpartition(".")
                    if leaf in quant_names and module in quant_modules:
                        fp8_data = f.get_slice(stored).get_dtype() == "F8_E4M3"
                        quant_tensors.setdefault((int(idx), module), {})[leaf] = (
                            read_fp8_tensor(str(file), stored) if fp8_data else np.asarray(f.get_tensor(stored)))
                        continue
                    if sub not in LAYER_TABLE:
                        continue   # e.g. rotary_emb.inv_freq in old checkpoints
                    path, transpose, part = LAYER_TABLE[sub]
                    if path[-1] == "kernel" and cfg.quant_of(path[-2]) and not online:
                        continue   # from the GGUF blocks or the quantized tensors
                    if path[-1] in KV_SCALES:
                        if cfg.kv_cache_dtype != "fp8":
                            continue
                        t = f.get_tensor(stored).astype(jnp.float32).reshape(())
                    else:
                        t = f.get_tensor(stored).astype(dtype)
                    part_idx, num_parts = part or (0, 1)
                    slots = layer_parts.setdefault(path, [[None] * num_parts for _ in range(cfg.num_layers)])
                    slots[int(idx)][part_idx] = t.T if transpose else t
                elif name in TOP_TABLE:
                    path, transpose = TOP_TABLE[name]
                    if path[0] == "lm_head" and (cfg.tie_word_embeddings or cfg.quant_of("lm_head")):
                        continue   # the embedding, or from the GGUF blocks
                    if path[0] == "embed_tokens" and cfg.quant_of("embed_tokens"):
                        continue   # from the GGUF blocks
                    t = f.get_tensor(stored)
                    if path[0] == "lm_head" and cfg.norm_head:      # Baichuan2: rows of unit length
                        t32 = t.astype(jnp.float32)
                        t = t32 / jnp.maximum(jnp.linalg.norm(t32, axis=1, keepdims=True), 1e-12)
                    t = t.astype(dtype).astype(_held(shapes, path, dtype))     # held as the model holds it
                    _set(params, path, t.T if transpose else t)
    if quant_names:
        blocks = quantized_layer_params(quant_tensors, cfg, dtype, quant_config or {})
    if cfg.kv_cache_dtype == "fp8":     # scales the checkpoint lacks are 1.0, as vLLM's
        for name in KV_SCALES:
            for slot in layer_parts.setdefault(("self_attn", name), [[None] for _ in range(cfg.num_layers)]):
                slot[0] = jnp.ones((), jnp.float32) if slot[0] is None else slot[0]
    for path, arrays in blocks.items():
        _set(params, ("layers",) + path, arrays if per_layer else jnp.stack(arrays))
    if embedding is not None:
        _set(params, ("embed_tokens", "qweight"), embedding)
    if head is not None:
        params["lm_head"] = head
    for path, layers in layer_parts.items():
        missing = [i for i, parts in enumerate(layers) if any(t is None for t in parts)]
        if missing:
            raise ValueError(f"checkpoint lacks part of {'.'.join(path)} for layers {missing}")
        held = _held(shapes, ("layers",) + path, dtype)
        arrays = [(jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]).astype(held) for parts in layers]
        _set(params, ("layers",) + path, arrays if per_layer else jnp.stack(arrays))
        layers.clear()
    if online:
        quantize_online(params["layers"], cfg)
    # Every parameter the model needs must have arrived, with the right shape (per layer: its slice's).
    flat_need = dict(jax.tree_util.tree_flatten_with_path(shapes)[0])
    if per_layer:
        flat_need = {p: (jax.ShapeDtypeStruct(sds.shape[1:], sds.dtype) if getattr(p[0], "key", None) == "layers"
                         else sds) for p, sds in flat_need.items()}
    flat_have = dict(jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, list) and per_layer)[0])
    for path, sds in flat_need.items():
        name = jax.tree_util.keystr(path)
        if path not in flat_have:
            raise ValueError(f"checkpoint in {str(model_dir)!r} lacks parameter {name}")
        have = flat_have[path]
        for x in (have if isinstance(have, list) else [have]):
            if tuple(x.shape) != tuple(sds.shape):
                raise ValueError(f"parameter {name}: checkpoint shape {x.shape} != {sds.shape}")
    return unstack_layers(params, cfg.num_layers) if per_layer else params


def load_model(model_dir: os.PathLike, dtype: str = "auto", load_format: str = "auto", seed: int = 0,
               platform: str = "cpu", per_layer: bool = False, quantization: str | None = None,
               kv_cache_dtype: str = "auto") -> LoadedModel:
    """per_layer: params["layers"] is a list of one tree per layer (per-layer and unrolled dispatch);
    quantization: one of QUANTIZATION_METHODS, or None for dense weights; kv_cache_dtype: as model_config's."""
    hf_config = read_hf_config(model_dir)
    cfg = model_config(model_dir, quantization, kv_cache_dtype)
    jdtype = resolve_dtype(dtype, cfg, platform)
    cfg = dataclasses.replace(cfg, weight_dtype=held_weight_dtype(jdtype, platform))
    if load_format == "dummy":
        params = dummy_params(cfg, jdtype, seed, per_layer)
    elif load_format in ("auto", "safetensors"):
        params = load_safetensors_params(pathlib.Path(model_dir), cfg, jdtype, per_layer,
                                         hf_config.get("quantization_config"))
    else:
        raise ValueError(f"load_format {load_format!r} is not supported; choose auto, safetensors or dummy")
    return LoadedModel(cfg, hf_config, params, jdtype)
