"""Resolving the settings table (kiln/settings/table.py) with provenance: for every setting, the sources
in order, highest first,

    cli > env > file > preset > registry (model defaults) > auto > default

and, for the value chosen, its source, the reason an auto rule gave, and every candidate seen.
`--dry-run`, the effective-config JSON and the decision trace read what this gives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kiln.errors import BadValue, ConfigError
from kiln.i18n import msg
from kiln.settings.rules import AutoContext
from kiln.settings.table import SETTINGS, Setting

# "engine": decided while loading (the KV pool lowered the context, the layer kernel left nothing
# to compile), written back over the resolved value so the record tells what actually runs.
SOURCES = ("cli", "env", "file", "preset", "registry", "auto", "default", "engine")


@dataclass
class Candidate:
    source: str
    value: Any
    detail: str = ""  # which flag, env var, file, preset or registry entry


@dataclass
class Resolved:
    name: str
    value: Any
    source: str
    affects: str
    reason: str = ""
    candidates: list[Candidate] = field(default_factory=list)
    # Which branch of an auto rule (or which engine decision) chose the value: a stable name
    # (kiln/settings/rules.py's AutoRule), None where a person or the default set it.
    code: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"value": self.value, "source": self.source, "affects": self.affects,
               "reason": self.reason}
        return out if self.code is None else {**out, "code": self.code}


@dataclass
class ResolvedSettings:
    values: dict[str, Resolved]
    warnings: list[str] = field(default_factory=list)

    def __getitem__(self, name: str) -> Any:
        return self.values[name].value

    def get(self, name: str, default: Any = None) -> Any:
        r = self.values.get(name)
        return default if r is None else r.value

    def source(self, name: str) -> str:
        return self.values[name].source

    def override(self, name: str, value: Any, reason: str, source: str = "auto",
                 code: str | None = None) -> None:
        """A later phase (memory fit, say) changes a value; the reason tells why, the code (where
        the phase gives one) which decision it was."""
        r = self.values[name]
        r.candidates.append(Candidate(source, value, reason))
        r.value, r.source, r.reason, r.code = value, source, reason, code

    def as_dict(self) -> dict[str, Any]:
        return {name: r.value for name, r in self.values.items()}

    def to_json(self) -> dict[str, Any]:
        return {name: r.to_dict() for name, r in self.values.items()}

    def trace(self) -> list[dict[str, Any]]:
        return [
            {"setting": r.name, "chosen": r.value, "source": r.source, "reason": r.reason,
             "code": r.code, "candidates": [asdict(c) for c in r.candidates]}
            for r in self.values.values()
        ]

    def non_default(self) -> list[Resolved]:
        return [r for r in self.values.values() if r.source != "default"]


def _parse(s: Setting, raw: Any, where: str) -> Any:
    try:
        value = s.parse(raw) if raw is not None else None
    except (ValueError, TypeError) as e:
        flag = s.flags[0] if s.flags else s.name
        raise ConfigError(msg("config.invalid_value", raw=repr(raw), flag=flag, where=where,
                              error=e), causes=(e.code,) if isinstance(e, BadValue) else ()
                          ) from None
    if s.choices is not None and value not in s.choices:
        raise ConfigError(
            msg("config.invalid_choice", raw=repr(raw), flag=s.flags[0] if s.flags else s.name,
                where=where),
            hint=msg("config.choose_one", choices=", ".join(map(str, s.choices))),
        )
    return value


def resolve_settings(
    *,
    cli: Mapping[str, tuple[Any, str]] | None = None,
    env: Mapping[str, tuple[Any, str]] | None = None,
    file: Mapping[str, Any] | None = None,
    file_path: Path | None = None,
    preset: Mapping[str, Any] | None = None,
    preset_name: str | None = None,
    registry: Mapping[str, Any] | None = None,
    registry_name: str | None = None,
    ctx: AutoContext | None = None,
) -> ResolvedSettings:
    """Walks the sources for every setting, highest first; auto rules run in table order, so a
    rule may read the values of settings declared above it (dtype reads device), and which
    settings a person set anywhere in the table (`ctx.explicit`, known before any rule runs)."""
    explicit_names = {name for m in (cli or {}, env or {}, file or {}) for name, v in m.items()
                      if not _is_auto(v[0] if isinstance(v, tuple) else v)}
    ctx = replace(ctx or AutoContext(), explicit=explicit_names)
    layers: list[tuple[str, Mapping[str, Any], Callable[[str], str]]] = [
        ("cli", {k: v[0] for k, v in (cli or {}).items()}, lambda n: (cli or {})[n][1]),
        ("env", {k: v[0] for k, v in (env or {}).items()}, lambda n: (env or {})[n][1]),
        ("file", file or {}, lambda n: str(file_path or "config file")),
        ("preset", preset or {}, lambda n: f"preset {preset_name}"),
        ("registry", registry or {}, lambda n: f"registry entry {registry_name}"),
    ]
    values: dict[str, Resolved] = {}
    chosen: dict[str, Any] = {}
    for s in SETTINGS:
        cands = [Candidate(src, _parse(s, m[s.name], f"{src} {det(s.name)}"), det(s.name))
                 for src, m, det in layers if s.name in m]
        explicit = next((c for c in cands if not _is_auto(c.value)), None)
        if explicit is not None:
            r = Resolved(s.name, explicit.value, explicit.source, s.affects,
                         f"set by {explicit.detail}", cands)
        elif s.auto is not None and (_is_auto(s.default) or any(c.value == "auto"
                                                                 for c in cands)):
            # An explicit "auto" runs the rule even where the default is a fixed value
            # (--engine auto: the default is kiln).
            value, reason, code = s.auto(ctx, chosen)
            cands.append(Candidate("auto", value, reason))
            r = Resolved(s.name, value, "auto", s.affects, reason, cands, code)
        else:
            cands.append(Candidate("default", s.default))
            r = Resolved(s.name, s.default, "default", s.affects, "kiln's default", cands)
        values[s.name] = r
        chosen[s.name] = r.value
    return ResolvedSettings(values)


def _is_auto(value: Any) -> bool:
    return value is None or value == "auto"
