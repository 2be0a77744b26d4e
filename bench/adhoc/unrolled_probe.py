"""Which unrolled-dispatch program fails on the GPU, with its traceback (session 11: a ShareGPT run with
JAXPAGED_LAYER_DISPATCH=unrolled stopped on "Input buffer 2 is not 256-byte aligned [jit_whole_step]";
the same model generated fine with no bucket warm-up, no executable cache and 0.3 of memory). Fixed in the
twelfth session: buffer 2 of the Mosaic ragged kernel is the block tables, a slice of the packed step
inputs that XLA passed as a pointer off the 256-byte grid; unrolled layers now align their packed inputs
(runner/step_inputs.py MOSAIC_ALIGN). JAXPAGED_INPUT_ALIGN=1 brings the failure back, for checking.

    python3 bench/adhoc/unrolled_probe.py [--steps 1,16] [--compile-buckets] [--mem 0.9] [--small]
    python3 bench/adhoc/unrolled_probe.py --steps 16 --small --each-bucket   # warm buckets one by one
    (JAXPAGED_EXEC_CACHE=0 / 1 switches the executable cache; JAXPAGED_PINNED_INPUTS=0 / 1 the pinned inputs)
"""
import argparse
import traceback

ap = argparse.ArgumentParser()
ap.add_argument("--steps", default="1,16")
ap.add_argument("--backend", default=None)
ap.add_argument("--model", default="qwen2-0.5b", help="a bench model name (dummy weights) or an HF folder")
ap.add_argument("--compile-buckets", action="store_true")
ap.add_argument("--mem", type=float, default=0.3)
ap.add_argument("--max-model-len", type=int, default=1024)
ap.add_argument("--small", action="store_true", help="max_num_seqs 16, max_num_batched_tokens 512: few buckets")
ap.add_argument("--each-bucket", action="store_true",
                help="warm the buckets up one at a time (runner.warmup), printing each one's outcome")
args = ap.parse_args()

from bench.models import ensure_model_dir  # noqa: E402
from jaxpaged import LLM, SamplingParams  # noqa: E402

small = dict(max_num_seqs=16, max_num_batched_tokens=512) if args.small else {}
for steps in [int(s) for s in args.steps.split(",")]:
    try:
        path = args.model if "/" in args.model else ensure_model_dir(args.model)
        llm = LLM(model=path, load_format="dummy", dtype="bfloat16", max_model_len=args.max_model_len,
                  layer_dispatch="unrolled", num_scheduler_steps=steps, compile_buckets=args.compile_buckets,
                  attention_backend=args.backend, gpu_memory_utilization=args.mem, **small)
        if args.each_bucket:
            eng = llm.llm_engine
            for b in eng.buckets.all_buckets():
                try:
                    eng.runner.warmup([b], progress=False, num_steps=steps)
                    print(f"  bucket {b}: OK", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"  bucket {b}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
        outs = llm.generate([[5, 6, 7, 8] * 20, [9] * 50], SamplingParams(max_tokens=40, ignore_eos=True),
                            use_tqdm=False)
        print(f"steps={steps} {vars(args)}: OK", [len(o.outputs[0].token_ids) for o in outs], flush=True)
        del llm
    except Exception:  # noqa: BLE001
        print(f"steps={steps} {vars(args)}: FAILED", flush=True)
        traceback.print_exc()
