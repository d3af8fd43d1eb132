"""No import circles among the library's modules.

Every import counts: at module level, inside a function, and under `if TYPE_CHECKING:`. A
deferred import or a type-only one still means that neither module can be read, changed or
moved without the other; a circle is broken by moving the shared piece to the module that owns
it (a type both use, a helper both call), or by naming what one side needs of the other as a
Protocol of its own. A module importing any submodule implies its package's `__init__`; that
implied step is not counted, an explicit `from package import name` is.

`python -m pytest tests/layout/test_import_cycles.py` prints each circle with the lines that
close it.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "scheduler_proc", "gpu_workers", "kernels", "frontend")

Edges = dict[str, dict[str, int]]
"""module -> {module it imports: the line of the first such import}."""


def library_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The library module an imported dotted name lives in (None: not ours)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
              modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        here = module.split(".") if is_package else module.split(".")[:-1]
        here = here[:len(here) - (node.level - 1)]
        base = ".".join(here + ([node.module] if node.module else []))
    # `from package import name`: the submodule when `name` is one, else the package itself.
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def import_graph() -> tuple[Edges, dict[str, Path]]:
    modules = library_modules()
    edges: Edges = {m: {} for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported(node, module, path.name == "__init__.py", modules):
                target = _owner(name, modules)
                if target is not None and target != module:
                    edges[module].setdefault(target, node.lineno)
    return edges, modules


def strongly_connected(edges: Edges) -> list[list[str]]:
    """Tarjan's components of more than one module (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def shortest_circle(start: str, component: list[str], edges: Edges) -> list[str]:
    """start -> ... -> start through the component, fewest imports first."""
    inside = set(component)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(edges[node]):
            if child not in inside:
                continue
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if child not in came_from:
                came_from[child] = node
                queue.append(child)
    raise AssertionError(f"{start} is in no circle of {component}")


def describe(circle: list[str], edges: Edges, modules: dict[str, Path]) -> str:
    steps = []
    for a, b in zip(circle, circle[1:], strict=False):
        where = modules[a].relative_to(ROOT).as_posix()
        steps.append(f"  {a} -> {b}  ({where}:{edges[a][b]})")
    return "\n".join(steps)


def test_the_graph_sees_imports_of_every_kind():
    """The scan finds a module-level import, one inside a function and a type-only one (each
    known to be in the tree), so an empty list of circles means something."""
    edges, _ = import_graph()
    assert "protocol.sockets" in edges["scheduler_proc.scheduler_loop"]  # module level
    assert "gpu_workers.model_runner" in edges["gpu_workers.worker_proc"]  # in a function
    assert "gpu_workers.static_inputs" in edges["gpu_workers.token_layout"]  # TYPE_CHECKING


def test_no_import_circles():
    edges, modules = import_graph()
    circles = [describe(shortest_circle(c[0], c, edges), edges, modules)
               for c in strongly_connected(edges)]
    assert not circles, "import circles (break each by moving the shared piece to its " \
        "owner):\n" + "\n\n".join(circles)


def test_a_circle_is_found_and_printed():
    """The finder on a made-up graph: a circle of three beside a chain that is none."""
    edges: Edges = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}, "e": {"a": 5}}
    assert strongly_connected(edges) == [["a", "b", "c"]]
    assert shortest_circle("a", ["a", "b", "c"], edges) == ["a", "b", "c", "a"]
