"""quantization="gguf" at 8B on the GPU: a llama3-8b-shaped GGUF file of random blocks, served from its blocks,
against the dense bf16 run of the same file.

The file: llama3-8b's shapes (hidden 4096, 32 layers, 32 / 8 heads, MLP 14336, rope base 500000) with SmolLM2's
tokenizer and vocabulary (49,152 tokens, copied from the default model's GGUF: no 8B GGUF can be downloaded
here), every byte of every block random but the float16 scale fields (small normals). Types:
  q4k   every linear layer and the embedding Q4_K, the output Q6_K
  q4km  llama.cpp's Q4_K_M mix: as q4k, but attn_v and ffn_down Q6_K in every other layer
  q4k-tied, q8-tied   as q4k, but no output tensor: the LM head is the embedding (Q4_K, or Q8_0 as the
        default SmolLM2 file's), which quantization="gguf" runs in the W4A16 kernel as 4- or 8-bit values
For each run: the start-up to a ready LLM, one request's decode time per token (128 tokens after a warm-up
request, wall clock), the bytes the run wrote into the model cache, and which linear layers stayed in blocks.
--dense: the first file also dense in bf16 (from its folder without weights: the loader dequantizes the file).

    python3 bench/gguf_8b.py --out DIR [--types q4k,q4km] [--dense] [--work /tmp/gguf8b] [--git-rev REV]
        [--tokenizer-from tok.gguf] [--probe TRACE_DIR]
    python3 bench/gguf_8b.py --out . --write-tokenizer tok.gguf      (here, before a GPU call: the fields alone)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # an installed jaxpaged wins

SHAPE = dict(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, rope_base=500000.0)
F16_FIELDS = {"Q4_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,)}
TYPES = ("q4k", "q4km", "q4k-tied", "q8-tied")


def random_blocks(rng, qtype: str, rows: int, cols: int):
    import gguf
    import numpy as np
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        raw[..., off:off + 2] = rng.normal(0, 1e-3, size=(rows, cols // block)).astype(np.float16)[..., None] \
            .view(np.uint8)
    return raw.reshape(rows, -1)


def write_tokenizer_file(path: Path) -> None:
    """The default model's tokenizer fields alone, in a GGUF file of no tensors (a few MB: what --tokenizer-from
    needs where the 100 MB default model is not installed, such as a GPU machine)."""
    import gguf

    from jaxpaged.models.gguf_convert import find_default_gguf
    src = gguf.GGUFReader(str(find_default_gguf()))
    w = gguf.GGUFWriter(str(path), "llama")
    _copy_tokenizer(src, w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _copy_tokenizer(src, w) -> None:
    import gguf
    for key, field in src.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            w.add_key_value(key, field.contents(), vtype,
                            sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)


def write_file(path: Path, types: str, tokenizer_from: str | None) -> None:
    import gguf
    import numpy as np

    from jaxpaged.models.gguf_convert import find_default_gguf
    if types not in TYPES:
        raise ValueError(f"file type {types!r}: one of {', '.join(TYPES)}")
    src = gguf.GGUFReader(tokenizer_from or str(find_default_gguf()))
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    h, ffn, heads, kv = SHAPE["hidden"], SHAPE["ffn"], SHAPE["heads"], SHAPE["kv_heads"]
    head_dim = h // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"Random 8B {types}")
    w.add_context_length(8192)
    w.add_embedding_length(h)
    w.add_block_count(SHAPE["layers"])
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(SHAPE["rope_base"])
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    _copy_tokenizer(src, w)
    rng = np.random.default_rng(0)

    def add(name: str, qtype: str, rows: int, cols: int):
        w.add_tensor(name, random_blocks(rng, qtype, rows, cols), raw_dtype=gguf.GGMLQuantizationType[qtype])
    add("token_embd.weight", "Q8_0" if types == "q8-tied" else "Q4_K", vocab, h)
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    if not types.endswith("-tied"):
        add("output.weight", "Q6_K", vocab, h)
    for i in range(SHAPE["layers"]):
        more_bits = types == "q4km" and i % 2 == 0
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, np.float32))
        add(f"blk.{i}.attn_q.weight", "Q4_K", h, h)
        add(f"blk.{i}.attn_k.weight", "Q4_K", kv * head_dim, h)
        add(f"blk.{i}.attn_v.weight", "Q6_K" if more_bits else "Q4_K", kv * head_dim, h)
        add(f"blk.{i}.attn_output.weight", "Q4_K", h, h)
        add(f"blk.{i}.ffn_gate.weight", "Q4_K", ffn, h)
        add(f"blk.{i}.ffn_up.weight", "Q4_K", ffn, h)
        add(f"blk.{i}.ffn_down.weight", "Q6_K" if more_bits else "Q4_K", h, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def folder_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0


def run(model: str, quantization: str | None, models_dir: Path, probe_dir: str | None = None) -> dict:
    import jax

    from bench.gguf_gpu import one_request_ms
    from jaxpaged import LLM
    before = folder_bytes(models_dir)
    t0 = time.perf_counter()
    llm = LLM(model=model, quantization=quantization, dtype="bfloat16", max_model_len=2048, compile_buckets=False,
              seed=0)
    start_s = time.perf_counter() - t0
    per_token_ms = one_request_ms(llm, list(range(100, 128)))
    out = {"quantization": quantization, "weight_quant": dict(llm.llm_engine.model_config.weight_quant),
           "start_s": round(start_s, 1), "c1_ms_per_token": round(per_token_ms, 3),
           "cache_bytes_written": folder_bytes(models_dir) - before, "device": jax.devices()[0].device_kind}
    if probe_dir:      # one request's decode step under the profiler: its kernels by total time
        from bench.step_probe import time_decode_steps
        probe = time_decode_steps(llm, (1,), 256, probe_dir)[1]
        out["probe"] = {k: probe.get(k) for k in ("blocking_us", "pipelined_us", "launch_us", "busy",
                                                   "top_kernels_per_10_steps")}
    del llm
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--types", default="q4k")
    ap.add_argument("--dense", action="store_true", help="also the dense bf16 run of the first file")
    ap.add_argument("--work", default="/tmp/gguf8b")
    ap.add_argument("--git-rev", default="unknown")
    ap.add_argument("--tokenizer-from", help="a GGUF file whose tokenizer fields to copy (default: the default "
                                             "model's)")
    ap.add_argument("--write-tokenizer", help="only write the default model's tokenizer fields to this file")
    ap.add_argument("--probe", help="folder: trace one request's decode steps (bench/step_probe.py), print the "
                                    "top kernels")
    args = ap.parse_args()
    if args.write_tokenizer:
        write_tokenizer_file(Path(args.write_tokenizer))
        return
    from bench.gguf_gpu import save_results
    from jaxpaged import envs
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    models_dir = envs.JAXPAGED_CACHE_ROOT / "models"
    results = []
    for types in args.types.split(","):
        path = work / f"random-8b-{types}.gguf"
        t0 = time.perf_counter()
        write_file(path, types, args.tokenizer_from)
        print(f"{types}: wrote {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", flush=True)
        r = {"types": types, "label": "gguf",
             **run(str(path), "gguf", models_dir, args.probe and f"{args.probe}/{types}")}
        print(json.dumps(r), flush=True)
        results.append(r)
        if args.dense and len(results) == 1:
            # the same file dense in bf16: its folder without weights, so the loader dequantizes the file's
            # tensors itself (no 32 GB float32 copy on disk)
            from jaxpaged.models.gguf_convert import gguf_model_dir
            lean = gguf_model_dir(path, models_dir, weights=False)
            r = {"types": types, "label": "dense", **run(str(lean), None, models_dir)}
            print(json.dumps(r), flush=True)
            results.append(r)
    save_results(args.out, "gguf_8b", args.git_rev, results)


if __name__ == "__main__":
    main()
