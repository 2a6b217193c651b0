"""kiln's resolved settings -> one engine command line (LaunchPlan), by walking the backend's
table; the dry-run rendering of a plan; prepare_launch = find + probe + build + check.

    settings + BackendModel --(one mapping table per engine)--> LaunchPlan (argv, env, warnings)
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# What a table row is and emits as T.*; the types a plan is made of by name.
from kiln.backends import table as T
from kiln.backends.discovery import check_plan, find_engine, probe_engine
from kiln.backends.table import BackendModel, EngineCommand, EngineHelp, LaunchPlan
from kiln.errors import ConfigError, EngineNotFoundError
from kiln.i18n import msg
from kiln.settings.resolve import ResolvedSettings
from kiln.settings.table import BY_NAME, SETTINGS


def _fires(row: T.Map, ctx: T.PlanContext, name: str) -> bool:
    value = ctx.value(name)
    if value is None:
        return False
    if ctx.explicit(name):
        return True
    return row.engine_default is not T.ENGINE_DECIDES and value != row.engine_default


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
    backend = T.get_backend(engine)
    cfg = _engine_cfg(engine, engine_cfg)
    ctx = T.PlanContext(backend, settings, model, help)
    warnings: list[str] = []
    if command is None:
        try:
            command = find_engine(engine, engine_cfg=cfg, engine_command=ctx.value(
                "engine_command"))
        except EngineNotFoundError as e:
            command = backend.default_command()
            warnings.append(msg("handoff.engine_missing", error=e.message, engine=backend.label,
                                install=backend.install_hint))

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
    causes: list[str] = []  # each error's code, in the same order
    # Settings this engine does not honour need no row and are not warned about (kiln's own
    # features: it has its own prefix cache, sessions are kiln's scheduling policy).
    covered = {s.name for s in SETTINGS if backend.name not in s.engines}
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
                causes.append(f"handoff.{row.setting}_unsupported")
            else:
                warnings.append(msg("handoff.ignores", engine=backend.label, text=text))
            continue
        try:
            outs = _row_outputs(row, value, ctx)
        except T.Untranslatable as u:
            if u.severity == "error":
                errors.append(f"{_flag_name(row.setting)}={_show(value)}: {u.message}")
                causes.append(u.code or f"handoff.{row.setting}_untranslatable")
            else:
                warnings.append(u.message)
            continue
        for out in outs:
            name = out.setting or row.setting
            if isinstance(out, T.Env):
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
            warnings.append(msg("handoff.no_equivalent", flag=_flag_name(name),
                                engine=backend.label))

    tp = ctx.value("tensor_parallel_size")
    if model.max_tp and isinstance(tp, int) and tp > model.max_tp:
        warnings.append(msg("handoff.tp_exceeds", tp=tp, max_tp=model.max_tp,
                            engine=backend.label))

    if errors:
        raise ConfigError(
            msg("handoff.cannot_run", engine=backend.label, errors="\n  - ".join(errors)),
            hint=msg("handoff.cannot_run.hint"), causes=tuple(causes),
        )

    extra_args = cfg["args"]
    emitted = {flag for _, flag, _ in translated if flag.startswith("--")}
    for arg in [*extra_args, *passthrough]:
        flag = arg.split("=", 1)[0]
        if flag in emitted:
            warnings.append(msg("handoff.later_wins", flag=flag))
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


def _row_outputs(row: T.Map, value: Any, ctx: T.PlanContext) -> list[T.Out]:
    if row.emit is not None:
        return row.emit(value, ctx)
    assert row.flag is not None, f"row {row.setting} has neither flag nor emit"
    converted = row.convert(value, ctx) if row.convert is not None else value
    return [] if converted is None else [T.Arg(row.flag, converted)]


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
        return "\n".join([msg("handoff.dry_run_warning", warning=w) for w in plan.warnings]
                         + [line])
    return line


def prepare_launch(engine: str, settings: ResolvedSettings | Mapping[str, Any],
                   model: BackendModel, *, passthrough: Sequence[str] = (),
                   engine_cfg: Mapping[str, Any] | None = None,
                   cache: Path | None = None) -> LaunchPlan:
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
