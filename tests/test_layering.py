"""The package layering of docs/design.md, checked on the source: every import of a hotstart module
(at module level or inside a function, TYPE_CHECKING blocks aside) points down the layers, and no two
modules import each other, directly or around a loop."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO

# top to bottom; a package may import from the layers below its own, never from its own layer's others
LAYERS = [
    {"__main__"},
    {"cli"},
    {"bench", "ray"},  # ray: hotstart.ray reuses the server layer (routes, api) inside Ray Serve replicas
    {"server", "llm", "generate"},
    {"frontend"},
    {"forkserver"},
    {"boot", "engine"},
    {"model"},
    {"text"},
]
# the bottom: small torch-free modules any layer uses (they may import each other, without loops)
BASE = {"config", "flags", "model_config", "config_fields", "rope_config", "sliding_window", "families",
        "messages", "sampling_params", "spec_config", "framing", "procs", "errors", "system", "diskio",
        "heartbeat", "logs", "trust", "lru", "gguf_file", "gguf_arch", "residency"}
# hotstart/__init__.py: the public front door (LLM, SamplingParams), loaded lazily by __getattr__
FRONT_DOOR = "hotstart"


def _modules() -> dict[str, Path]:
    out = {}
    for path in (REPO / "hotstart").rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree)
               if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "hotstart":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "hotstart")
    return found


def _package(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def _rank(package: str) -> int:
    for i, layer in enumerate(LAYERS):
        if package in layer:
            return len(LAYERS) - i
    assert package in BASE, f"hotstart/{package} is in no layer of tests/test_layering.py: add it"
    return 0


def test_imports_point_down_the_layers():
    modules = _modules()
    wrong = []
    for module, path in modules.items():
        if module == FRONT_DOOR:
            continue
        a = _package(module)
        for target in _imports(path, modules):
            b = _package(target)
            if a == b or target == FRONT_DOOR and module.startswith("hotstart."):
                continue
            ra, rb = _rank(a), _rank(b)
            if not (ra > rb or ra == rb == 0):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(sorted(wrong))


def test_no_module_imports_itself_around_a_loop():
    modules = _modules()
    edges = {m: {t for t in _imports(p, modules) if t in modules and t != m} for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    assert not loops, loops


def test_no_file_under_hotstart_is_over_400_lines():
    long = {str(p.relative_to(REPO)): n for p in (REPO / "hotstart").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
