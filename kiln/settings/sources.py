"""Where setting values come from, besides the table's own defaults and auto rules: the CLI
flags (generated from the table, vLLM's spellings first), `KILN_<NAME>` environment variables and
the TOML config file. Each returns raw values with where they were found;
`setting_resolve.resolve_settings` parses them and walks the precedence.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomllib

from kiln.errors import ConfigError
from kiln.settings.table import BY_NAME, SETTINGS


class _Record(argparse.Action):
    """Stores (value, flag) so conflicting spellings of one setting can be named in the error."""

    def __init__(self, *args: Any, const_value: Any = None, **kwargs: Any) -> None:
        self.const_value = const_value
        super().__init__(*args, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[override]
        seen: dict[str, list[tuple[Any, str]]] = getattr(namespace, "_kiln_seen", None) or {}
        value = self.const_value if self.nargs == 0 else values
        seen.setdefault(self.dest, []).append((value, option_string or self.dest))
        namespace._kiln_seen = seen


def add_setting_arguments(parser: argparse.ArgumentParser, groups: tuple[str, ...] | None = None
                          ) -> None:
    """Adds one flag per setting (plus aliases). Values land in `namespace._kiln_seen`."""
    by_group: dict[str, argparse._ArgumentGroup] = {}
    for s in SETTINGS:
        if not s.flags or (groups and s.group not in groups):
            continue
        grp = by_group.get(s.group) or parser.add_argument_group(f"{s.group} settings")
        by_group[s.group] = grp
        env = f"[env {s.env_var}]"
        if s.is_bool:
            grp.add_argument(*s.flags, dest=s.name, action=_Record, nargs=0, const_value=True,
                             default=argparse.SUPPRESS, help=f"{s.help} {env}")
            if s.neg_flags:
                grp.add_argument(*s.neg_flags, dest=s.name, action=_Record, nargs=0,
                                 const_value=False, default=argparse.SUPPRESS,
                                 help=f"turn off: {s.help}")
        else:
            # A fixed default is the default even where "auto" runs a rule (--engine: kiln).
            default = s.default if s.auto is None or s.default not in (None, "auto") else "auto"
            grp.add_argument(*s.flags, dest=s.name, action=_Record, default=argparse.SUPPRESS,
                             choices=s.choices, metavar=s.metavar, nargs=s.nargs,
                             help=f"{s.help} (default: {default}) {env}")


def cli_values(namespace: argparse.Namespace) -> dict[str, tuple[Any, str]]:
    """Returns {setting: (raw value, flag used)}; rejects conflicting spellings by name."""
    seen: dict[str, list[tuple[Any, str]]] = getattr(namespace, "_kiln_seen", None) or {}
    out: dict[str, tuple[Any, str]] = {}
    for name, uses in seen.items():
        if BY_NAME[name].repeatable:
            out[name] = ([v for v, _ in uses], uses[0][1])
            continue
        values = {repr(v) for v, _ in uses}
        if len(values) > 1:
            flags = " and ".join(sorted({f for _, f in uses}))
            raise ConfigError(
                f"conflicting flags for {name}: {flags}",
                hint="give the setting once", code="config.conflicting_flags",
            )
        out[name] = uses[-1]
    return out



def env_values(environ: Mapping[str, str] | None = None) -> dict[str, tuple[Any, str]]:
    environ = os.environ if environ is None else environ
    return {s.name: (environ[s.env_var], s.env_var) for s in SETTINGS if s.env_var in environ}


def load_config_file(path: Path | None) -> tuple[dict[str, Any], dict[str, Any], Path | None]:
    """Reads a TOML config. Returns (settings, engines table, path used).

    Without an explicit path, `$KILN_CONFIG` or `~/.config/kiln/config.toml` if it exists.
    Keys are setting names (dashes or underscores); `[engines.<name>]` holds external-engine
    args/env/command.
    """
    explicit = path is not None or bool(os.environ.get("KILN_CONFIG"))
    path = path or config_path()
    if not path.exists():
        if explicit:
            raise ConfigError(f"config file {path} does not exist",
                              hint="create it with `kiln config set KEY VALUE` or fix the path")
        return {}, {}, None
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    engines = data.pop("engines", {}) or {}
    settings: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in BY_NAME:
            raise ConfigError(f"unknown key {key!r} in config file {path}",
                              hint=f"known keys: {', '.join(sorted(BY_NAME))}")
        settings[name] = value
    return settings, engines, path


def config_path() -> Path:
    """The config file when none is named: $KILN_CONFIG, else the default path (one rule for
    `kiln serve` and `kiln config`)."""
    env = os.environ.get("KILN_CONFIG")
    return Path(env) if env else default_config_path()


def default_config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "kiln" / "config.toml"


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of every command that resolves settings (kiln serve, kiln run): the model, the
    config file, the dry run, the two records, then one flag set per row of the table."""
    p.add_argument("-m", "--model", dest="model_option", metavar="MODEL",
                   help="what to serve, as the positional MODEL (giving both, different, is an "
                   "error)")
    p.add_argument("--config", type=Path, metavar="PATH",
                   help="TOML config file (default: ~/.config/kiln/config.toml) [env KILN_CONFIG]")
    p.add_argument("--dry-run", action="store_true",
                   help="print hardware, model source and every non-default setting with its "
                   "source, then exit without loading weights")
    p.add_argument("--effective-config-json", type=Path, metavar="PATH",
                   help="write every setting {value, source, affects, reason}, the hardware "
                   "and the model identity")
    p.add_argument("--decision-trace-jsonl", type=Path, metavar="PATH",
                   help="write one JSON line per decision (candidates by source, chosen, why)")
    add_setting_arguments(p)
