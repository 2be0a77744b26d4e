"""Compiled step executables kept on disk, so a warm start-up skips tracing and lowering.

JAX's persistent compilation cache saves XLA's compile, but every start-up still traces the step through
the Flax model and lowers it (Pallas kernels included) once per shape bucket before it can look the
executable up: about 0.5 s a bucket, most of the start-up with a warm cache. Here each compiled program
of a bucket's step (the step itself, or under per_layer dispatch its embedding, layer-group and head
programs: runner/step.py names them) is serialized (jax.experimental.serialize_executable) under its key,
in a folder named by a fingerprint of everything it was built from: JAX and jaxlib versions, the device,
XLA_FLAGS, the jaxpaged sources, the model config, dtype, layer dispatch, attention backend and pool
shape. A later start-up with the same fingerprint loads the executables and calls them directly. Anything
that fails to load, or to run in warm-up, falls back to tracing with a warning (XLA:CPU cannot run some
deserialized bf16 programs). config.resolve turns it on on GPUs (RunConfig.executable_cache), where it
roughly halves a small model's warm start-up.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import pathlib
import pickle
import time
from typing import Any

import jax

logger = logging.getLogger("jaxpaged.runner")

def _sources_digest() -> str:
    """Every source file the step is built from: jaxpaged and its models and kernels packages, which in a
    source checkout live in separate folders (pyproject's package-dir). The HTTP server builds no part of
    the step, so its package is left out (installed, it is a folder inside jaxpaged's)."""
    import jaxpaged
    import jaxpaged.models
    import jaxpaged.pallas_kernels
    h = hashlib.sha256()
    for mod in (jaxpaged, jaxpaged.models, jaxpaged.pallas_kernels):
        root = pathlib.Path(mod.__file__).resolve().parent
        for path in sorted(root.rglob("*.py")):
            if mod is jaxpaged and path.relative_to(root).parts[0] == "server":
                continue
            h.update(f"{mod.__name__}/{path.relative_to(root)}".encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def fingerprint(*parts: Any) -> str:
    """A digest of the toolchain, the device, the jaxpaged sources and the given parts (config, shapes)."""
    import jaxlib
    device = jax.devices()[0]
    items = (jax.__version__, getattr(jaxlib, "__version__", "?"), device.platform, device.device_kind,
             os.environ.get("XLA_FLAGS", ""), _sources_digest()) + tuple(repr(p) for p in parts)
    return hashlib.sha256(repr(items).encode()).hexdigest()[:24]


def _ensure_mosaic_gpu_runtime() -> None:
    """Importing Mosaic GPU points its custom call at libmosaic_gpu_runtime.so (MOSAIC_GPU_RUNTIME_LIB_PATH).

    A deserialized executable holding a Mosaic GPU kernel, loaded before anything imported Mosaic GPU,
    fails with "Symbols not found: mosaic_gpu_init_tma_desc": import first.
    """
    if jax.devices()[0].platform != "gpu":
        return
    try:
        from jax.experimental.mosaic import gpu  # noqa: F401 - imported for its side effect
    except Exception:  # noqa: BLE001 - a jaxlib without Mosaic GPU has no such kernels to load
        pass


_NOT_READ = object()        # load: no load_many entry for the key


class ExecutableCache:
    def __init__(self, root: os.PathLike, fingerprint_: str):
        self.dir = pathlib.Path(root) / fingerprint_
        _ensure_mosaic_gpu_runtime()                 # before any load
        self.hits = self.misses = 0
        self.load_s = 0.0                            # wall seconds spent reading and deserializing
        self._prefetched: dict[str, Any] = {}        # repr(key) -> load_many's executable (None: none)

    def load_many(self, keys: list, threads: int) -> None:
        """Read and deserialize the executables of `keys` on `threads` threads, ahead of the `load` calls
        that then take them in turn. XLA's deserialization runs without the GIL, so a warm start-up's
        loads overlap instead of queueing behind each other and behind each bucket's first run."""
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(min(threads, len(keys)), thread_name_prefix="exec-cache") as ex:
            for key, compiled in zip(keys, ex.map(self._load_file, keys)):
                self._prefetched[repr(key)] = compiled
        self.load_s += time.perf_counter() - t0

    def _path(self, key: Any) -> pathlib.Path:
        return self.dir / (hashlib.sha256(repr(key).encode()).hexdigest()[:32] + ".bin")

    def prefetched(self, key: Any) -> bool:
        """Whether load_many read `key`'s executable (False for a miss or a file that failed to load)."""
        return self._prefetched.get(repr(key)) is not None

    def load(self, key: Any):
        """The executable stored under `key` (load_many's, when it fetched it), else None (a miss)."""
        compiled = self._prefetched.pop(repr(key), _NOT_READ)
        if compiled is _NOT_READ:
            t0 = time.perf_counter()
            compiled = self._load_file(key)
            self.load_s += time.perf_counter() - t0
        if compiled is None:
            self.misses += 1
        else:
            self.hits += 1
        return compiled

    def _load_file(self, key: Any):
        from jax.experimental import serialize_executable
        path = self._path(key)
        if not path.exists():
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        except Exception as e:  # noqa: BLE001 - a stale or broken entry must never stop the engine
            logger.warning("Cached executable %s did not load (%s: %s); compiling instead", path.name,
                           type(e).__name__, e)
            return None

    def discard(self, key: Any) -> None:
        self._path(key).unlink(missing_ok=True)
        self.hits -= 1
        self.misses += 1

    def store(self, key: Any, compiled) -> None:
        from jax.experimental import serialize_executable
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = self._path(key).with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(blob)
            tmp.replace(self._path(key))           # atomic: a concurrent start-up never reads half a file
        except Exception as e:  # noqa: BLE001 - caching is an optimisation only
            logger.warning("Could not cache a compiled step (%s: %s)", type(e).__name__, e)
