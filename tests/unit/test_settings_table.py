"""The settings table (kiln/settings/table.py) stays consistent as rows are added: it is one declarative
table, allowed past the 600-line mark of a module because this file checks its rows (and
tests/unit/test_docs.py checks docs/flags.md is what it generates). No model is loaded."""

from __future__ import annotations

import dataclasses
from collections import Counter

from kiln.settings.engine_config import PLACES, EngineConfig
from kiln.settings.table import BY_NAME, ROUTER_SETTINGS, SETTINGS, Setting

AFFECTS = {"correctness", "performance", "memory", "observability", "server"}
ENGINES = {"kiln", "vllm", "sglang"}


def _repeated(items: list[str]) -> list[str]:
    return sorted(k for k, n in Counter(items).items() if n > 1)


def test_names_env_vars_and_flags_are_each_declared_once() -> None:
    assert _repeated([s.name for s in SETTINGS]) == []
    assert _repeated([s.env_var for s in SETTINGS]) == []
    flags = [f for s in SETTINGS for f in (*s.flags, *s.neg_flags)]
    assert _repeated(flags) == []
    assert all(f.startswith("-") for f in flags), [f for f in flags if not f.startswith("-")]
    assert set(BY_NAME) == {s.name for s in SETTINGS}


def _checkable_default(s: Setting) -> bool:
    return s.default is not None and s.default != "auto" and not s.repeatable and not s.nargs


def test_each_fixed_default_is_a_value_its_own_parser_accepts_and_a_listed_choice() -> None:
    wrong, checked = [], 0
    for s in SETTINGS:
        if not _checkable_default(s):
            continue
        checked += 1
        parsed = s.parse(s.default)
        if parsed != s.default:
            wrong.append(f"{s.name}: default {s.default!r} parses to {parsed!r}")
        if s.choices is not None and s.default not in s.choices:
            wrong.append(f"{s.name}: default {s.default!r} is not among {s.choices}")
    assert wrong == []
    assert checked > 40, checked  # most rows have a fixed default


def test_each_row_says_what_it_affects_and_which_engines_honour_it() -> None:
    assert {s.name: s.affects for s in SETTINGS if s.affects not in AFFECTS} == {}
    assert {s.name: s.engines for s in SETTINGS if not set(s.engines) <= ENGINES
            or not s.engines} == {}
    assert [s.name for s in SETTINGS if not s.help.strip()] == []


def test_the_router_settings_and_the_engine_config_name_rows_of_the_table() -> None:
    assert ROUTER_SETTINGS <= set(BY_NAME)
    # EngineConfig's groups name the row each field holds; from_settings, of and replace place
    # a setting by that name, so every field but the model's path and the explicit-context
    # mark is one row, and no row lands in two fields.
    places = {}
    for f in dataclasses.fields(EngineConfig):
        if dataclasses.is_dataclass(f.default_factory):
            places.update({g.metadata["setting"]: (f.name, g.name)
                           for g in dataclasses.fields(f.default_factory)})
        elif f.name not in ("model", "gguf_file", "max_model_len_explicit"):
            places[f.metadata["setting"]] = (None, f.name)
    assert places == PLACES
    assert set(PLACES) - set(BY_NAME) == set()
    # a setting given by its table name lands in its group and reads back by that name
    cfg = EngineConfig.of("m", quantization="q8", max_num_seqs=3, lora_modules=("a=b",))
    assert (cfg.quant.method, cfg.scheduler.max_num_seqs, cfg.lora.modules) == ("q8", 3, ("a=b",))
    assert EngineConfig.of("m", **cfg.settings()) == cfg
    assert cfg.replace(block_size=32).cache.block_size == 32
