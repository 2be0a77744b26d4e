"""A pytest plugin that records every XLA compile the suite asks for: which test asked, the program's name, how long
it took, whether JAX's persistent cache answered it, and a digest of the lowered program (equal digests are the
same program compiled again, in another test or another worker). What it tells: how many distinct programs a cold
suite compiles, and which modules' programs no other module shares.

    pytest tests -n 2 --dist loadfile -p bench.compile_profile --compile-profile DIR
    python3 bench/compile_profile.py DIR          # the per-module table and the programs compiled most often

Each worker writes DIR/<worker>.jsonl. It wraps JAX's internal compile entry point (jax._src.compiler), so it is
a measuring tool for this JAX version, not part of the engine."""
from __future__ import annotations

import collections
import hashlib
import json
import os
import sys
import time

_state = {"test": "", "out": None, "hit": False}


def pytest_addoption(parser):
    parser.addoption("--compile-profile", metavar="DIR", help="write each XLA compile's record under DIR")


def pytest_configure(config):
    folder = config.getoption("compile_profile")
    if not folder:
        return
    os.makedirs(folder, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    _state["out"] = open(os.path.join(folder, f"{worker}.jsonl"), "a", buffering=1)

    import jax
    from jax._src import compiler

    def on_event(event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            _state["hit"] = True
    jax.monitoring.register_event_listener(on_event)
    original = compiler.compile_or_get_cached

    def recorded(backend, computation, *args, **kwargs):
        from jax._src.lib.mlir import ir
        name = ir.StringAttr(computation.operation.attributes["sym_name"]).value
        digest = hashlib.sha1(computation.operation.get_asm(binary=True, enable_debug_info=False)).hexdigest()[:16]
        _state["hit"] = False
        start = time.perf_counter()
        try:
            return original(backend, computation, *args, **kwargs)
        finally:
            _state["out"].write(json.dumps({"test": _state["test"], "name": name, "digest": digest,
                                            "secs": round(time.perf_counter() - start, 4),
                                            "hit": _state["hit"]}) + "\n")
    compiler.compile_or_get_cached = recorded


def pytest_runtest_logstart(nodeid, location):
    _state["test"] = nodeid


def pytest_sessionstart(session):
    _state["test"] = "(collection)"


def summarize(folder: str) -> None:
    """Print the per-module table of the records under `folder`."""
    records = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".jsonl"):
            with open(os.path.join(folder, name)) as f:
                records += [json.loads(line) for line in f if line.strip()]
    module = lambda r: r["test"].split("::")[0]        # noqa: E731
    by_module: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    modules_of = collections.defaultdict(set)
    for r in records:
        m = by_module[module(r)]
        m["compiles"] += 1
        m["secs"] += r["secs"]
        if not r["hit"]:
            m["misses"] += 1
            m["miss_secs"] += r["secs"]
        modules_of[r["digest"]].add(module(r))
    for mods in modules_of.values():
        if len(mods) == 1:
            by_module[next(iter(mods))]["own"] += 1
    print(f"{len(records)} compiles, {len({r['digest'] for r in records})} distinct programs, "
          f"{sum(r['secs'] for r in records if not r['hit']):.0f} s in cache misses\n")
    print("| module | compiles | s | misses | miss s | programs no other module has |")
    print("|---|---|---|---|---|---|")
    for name, m in sorted(by_module.items(), key=lambda kv: -kv[1]["secs"]):
        print(f"| {name} | {m['compiles']} | {m['secs']:.0f} | {m['misses']} | {m['miss_secs']:.0f} | {m['own']} |")
    names = collections.Counter(r["name"] for r in records if not r["hit"])
    print("\nmisses by program name:", ", ".join(f"{n} {c}" for n, c in names.most_common(15)))


if __name__ == "__main__":
    summarize(sys.argv[1])
