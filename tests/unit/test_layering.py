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

ROOT = Path(__file__).resolve().parents[2]

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


def test_kiln_has_no_import_circle() -> None:
    graph, modules = import_graph(ROOT, "kiln")
    assert len(modules) > 100 and "kiln.settings.table" in graph["kiln.startup"]  # the graph was read
    problems = circles_outside(graph, modules, ROOT)
    assert not problems, (
        "\n".join(problems) + "\nCut it: move the piece both modules need below both (a type, a "
        "constant, an error class), or pass it in; a deferred or TYPE_CHECKING import does not "
        "cut it (tests/unit/test_layering.py says why).")


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


# The allowed package order, bottom floor first: a module may import modules of its own floor
# and of the floors below it, never of a floor above (deferred and TYPE_CHECKING imports count,
# as for circles). Each floor names modules or packages; a package covers its submodules, and the
# longest name that matches places a module (kiln.resolve.hardware and .device are platform, the
# rest of kiln.resolve sits higher). "kiln" alone is the package's own __init__ (it exports LLM).
# Derived from the import graph as it is; a new top-level module or package must be placed here.
PACKAGE_ORDER: tuple[tuple[str, tuple[str, ...]], ...] = (
    # what every floor may use: errors, the text catalogue, paths and pid files, and the probes of
    # this machine (the hardware probe and what kiln can run on what it found: device, dtypes;
    # the CPU flag table and the ISA probe, which live beside the kernels they describe but read
    # only flags, the OS and the cache dir)
    ("platform", ("kiln.errors", "kiln.i18n", "kiln.paths", "kiln.pidfile",
                  "kiln.resolve.hardware", "kiln.resolve.device", "kiln.layers.kernels.flags",
                  "kiln.layers.kernels.isa")),
    # the recorders the engine writes to and the faults it injects (a settings row parses faults)
    ("diagnostics", ("kiln.obs", "kiln.obs.faults", "kiln.obs.trace")),
    # every setting, resolved; what one request asks for
    ("settings", ("kiln.settings", "kiln.sampling_params")),
    ("layers and models", ("kiln.layers", "kiln.models", "kiln.tokenizer")),
    ("engine", ("kiln.engine",)),
    # what a model is (kinds: generate, embed, transcribe, speak) and where it comes from
    ("kinds and model sources", ("kiln.kinds", "kiln.resolve")),
    # the HTTP server and the request dump it writes
    ("server", ("kiln.server", "kiln.obs.dump")),
    # what plans and starts an engine for a front end, the front ends that are not the CLI, and
    # the other engines kiln can launch
    ("front ends", ("kiln.startup", "kiln.startup_plan", "kiln.startup_report", "kiln.llm",
                    "kiln.bench", "kiln.backends", "kiln")),
    ("cli", ("kiln.cli", "kiln.__main__")),
)

# Imports that run upward on purpose, each with why it is not cut yet. An arrow listed here that
# no longer exists fails too, so the list only shrinks.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def floor_of(module: str, order: tuple[tuple[str, tuple[str, ...]], ...] = PACKAGE_ORDER,
             root: str = "kiln") -> tuple[int, str] | None:
    """(floor index, floor name) of a module: the floor of the longest listed name that is the
    module or a package above it; the root package's name covers only itself."""
    best: tuple[int, int, str] | None = None
    for i, (floor, names) in enumerate(order):
        for name in names:
            covers = module == name or (name != root and module.startswith(name + "."))
            if covers and (best is None or len(name) > best[0]):
                best = (len(name), i, floor)
    return None if best is None else (best[1], best[2])


def upward_imports(graph: dict[str, dict[str, int]], modules: dict[str, Path], root: Path,
                   order: tuple[tuple[str, tuple[str, ...]], ...], package: str = "kiln",
                   known: dict[tuple[str, str], str] | None = None) -> list[str]:
    """One line per import against the order (or per module no floor places), naming the arrow
    with its file and line and the two floors."""
    known = known or {}
    problems = []
    for mod in sorted(graph):
        here = floor_of(mod, order, package)
        if here is None:
            problems.append(f"{mod} ({modules[mod].relative_to(root)}) is on no floor: place it "
                            "in PACKAGE_ORDER")
            continue
        for dep, line in sorted(graph[mod].items()):
            there = floor_of(dep, order, package)
            if there is not None and there[0] > here[0] and (mod, dep) not in known:
                problems.append(f"{mod} -> {dep} ({modules[mod].relative_to(root)}:{line}): "
                                f"{here[1]} imports {there[1]}, a floor above it")
    return problems


def test_kiln_imports_follow_the_package_order() -> None:
    graph, modules = import_graph(ROOT, "kiln")
    problems = upward_imports(graph, modules, ROOT, PACKAGE_ORDER, known=KNOWN_UPWARD)
    assert not problems, (
        "\n".join(problems) + "\nMove the piece the lower module needs down to its floor (or "
        "below), or pass it in from above; a deferred import still counts.")
    stale = [f"{a} -> {b}" for a, b in KNOWN_UPWARD if b not in graph.get(a, {})]
    assert not stale, f"KNOWN_UPWARD names arrows that are gone (delete them): {stale}"


