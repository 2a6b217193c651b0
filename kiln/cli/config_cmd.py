"""`kiln config show|get|set|path|docs`: the config file, what every setting resolves to, and
the generated flag reference (docs/flags.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import tomllib

from kiln.cli import add_lang_flag
from kiln.errors import ConfigError, KilnError
from kiln.i18n import msg
from kiln.settings import sources as S
from kiln.settings import table as C
from kiln.settings.resolve import Resolved, ResolvedSettings, resolve_settings


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("config", help="show or edit kiln's config file",
                              description="Keys are setting names (see `kiln config show`).")
    p.add_argument("--config", type=Path, metavar="PATH",
                   help="config file to use (default: $KILN_CONFIG, else "
                   "~/.config/kiln/config.toml)")
    add_lang_flag(p)
    sub = p.add_subparsers(dest="action", metavar="ACTION")
    show = sub.add_parser("show", help="every setting: value and source (without a model)")
    show.add_argument("--json", action="store_true")
    get = sub.add_parser("get", help="print one setting's resolved value and source")
    get.add_argument("key")
    st = sub.add_parser("set", help="write KEY = VALUE into the config file")
    st.add_argument("key")
    st.add_argument("value")
    sub.add_parser("path", help="print the config file's path")
    docs = sub.add_parser("docs", help="write docs/flags.md from the settings table")
    docs.add_argument("--check", action="store_true",
                      help="write nothing; exit 1 when the page differs from the table")
    docs.add_argument("--output", type=Path, metavar="PATH",
                      help="where the page goes (default: docs/flags.md of this checkout)")
    p.set_defaults(func=main)


def _path(args: argparse.Namespace) -> Path:
    """The file `kiln serve` reads: --config, else $KILN_CONFIG, else the default path."""
    return args.config or S.config_path()


def _resolve(args: argparse.Namespace) -> ResolvedSettings:
    path = _path(args)
    file_settings, used = ((S.load_config_file(path)[0], path) if path.exists()
                           else ({}, None))
    return resolve_settings(env=S.env_values(), file=file_settings, file_path=used)


def main(args: argparse.Namespace) -> int:
    try:
        return _main(args)
    except KilnError as e:
        print(f"kiln config: {e}", file=sys.stderr)
        return e.exit_code


def _main(args: argparse.Namespace) -> int:
    action = args.action or "show"
    if action == "path":
        print(_path(args))
        return 0
    if action == "docs":
        from kiln.settings import docs as setting_docs

        return setting_docs.main(args)
    if action == "set":
        name = args.key.replace("-", "_")
        s = C.setting(name)
        value = s.parse(args.value)
        if s.choices is not None and value not in s.choices:
            raise ConfigError(msg("config.invalid_key_value", raw=repr(args.value), key=name),
                              hint=msg("config.choose_one",
                                       choices=", ".join(map(str, s.choices))))
        path = _path(args)
        data: dict[str, Any] = tomllib.loads(path.read_text()) if path.exists() else {}
        data[name] = value
        import tomli_w

        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(tomli_w.dumps(data))
        print(f"{name} = {value!r} written to {path}")
        return 0
    s = _resolve(args)
    if action == "get":
        name = args.key.replace("-", "_")
        C.setting(name)
        r = s.values[name]
        reason = msg("config.decided_at_serve.hint") if _decided_at_serve(r) else r.reason
        print(f"{_shown(r)}\t[{r.source}] {reason}")
        return 0
    if getattr(args, "json", False):
        print(json.dumps(s.to_json(), indent=2, default=str))
        return 0
    print(f"config file: {_path(args)}" + ("" if _path(args).exists() else " (absent)"))
    for r in s.values.values():
        print(f"  {r.name:<32} {_shown(r)!s:<20} [{r.source}]  {C.BY_NAME[r.name].help}")
    return 0


def _decided_at_serve(r: Resolved) -> bool:
    """An auto value that nothing set: its rule reads the model and the hardware, which `kiln
    config` does not load, so what the rule answers here (dtype's "CPU has no native bf16" on
    a bf16 CPU) is not what `kiln serve` will run."""
    return C.BY_NAME[r.name].auto is not None and r.source == "auto"


def _shown(r: Resolved) -> Any:
    """One setting's value as show and get print it."""
    if _decided_at_serve(r):
        return msg("config.decided_at_serve")
    return "***" if r.name == "api_key" and r.value else r.value
