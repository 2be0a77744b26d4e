"""A lowering worker's process (`python -m jaxpaged.runner.lowering_worker`): it reads a LoweringJob from
stdin and writes each program's export to stdout as it is done (lowering_workers.py says why and how)."""
from __future__ import annotations

import contextlib
import os
import pickle
import sys
import types

import jax
import jax.numpy as jnp

from jaxpaged.models import kv_cache_dtype
from jaxpaged.runner.lowering_workers import LENGTH, HeadWork, LoweringJob, Result, export_platform
from jaxpaged.runner.step import StepPrograms


def _serve(job: LoweringJob, out) -> None:
    """Export each program of the job's work and send it."""
    dtype = jnp.dtype(job.dtype)
    programs = StepPrograms(job.params, job.cfg, dtype, job.run, job.pool_shape, job.max_blocks_per_req,
                            job.max_rows, None)
    pool_dtype = kv_cache_dtype(job.cfg, dtype, job.run.platform)
    state = types.SimpleNamespace(kv_cache=jax.ShapeDtypeStruct(job.pool_shape, pool_dtype),
                                  prev_sampled=jax.ShapeDtypeStruct((job.max_rows,), jnp.int32))
    platform = export_platform(job.run)
    with _target_device(job):
        _export_all(job, programs, state, platform, out)


def _target_device(job: LoweringJob):
    """A context naming the engine's GPU to the kernels' lowering: Pallas asks JAX for the device, and in a
    process without one JAX reads the abstract mesh's abstract device (its kind picks the Triton target;
    Mosaic GPU then takes compute capability 9.0, which is why resolve() starts workers for Hopper GPUs
    only). Nothing for the CPU."""
    if job.run.platform != "gpu":
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind=job.device_kind, num_cores=job.run.num_sms, platform="gpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device))


def _export_all(job: LoweringJob, programs: StepPrograms, state, platform: str, out) -> None:
    for item, work in enumerate(job.work):
        specs, error = [], None
        options = programs.options(work.bucket, work.steps)
        try:
            if isinstance(work, HeadWork):
                shape, dtype = work.hidden
                specs = [programs.resample_spec(work.bucket, options, work.flags,
                                                jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)))[1]]
            else:
                specs = list(programs.program_specs(state, work.bucket, options, work.flags).values())
        except Exception as e:  # noqa: BLE001 - the engine lowers what a worker cannot
            error = f"{type(e).__name__}: {e}"
        for pos in work.positions:
            result = Result(item, pos, None, None, error)
            if specs:
                try:
                    blob, out_tree = specs[pos].export(platform)
                    result = Result(item, pos, blob, out_tree, None)
                except Exception as e:  # noqa: BLE001
                    result = Result(item, pos, None, None, f"{type(e).__name__}: {e}")
            frame = pickle.dumps(result)
            out.write(LENGTH.pack(len(frame)) + frame)
            out.flush()


def main() -> None:
    job = pickle.load(sys.stdin.buffer)
    if job.nice:
        os.nice(job.nice)
    # The frames go to the original stdout; anything else printed (by C++ too) goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _serve(job, out)
    out.close()


if __name__ == "__main__":
    main()