def test_an_upward_import_is_named_with_its_floors(tmp_path: Path) -> None:
    """The checker on a scratch package: low may not import high (at the top or deferred), high
    may import low, a module on no floor is named, a listed exception passes."""
    order = (("low", ("pkg.low", "pkg")), ("high", ("pkg.high",)))
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/high.py": "from pkg import low\n",
                      "pkg/low.py": "X = 1\n\ndef f():\n    from pkg.high import Y\n",
                      "pkg/stray.py": "import pkg.low\n"})
    graph, modules = import_graph(tmp_path, "pkg")
    problems = upward_imports(graph, modules, tmp_path, order, package="pkg")
    assert problems == [
        "pkg.low -> pkg.high (pkg/low.py:4): low imports high, a floor above it",
        "pkg.stray (pkg/stray.py) is on no floor: place it in PACKAGE_ORDER"]
    order = (("low", ("pkg.low", "pkg.stray", "pkg")), ("high", ("pkg.high",)))
    assert upward_imports(graph, modules, tmp_path, order, package="pkg",
                          known={("pkg.low", "pkg.high"): "why"}) == []


# No module in kiln/ over MAX_LINES lines (issue 42): past that a module holds more than one
# concern and a reader loses its thread. Declarative tables may grow past it, since a table's
# rows are read one at a time, but only where tests keep the table consistent. Each entry names
# the table's variable (the module without it must still fit under the mark, so code does not
# grow beside the table on its allowance) and the tests that keep it consistent.
MAX_LINES = 600
LONG_TABLES: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {
    "kiln/settings/table.py": ("SETTINGS", {
        # names, flags and env vars unique; defaults parse and are among the choices; every row
        # says what it affects and which engines honour it
        "tests/unit/test_settings_table.py": (
            "test_names_env_vars_and_flags_are_each_declared_once",
            "test_each_fixed_default_is_a_value_its_own_parser_accepts_and_a_listed_choice",
            "test_each_row_says_what_it_affects_and_which_engines_honour_it"),
        # docs/flags.md is what the table generates
        "tests/unit/test_docs.py": ("test_docs_flags_md_is_generated_from_the_current_settings_table",),
    }),
}


def long_modules(root: Path, package: str, limit: int) -> dict[str, int]:
    """{path relative to root: lines} of every .py under root/package longer than limit."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        n = len(path.read_text().splitlines())
        if n > limit:
            out[str(path.relative_to(root))] = n
    return out


def table_lines(path: Path, name: str) -> int:
    """Lines of the module-level assignment to `name` (0 where there is none)."""
    for node in ast.parse(path.read_text()).body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return (node.end_lineno or node.lineno) - node.lineno + 1
    return 0


def test_no_module_in_kiln_is_over_600_lines_but_the_declarative_tables() -> None:
    long = long_modules(ROOT, "kiln", MAX_LINES)
    assert long, "no table is over the mark: the listing was not read"  # the two tables are
    over = [f"{path}: {n} lines" for path, n in long.items() if path not in LONG_TABLES]
    assert not over, (
        "\n".join(over) + f"\nOver {MAX_LINES} lines: split the module along a seam (one concern "
        "per module, as kiln/resolve/device.py left kiln/resolve/hardware.py), or, for a "
        "declarative table that tests keep consistent, list it in LONG_TABLES with those tests.")
    stale = sorted(set(LONG_TABLES) - set(long))
    assert not stale, f"LONG_TABLES names modules under {MAX_LINES} lines (delete them): {stale}"
    for path, (table, _) in LONG_TABLES.items():
        rows = table_lines(ROOT / path, table)
        assert rows, f"{path} has no module-level {table}"
        rest = long[path] - rows
        assert rest <= MAX_LINES, (f"{path}: {rest} lines beside its table {table}: the code, not "
                                   "the table, is over the mark; move it out")


def test_each_long_table_names_tests_that_exist() -> None:
    """The allowance of a long table rests on its consistency tests: each must exist (a rename
    or deletion fails here rather than leaving the table unchecked)."""
    for path, (_, tests) in LONG_TABLES.items():
        assert tests, path
        for file, names in tests.items():
            defined = {n.name for n in ast.parse((ROOT / file).read_text()).body
                       if isinstance(n, ast.FunctionDef)}
            missing = [f"{file}::{name}" for name in names if name not in defined]
            assert names and not missing, f"{path}: its consistency tests are gone: {missing}"


def test_a_long_module_is_found_and_a_table_measured(tmp_path: Path) -> None:
    """The checkers on scratch files: a module over the limit is listed with its length, one at
    the limit is not; a table's lines are those of its assignment, annotated or not."""
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/long.py": "x = 1\n" * 11,
                      "pkg/short.py": "x = 1\n" * 10,
                      "pkg/table.py": "import os\n\nT: dict[str, int] = {\n    'a': 1,\n}\n"
                                      "U = [\n]\n"})
    assert long_modules(tmp_path, "pkg", 10) == {"pkg/long.py": 11}
    assert table_lines(tmp_path / "pkg/table.py", "T") == 3
    assert table_lines(tmp_path / "pkg/table.py", "U") == 2
    assert table_lines(tmp_path / "pkg/table.py", "V") == 0
