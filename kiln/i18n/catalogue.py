"""The en/zh text catalogue, key -> {"en": ..., "zh": ...}: the texts live in catalogue.toml
beside this module (data, like gettext's .po files, so a translator edits text without reading
Python); this module reads them once. The lookup (`msg`, `english`, the language) is
kiln/i18n/__init__.py; tests/unit/test_i18n.py keeps the catalogue consistent (both languages,
the same {fields}, every key used and every key looked up present).
"""

from __future__ import annotations

import importlib.resources

import tomllib

# Package data (pyproject's [tool.setuptools.package-data]), so an installed wheel finds it
# where a source tree does. One table per key, the key quoted because it holds dots.
CATALOGUE: dict[str, dict[str, str]] = tomllib.loads(
    importlib.resources.files(__package__).joinpath("catalogue.toml").read_text(encoding="utf-8"))
