"""Host-side cost of one engine step, with the device taken out: the jitted step is replaced by a stub
that returns random token ids at once, so what is timed is scheduling, input preparation, sampling-input
preparation and output processing only (the work that must hide behind the GPU's step).

    python bench/host_overhead.py --num-requests 256 --output-len 128 [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2-0.5b", help="bench model name (dummy weights)")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--profile", action="store_true", help="print the top functions by own time")
    args = ap.parse_args()
    import numpy as np

    from bench.models import ensure_model_dir
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.runner import step

    cfg_path = ensure_model_dir(args.model)
    llm = LLM(model=cfg_path, load_format="dummy", dtype="float32", max_model_len=2048, num_gpu_blocks_override=65536,
              max_num_seqs=args.max_num_seqs, compile_buckets=False)
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(0)

    def fake_packed_step(params, kv_cache, prev_sampled, ints, floats, *, layout, cfg, dtype, options, flags):
        # rows = the length of the first float input (the temperatures: ModelInput holds only ints)
        r = next(shape[0] for kind, shape, _ in layout[1] if kind == "f")
        ids = rng.integers(0, vocab, r).astype(np.int32)
        z = np.zeros(r, np.float32)
        empty = np.zeros((r, 0))
        return kv_cache, prev_sampled, (ids, z, z.astype(np.int32), empty.astype(np.int32), empty, ()), None

    step.packed_step = fake_packed_step      # what StepPrograms calls under the layer scan (the CPU's)
    prompts = [rng.integers(100, vocab - 200, int(n)).tolist() for n in rng.integers(50, 400, args.num_requests)]
    sp = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:8], sp, use_tqdm=False)
    st = engine.stats
    s0 = (st.schedule_s, st.execute_s, st.process_s, st.num_steps)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    if args.profile:
        prof.enable()
    llm.generate(prompts, sp, use_tqdm=False)
    prof.disable()
    dt = time.perf_counter() - t0
    n = st.num_steps - s0[3]
    print(f"{n} steps, {args.num_requests} requests: host {dt / n * 1e3:.2f} ms/step = schedule "
          f"{(st.schedule_s - s0[0]) / n * 1e3:.2f} + dispatch (prepare + launch) "
          f"{(st.execute_s - s0[1]) / n * 1e3:.2f}"
          f" + output processing {(st.process_s - s0[2]) / n * 1e3:.2f}")
    if args.profile:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
