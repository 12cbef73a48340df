"""Check the package layering: no module imports a later layer, and no import cycle (module-level
or lazy imports alike). Run from the repository root; prints each problem, exits 1 if any.

Layers, earliest first (a module may import its own layer and earlier ones):
``triton_backend``: core, engines, speculation, batching, deployment, serving, serving.triton,
serving.launch, serving.front; ``builder``: errors, report_paths, headline, plan, eval, stages, train, ops, loadtest,
bench, cli. The runtime never imports ``builder``. Every module belongs to a layer: a new package or top-level
module is a problem until it is placed in the order.

    .venv/bin/python scripts/check_layers.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

LAYERS = {
    "triton_backend": ["core", "engines", "speculation", "batching", "deployment", "serving", "serving.triton",
                       "serving.launch", "serving.front"],
    "builder": ["errors", "report_paths", "headline", "plan", "eval", "stages", "train", "ops", "loadtest", "bench",
                "cli"],
}


def module_name(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def layer(module: str) -> tuple[str, int] | None:
    top, _, rest = module.partition(".")
    if top not in LAYERS:
        return None
    best = None
    for i, name in enumerate(LAYERS[top]):
        if rest == name or rest.startswith(name + "."):
            best = i  # the longest (latest) prefix wins: serving.triton over serving
    return None if best is None else (top, best)


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in LAYERS}


def problems(root: Path) -> list[str]:
    modules = {module_name(p, root): p for top in LAYERS for p in (root / top).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    found = [f"module in no layer: {mod}" for mod in sorted(modules) if mod not in LAYERS and layer(mod) is None]
    for mod, path in sorted(modules.items()):
        deps = {d for d in imports(path) if d in modules and d != mod}
        graph[mod] = deps
        for dep in sorted(deps):
            a, b = layer(mod), layer(dep)
            if a and b and a[0] != b[0] and a[0] == "triton_backend":
                found.append(f"runtime imports the builder: {mod} -> {dep}")
            elif a and b and a[0] == b[0] and b[1] > a[1]:
                found.append(f"upward import: {mod} -> {dep}")
    # package __init__ modules import nothing here, so every cycle is between real modules
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod)
    return found


def main() -> int:
    found = problems(Path.cwd())
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
