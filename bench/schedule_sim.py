"""What another schedule of an offline run would take: a step-cost model fitted to a measured step log
(`bench/throughput.py --step-log CSV`), and the engine's scheduler replayed over the same requests under other
limits. A lever is worth a GPU call if the model says it pays; the model is no measurement of it.

The model (milliseconds a step): base + per_ctx x (context tokens / 1000) + max(weights, per_token x tokens). The
GEMMs read the weights once a step and are bound by them up to weights / per_token tokens, by the tensor cores
beyond; the attention, the KV write and the other per-request kernels grow with the context the step reads. It is
fitted to the log's decode steps (a grid over weights, 1-20 ms by 0.05, and per_token, 0-100 us by 0.5: an 8B
model's range on an H100; least squares for the rest, residuals clipped at 2 ms) and checked by replaying the
log's own limits: the replay's seconds and steps beside the log's. Decode steps alone leave the fit loose (their
rows and context grow together), so the check on the whole log, mixed steps included, is what to read first.

The replay schedules as jaxpaged's scheduler does: each step the running requests first (a decode token each, or
their prompt's next chunk), then waiting requests in arrival order while the token budget and max_num_seqs
allow; no preemption (the pool is taken to hold every admitted request). `--overlap` prices each step as if
the context's work ran entirely beside the GEMMs (max instead of sum): the bound of that lever.

What the model misses: it prices a prompt token like a decode row. Small prompt chunks beside running decodes
cost more a token than whole 16k-token chunks, so a schedule that spreads the prompts through the run (a
max_num_seqs cap) comes out optimistic; bench/results/NOTES.md has a cap it predicted to gain and that measured
slower.

    python -m bench.schedule_sim STEP_LOG --dataset .cache/gpu/bench_data/sharegpt-llama3-8b-n1000-s0.json \\
        [--max-num-seqs 1024,512,384,256,192,128] [--max-num-batched-tokens 16384] [--overlap]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

if __package__ in (None, ""):   # run as a file: see bench/common.py add_repo_to_path
    _bench = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _bench]
    sys.path.append(str(_bench.parent))

from bench.step_log_table import load, mixed_steps  # noqa: E402


class CostModel(NamedTuple):
    base_ms: float
    per_ctx_ms: float           # a thousand context tokens
    weights_ms: float
    per_token_ms: float
    overlap: bool = False       # the context's work beside the GEMMs

    def step_ms(self, tokens: np.ndarray | int, ctx: np.ndarray | int):
        gemm = np.maximum(self.weights_ms, self.per_token_ms * np.asarray(tokens, np.float64))
        attn = self.per_ctx_ms * np.asarray(ctx, np.float64) / 1e3
        return self.base_ms + (np.maximum(gemm, attn) if self.overlap else gemm + attn)


def fit(steps: np.ndarray) -> CostModel:
    """The model of the module docstring, from a step log's decode steps ([steps, 4]: seconds, tokens, requests,
    context tokens)."""
    dec = steps[~mixed_steps(steps)]
    ms, tokens, ctx = dec[:, 0] * 1e3, dec[:, 1], dec[:, 3] / 1e3
    a = np.stack([np.ones_like(ms), ctx], 1)
    best = None
    for weights in np.arange(1.0, 20.0, 0.05):
        for per_token in np.arange(0.0, 0.1, 0.0005):
            y = ms - np.maximum(weights, per_token * tokens)
            coef = np.linalg.lstsq(a, y, rcond=None)[0]
            err = float(np.sum(np.minimum((a @ coef - y) ** 2, 4.0)))
            if best is None or err < best[0]:
                best = (err, CostModel(float(coef[0]), float(coef[1]), float(weights), float(per_token)))
    assert best is not None
    return best[1]


class Replay(NamedTuple):
    seconds: float
    steps: int
    output_tokens: int
    ttft_median_s: float        # each request's first token: the end of the step its prompt's last chunk ran in


def simulate(prompt_lens: list[int], output_lens: list[int], model: CostModel, max_num_seqs: int,
             max_num_batched_tokens: int, record: list | None = None) -> Replay:
    """The requests (arrived at once, in this order) under the limits; record, if given, gets each step's
    (seconds, tokens, requests, context tokens), as a step log has them."""
    waiting = list(range(len(prompt_lens)))[::-1]          # popped from the end: arrival order
    running: list[list[int]] = []                          # [index, prompt tokens computed, tokens generated]
    seconds, steps, out, ttft = 0.0, 0, 0, []
    while waiting or running:
        budget, chunks = max_num_batched_tokens, []
        for r in running:
            need = 1 if r[1] == prompt_lens[r[0]] else min(prompt_lens[r[0]] - r[1], budget)
            if need > 0:
                chunks.append((r, need))
                budget -= need
        while waiting and len(running) < max_num_seqs and budget > 0:
            i = waiting.pop()
            running.append([i, 0, 0])
            need = min(prompt_lens[i], budget)
            chunks.append((running[-1], need))
            budget -= need
        tokens = ctx = firsts = 0
        for r, need in chunks:
            i = r[0]
            tokens += need
            if r[1] < prompt_lens[i]:
                r[1] += need
                ctx += r[1]
                if r[1] == prompt_lens[i]:      # the prompt's last chunk samples the first token
                    r[2], out, firsts = 1, out + 1, firsts + 1
            else:
                ctx += prompt_lens[i] + r[2]
                r[2], out = r[2] + 1, out + 1
        s = float(model.step_ms(tokens, ctx)) / 1e3
        if record is not None:
            record.append((s, tokens, len(chunks), ctx))
        seconds, steps = seconds + s, steps + 1
        ttft += [seconds] * firsts
        running = [r for r in running if r[2] < output_lens[r[0]]]
    return Replay(seconds, steps, out, float(np.median(ttft)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step_log", help="a step log CSV of an offline run (throughput.py --step-log)")
    p.add_argument("--dataset", required=True, help="the run's requests: a bench/datasets.py cache JSON")
    p.add_argument("--max-num-seqs", default="1024,512,384,256,192,128")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--log-max-num-seqs", type=int, default=1024, help="the limit the logged run had")
    p.add_argument("--overlap", action="store_true", help="also price every limit with the context's work beside "
                                                          "the GEMMs")
    a = p.parse_args()
    steps = load(a.step_log)
    reqs = json.loads(Path(a.dataset).read_text())
    prompt_lens = [len(r["prompt_token_ids"]) for r in reqs]
    output_lens = [r["output_len"] for r in reqs]
    model = fit(steps)
    print(f"model: {model.base_ms:.3f} ms + {model.per_ctx_ms:.4f} ms a 1k context tokens + max("
          f"{model.weights_ms:.2f} ms, {model.per_token_ms * 1e3:.1f} us a token)")
    r = simulate(prompt_lens, output_lens, model, a.log_max_num_seqs, a.max_num_batched_tokens)
    print(f"the log: {steps[:, 0].sum():.2f} s in {len(steps)} steps; replayed at max_num_seqs "
          f"{a.log_max_num_seqs}: {r.seconds:.2f} s in {r.steps} steps ({r.output_tokens} output tokens)")
    print("\n| max_num_seqs | pricing | seconds | steps | output tok/s | TTFT median, all sent at once |\n"
          "|---|---|---|---|---|---|")
    for limit in (int(x) for x in a.max_num_seqs.split(",")):
        for overlap in (False, True) if a.overlap else (False,):
            r = simulate(prompt_lens, output_lens, model._replace(overlap=overlap), limit, a.max_num_batched_tokens)
            print(f"| {limit} | {'overlapped' if overlap else 'as measured'} | {r.seconds:.2f} | {r.steps} | "
                  f"{r.output_tokens / r.seconds:,.0f} | {r.ttft_median_s:.2f} s |")


if __name__ == "__main__":
    main()
