"""The package layers as DESIGN.md draws them, read from the sources' import statements (module level and
inside functions): no import cycle anywhere; the runner takes nothing from the engine but the hand-off
types; the engine's scheduling core never imports jax; the kernels import nothing else of jaxpaged."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The source folders and the package each installs as (pyproject's package-dir).
PACKAGES = {"jaxpaged": "jaxpaged", "models": "jaxpaged.models", "pallas_kernels": "jaxpaged.pallas_kernels",
            "server": "jaxpaged.server"}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([package, *parts])] = path
    return mods


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """The jaxpaged modules `name` imports, anywhere in its body."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            if t in MODULES and t != name:
                found.add(t)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_the_sources_are_found():
    for name in ("jaxpaged.config", "jaxpaged.engine.scheduler", "jaxpaged.runner.model_runner",
                 "jaxpaged.models.decoder", "jaxpaged.pallas_kernels", "jaxpaged.server.api_server"):
        assert name in GRAPH
    assert "jaxpaged.engine.output" in GRAPH["jaxpaged.runner.model_runner"]


def test_no_import_cycle():
    """A package's __init__ importing its own submodules is not a cycle of the code; every other edge is."""
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in GRAPH.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_runner_takes_only_the_hand_off_types_from_the_engine():
    for name, targets in GRAPH.items():
        if name.startswith("jaxpaged.runner"):
            engine = {t for t in targets if t.startswith("jaxpaged.engine")}
            assert engine <= {"jaxpaged.engine", "jaxpaged.engine.output"}, (name, engine)


@pytest.mark.parametrize("name", ["jaxpaged.engine.scheduler", "jaxpaged.engine.kv_cache_manager",
                                  "jaxpaged.engine.block_pool", "jaxpaged.engine.request",
                                  "jaxpaged.engine.output", "jaxpaged.config"])
def test_the_scheduling_core_never_imports_jax(name):
    tree = ast.parse(MODULES[name].read_text())
    top = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    top |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
    # config.detect_platform asks JAX for the device inside the function; nothing else may
    assert "jax" not in top or name == "jaxpaged.config"
    assert "flax" not in top


def test_kernels_import_nothing_else_of_jaxpaged():
    for name, targets in GRAPH.items():
        if name.startswith("jaxpaged.pallas_kernels"):
            assert all(t.startswith("jaxpaged.pallas_kernels") for t in targets), (name, targets)
