"""Lowering a cold start-up's programs in worker processes.

Why: a cold start-up compiles every bucket's programs, and lowering one (tracing the model, its Pallas
kernels and the sampler, then building its MLIR) is Python that holds the GIL: the engine lowered one
program at a time while its compile threads waited (llama3-8b on the H100: 46 s of lowering for 35
buckets, the compiles trailing it by 26 s). Lowering needs no device, so other processes can do it.

How: each worker is `python -m jaxpaged.runner.lowering_worker`, running JAX on the CPU
(JAX_PLATFORMS=cpu: no GPU memory, no CUDA context). It reads a LoweringJob from stdin (the step's
configuration, the shapes of the weights, pool and buffers, and its share of the buckets), builds the same
StepPrograms over those shapes, exports each program it was given for the engine's platform
(ProgramSpec.export: jax.export, whose program names its device facts, RuntimeOptions.interpret and
num_sms, instead of asking the worker's JAX) and writes each back on stdout as it is done. The engine
compiles each one on its start-up threads as it arrives (ProgramSpec.lower_exported), and lowers itself
any program a worker could not export.

The same workers lower the head-and-sampler programs (layerwise.resample) that a GPU's warm-up queues for its
common sampler variants once the engine serves: traced in the engine's process, their Python would hold the
GIL, and with it the engine loop and every running request's dispatch, while they compile.
"""
from __future__ import annotations

import logging
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
from typing import Any, Iterator, NamedTuple

logger = logging.getLogger("jaxpaged.runner")

WORKER_MODULE = "jaxpaged.runner.lowering_worker"      # what each worker runs (python -m)
LENGTH = struct.Struct(">Q")       # each frame on a worker's stdout: its length, then a pickled Result


class LoweringJob(NamedTuple):
    """Everything a worker needs: picklable, shapes instead of arrays."""
    cfg: Any                       # models.DecoderConfig
    dtype: str                     # the weights' and pool's dtype, by name
    run: Any                       # config.RunConfig (the engine's)
    pool_shape: tuple              # the KV pool's shape
    max_blocks_per_req: int
    max_rows: int                  # the sampled-token buffer's length
    params: Any                    # the weights' tree (layers as a list of per-layer trees), ShapeDtypeStructs
    device_kind: str               # the engine's device ("NVIDIA H100 80GB HBM3"): what the kernels lower for
    work: list                     # [StepWork | HeadWork]
    nice: int = 0                  # the worker's nice value (os.nice before JAX starts its threads)


class StepWork(NamedTuple):
    """Programs of one bucket's step."""
    bucket: Any                    # runner.buckets.Bucket
    steps: int                     # decode steps a program
    positions: tuple[int, ...]     # which of the step's programs to export (StepPrograms._program_keys order,
                                   # duplicates dropped)
    flags: Any                     # runner.sampler.SamplerFlags


class HeadWork(NamedTuple):
    """The head-and-sampler program (layerwise.resample) of a sampler variant for one single-step bucket."""
    bucket: Any
    steps: int
    flags: Any
    hidden: tuple[tuple[int, ...], str]   # the step's sampled rows' hidden states: shape, dtype name

    @property
    def positions(self) -> tuple[int, ...]:
        return (0,)                # one program


class Result(NamedTuple):
    item: int                      # index into the job's work
    position: int                  # which of the item's programs (program_keys order, duplicates dropped)
    blob: bytes | None             # the serialized jax.export, or None when it failed
    out_tree: Any                  # the program's outputs' tree structure (ProgramSpec.export)
    error: str | None              # why it failed


def export_platform(run) -> str:
    """jax.export's name of the platform the engine runs on."""
    return "cuda" if run.platform == "gpu" else run.platform


class LoweringWorkers:
    """Worker processes, one job each, started at once; results() yields what they send as it comes."""

    def __init__(self, jobs: list[LoweringJob]):
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        self._queue: queue.Queue = queue.Queue()
        self._procs = []
        for index, job in enumerate(jobs):
            proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE], env=env,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self._procs.append(proc)
            threading.Thread(target=self._feed_and_read, args=(index, proc, job), daemon=True,
                             name=f"lowering-worker-{index}").start()
        self._expected = {(index, item, pos) for index, job in enumerate(jobs)
                          for item, work in enumerate(job.work) for pos in work.positions}

    def _feed_and_read(self, index: int, proc: subprocess.Popen, job: LoweringJob) -> None:
        """Send the job, then pass every frame back to the queue; None marks the end of the stream."""
        try:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(pickle.dumps(job))
            proc.stdin.close()
            while header := proc.stdout.read(LENGTH.size):
                (n,) = LENGTH.unpack(header)
                self._queue.put((index, pickle.loads(proc.stdout.read(n))))
        except Exception as e:  # noqa: BLE001 - a broken worker only costs its programs' lowering here
            logger.warning("Lowering worker %d failed (%s: %s)", index, type(e).__name__, e)
        finally:
            self._queue.put((index, None))

    def results(self) -> Iterator[tuple[int, Result]]:
        """(job index, Result) for every program of every job: what the workers sent, then a failed Result
        for each program a worker did not send before its stream ended."""
        open_streams = len(self._procs)
        while open_streams:
            index, result = self._queue.get()
            if result is None:
                open_streams -= 1
                code = self._procs[index].wait()
                lost = sorted(e for e in self._expected if e[0] == index)
                for _, item, pos in lost:
                    self._expected.discard((index, item, pos))
                    yield index, Result(item, pos, None, None, f"the worker exited ({code}) before sending it")
                continue
            self._expected.discard((index, result.item, result.position))
            yield index, result

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
