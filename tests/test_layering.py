"""No import circles among kiln's modules (issue 42: four circles came back because nothing
checked them).

The graph is read statically (ast, nothing imported), and every import a module names counts:
  - at the module's top;
  - inside a function: a deferred import is still a dependency (the module loads when the function
    runs). Deferring is how the CLI keeps `kiln --help` quick, and it is fine for that; what it
    must not do is hide a circle, which it does from the interpreter but not from a reader;
  - under `if TYPE_CHECKING:`: the signatures then speak the other module's types, so the two
    still lean on each other. The cuts so far cost one small module (kiln/startup_plan.py) or a
    Protocol that names what is read (kiln/obs/dump.py).
Not counted: the parent packages Python runs before a submodule (`import a.b.c` runs a/__init__
and a/b/__init__). Counting those would tie every package that imports one of its submodules
into a circle with all of them; a package's own imports are counted like any module's.

A failure names the arrows of each circle with the file and line of every import in it.
"""

from __future__ import annotations

import ast
from collections import deque
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Circles left on purpose, for now: all belong to the kernel layer (kiln/layers/kernels, the
# quantized linears, the GGUF reader, the one-call MoE layer's eligibility check), whose owner
# cuts them with the kernel-layer issue (issue 42: "the kernel circle goes with the kernel-layer
# issue"). A circle found must lie inside one of these; a new module joining one, or any other
# circle, fails. When one is cut, delete its entry.
KNOWN_KERNEL_CIRCLES: tuple[frozenset[str], ...] = (
    frozenset({"kiln.layers.kernels", "kiln.layers.kernels.build", "kiln.layers.kernels.choose",
               "kiln.layers.kernels.ops", "kiln.layers.kquant", "kiln.layers.quant",
               "kiln.models.gguf"}),
)


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under root/package."""
    out: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _known(modules: dict[str, Path], name: str) -> str | None:
    """The module `name` loads: itself, or the longest prefix that is one of ours
    (`from kiln.settings.table import BY_NAME` -> kiln.settings.table)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path, package: str) -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    """{module: {imported module of ours: line of the first such import}}, every import the file
    names (module top, functions, classes, TYPE_CHECKING blocks)."""
    modules = module_files(root, package)
    graph: dict[str, dict[str, int]] = {}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        here = mod if is_pkg else mod.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x, from ..y import z
                    pkg = here.split(".")
                    pkg = pkg[:len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                # `from pkg import sub` loads the submodule; `from mod import name` the module
                targets = [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                dep = _known(modules, t)
                if dep is not None and dep != mod:
                    edges.setdefault(dep, node.lineno)
        graph[mod] = edges
    return graph, modules


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's components of more than one module (a circle lives inside one), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, todo = work[-1]
            if todo:
                w = todo.pop()
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, sorted(graph.get(w, {}))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def shortest_circle(graph: dict[str, dict[str, int]], comp: list[str]) -> list[str]:
    """A shortest circle through the component's first module, as [a, b, ..., a]."""
    inside = set(comp)
    start = comp[0]
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v]):
            if w not in inside:
                continue
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if w not in came_from:
                came_from[w] = v
                queue.append(w)
    raise AssertionError(f"{comp} is not a circle")


def describe_circle(graph: dict[str, dict[str, int]], modules: dict[str, Path], root: Path,
                    circle: list[str]) -> str:
    arrows = [f"{a} -> {b} ({modules[a].relative_to(root)}:{graph[a][b]})"
              for a, b in pairwise(circle)]
    return "\n    ".join(arrows)


def circles_outside(graph: dict[str, dict[str, int]], modules: dict[str, Path], root: Path,
                    known: tuple[frozenset[str], ...] = ()) -> list[str]:
    """One description per component that is not inside a known circle: its modules and the
    arrows of a shortest circle in it."""
    problems = []
    for comp in strongly_connected(graph):
        if any(set(comp) <= k for k in known):
            continue
        circle = shortest_circle(graph, comp)
        problems.append(f"import circle among {', '.join(comp)}:\n    "
                        + describe_circle(graph, modules, root, circle))
    return problems


def test_kiln_has_no_import_circle_outside_the_known_kernel_ones() -> None:
    graph, modules = import_graph(ROOT, "kiln")
    assert len(modules) > 100 and "kiln.settings.table" in graph["kiln.startup"]  # the graph was read
    problems = circles_outside(graph, modules, ROOT, KNOWN_KERNEL_CIRCLES)
    assert not problems, (
        "\n".join(problems) + "\nCut it: move the piece both modules need below both (a type, a "
        "constant, an error class), or pass it in; a deferred or TYPE_CHECKING import does not "
        "cut it (tests/test_layering.py says why).")


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize("b_text, line, kind", [
    ("from pkg import a\n", 2, "module top"),
    ("def f():\n    from pkg.a import X\n    return X\n", 3, "inside a function"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import X\n", 4,
     "TYPE_CHECKING"),
    ("from . import a\n", 2, "relative"),
])
def test_a_circle_is_found_and_its_arrows_named(tmp_path: Path, b_text: str, line: int,
                                                kind: str) -> None:
    """The checker itself, on a scratch package: a -> b at the top, b -> a in each form the
    module docstring counts; c imports both and is in no circle."""
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "import os\n\nfrom pkg.b import Y\n",
                      "pkg/b.py": "Y = 1\n" + b_text,
                      "pkg/c.py": "from pkg import a, b\n"})
    graph, modules = import_graph(tmp_path, "pkg")
    problems = circles_outside(graph, modules, tmp_path)
    assert len(problems) == 1, kind
    assert problems[0].startswith("import circle among pkg.a, pkg.b:"), problems[0]
    assert "pkg.a -> pkg.b (pkg/a.py:3)" in problems[0]
    assert f"pkg.b -> pkg.a (pkg/b.py:{line})" in problems[0], kind
    # a known circle is let through, a larger one that contains it is not
    assert circles_outside(graph, modules, tmp_path, (frozenset({"pkg.a", "pkg.b"}),)) == []
    assert circles_outside(graph, modules, tmp_path, (frozenset({"pkg.a", "pkg.c"}),))


def test_a_longer_circle_is_named_arrow_by_arrow(tmp_path: Path) -> None:
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from pkg import b\n",
                      "pkg/b.py": "from pkg.c import Z\n", "pkg/c.py": "import pkg.a\nZ = 0\n",
                      "pkg/d.py": "import pkg.a\n"})
    graph, modules = import_graph(tmp_path, "pkg")
    (problem,) = circles_outside(graph, modules, tmp_path)
    assert problem == ("import circle among pkg.a, pkg.b, pkg.c:\n"
                       "    pkg.a -> pkg.b (pkg/a.py:1)\n"
                       "    pkg.b -> pkg.c (pkg/b.py:1)\n"
                       "    pkg.c -> pkg.a (pkg/c.py:1)")
