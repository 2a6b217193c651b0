"""The tests stay in their layer folders (docs/testing.md): `make test` collects only the folders
`testpaths` lists, so a test file dropped beside conftest.py, or into a folder of its own, would
silently never run; and a file renamed or moved out of `FAST_FILES` would silently leave
`make test-fast`. Read from the tree and pytest's own configuration; no model."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from conftest import FAST_FILES

LAYERS = ("unit", "kernels", "models", "server", "heavy")
TESTS = Path(__file__).resolve().parents[1]


def _test_files() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def test_every_test_file_is_in_a_layer_folder_that_make_test_collects(
        pytestconfig: pytest.Config) -> None:
    assert pytestconfig.getini("testpaths") == [f"tests/{layer}" for layer in LAYERS]
    # each folder on sys.path, so `from test_server import _serve` works from any folder
    on_path = {Path(p).resolve() for p in pytestconfig.getini("pythonpath")}
    assert {TESTS / layer for layer in LAYERS} <= on_path
    stray = [str(p.relative_to(TESTS)) for p in _test_files()
             if p.parent.parent != TESTS or p.parent.name not in LAYERS]
    assert not stray, f"test files outside tests/{{{','.join(LAYERS)}}}/ never run: {stray}"
    # one module name per file: pytest imports each by its bare name (no __init__.py)
    twice = [name for name, n in Counter(p.name for p in _test_files()).items() if n > 1]
    assert not twice, f"test file names used in two folders: {twice}"


def test_the_fast_files_exist() -> None:
    stale = sorted(FAST_FILES - {p.name for p in _test_files()})
    assert not stale, f"FAST_FILES (tests/conftest.py) names files that are gone: {stale}"
