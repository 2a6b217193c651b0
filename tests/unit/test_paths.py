"""kiln's cache folder: one rule for every cache (kernels, tokenizers, exports, engine probes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.paths import cache_dir


def test_cache_dir_env_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KILN_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == tmp_path / "home/.cache/kiln"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir("ext", "x") == tmp_path / "xdg/kiln/ext/x"
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir("tokenizers") == tmp_path / "mine/tokenizers"  # kiln's own variable wins
    assert not (tmp_path / "mine").exists()  # asking creates nothing
