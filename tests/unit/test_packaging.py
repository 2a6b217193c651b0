"""What an installed wheel holds: every file kiln reads beside its modules (the text catalogue,
the model registry, the web pages, the C++ kernel sources it compiles at first use) is package
data, so `pip install .` runs as the source tree does. Read from git and pyproject; no build."""

from __future__ import annotations

import fnmatch
import subprocess
from pathlib import Path, PurePosixPath

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]


def _tracked_data_files() -> list[PurePosixPath]:
    """kiln/'s committed files that are not Python, relative to kiln/."""
    try:
        out = subprocess.run(["git", "ls-files", "kiln"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the committed files are not known")
    return [PurePosixPath(p).relative_to("kiln") for p in out.split()
            if not p.endswith(".py")]


def _shipped(path: PurePosixPath, globs: list[str]) -> bool:
    # setuptools' globs are per folder: "ui/*.js" is not "ui/sub/x.js" (fnmatch's * crosses "/")
    return any(len(PurePosixPath(g).parts) == len(path.parts) and fnmatch.fnmatch(str(path), g)
               for g in globs)


def test_every_data_file_in_kiln_ships_as_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"]["package-data"]["kiln"]
    files = _tracked_data_files()
    assert PurePosixPath("i18n/catalogue.toml") in files, files  # the listing was read
    missing = [str(p) for p in files if not _shipped(p, globs)]
    assert missing == [], (f"files under kiln/ that a wheel would leave out: {missing}; add a "
                           "glob to [tool.setuptools.package-data] in pyproject.toml")
