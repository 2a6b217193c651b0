"""One output path (issue 42): a request's `n` choices are fanned out, and their outputs
accumulated, in one place, the engine's output processor (kiln/engine/output.py); the server's
routes, `LLM` and `kiln run` only read its RequestOutputs. Read statically (ast): a second
fan-out or a second output type fails here with its file and line."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

KILN = Path(__file__).resolve().parents[2] / "kiln"
OUTPUT = KILN / "engine" / "output.py"
# What runs a sequence: a call to one of these inside a loop over `n` is a fan-out.
SUBMITS = {"add_request", "generate", "for_choice"}


@functools.cache  # parsed once for the three tests
def _modules() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), str(p)) for p in sorted(KILN.rglob("*.py"))}


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(KILN.parent)}:{getattr(node, 'lineno', '?')}"


def _calls(node: ast.AST, names: set[str]) -> list[ast.Call]:
    return [c for c in ast.walk(node) if isinstance(c, ast.Call)
            and getattr(c.func, "attr", getattr(c.func, "id", None)) in names]


def _mentions_n(node: ast.AST) -> bool:
    """`range(params.n)`, `range(req.n)`, `range(n)`: a loop over the choices."""
    return any((isinstance(x, ast.Attribute) and x.attr == "n")
               or (isinstance(x, ast.Name) and x.id == "n") for x in ast.walk(node))


def test_the_n_fan_out_exists_only_in_the_engine_output_processor() -> None:
    fanouts: list[str] = []
    for path, tree in _modules().items():
        for node in ast.walk(tree):
            loops: list[tuple[ast.AST, list[ast.AST]]] = []
            if isinstance(node, (ast.For, ast.AsyncFor)):
                loops.append((node.iter, node.body))
            elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
                loops += [(g.iter, [node]) for g in node.generators]
            for it, body in loops:
                if _mentions_n(it) and any(_calls(b, SUBMITS) for b in body):
                    fanouts.append(_where(path, node))
    assert [f for f in fanouts if not f.startswith("kiln/engine/output.py")] == []
    assert [f for f in fanouts if f.startswith("kiln/engine/output.py")], \
        "the output processor's fan-out was not found: has it moved?"
    # The per-choice params (a seed each) are made there and nowhere else.
    made = [_where(p, c) for p, t in _modules().items() for c in _calls(t, {"for_choice"})]
    assert len(made) == 1 and made[0].startswith("kiln/engine/output.py"), made


def test_one_output_type_and_no_front_end_copy_of_it() -> None:
    defined: dict[str, list[str]] = {}
    for path, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                defined.setdefault(node.name, []).append(_where(path, node))
    assert [d.split(":")[0] for d in defined["RequestOutput"]] == ["kiln/engine/output.py"]
    assert [d.split(":")[0] for d in defined["CompletionOutput"]] == ["kiln/engine/output.py"]
    assert [d.split(":")[0] for d in defined["ParentRequest"]] == ["kiln/engine/output.py"]
    # The per-choice event copy, the per-choice task fan-out: gone.
    assert not {"ChoiceEvent", "Fanout", "ChoiceSpec"} & set(defined), defined


def test_outputs_accumulate_only_through_request_output_add() -> None:
    """Folding a choice's pieces (text +=, token ids extended) happens in CompletionOutput.add;
    nothing outside the engine's output module concatenates a choice's `.text`."""
    found = []
    for path, tree in _modules().items():
        if path == OUTPUT:
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add)
                    and any(isinstance(x, ast.Attribute) and x.attr in ("text", "token_ids")
                            for x in ast.walk(node.value))):
                found.append(_where(path, node))
    assert found == []
