"""External engines: translate kiln's settings for vLLM / SGLang, find them, launch them.

kiln never runs its own distributed runtime: for many GPUs or nodes it translates its settings
into the engine's own flags and launches the engine's OpenAI server.

    table.py       the mapping-table machinery (Backend, Map rows, PlanContext, shared converters)
    vllm.py        one table each: kiln setting -> engine flag
    sglang.py
    plan.py        settings -> LaunchPlan (argv, env, warnings); dry-run line; prepare_launch
    discovery.py   find_engine, probe_engine (--help, cached), check_plan
    launch.py      choose_engine (--engine auto), the "server running" block, launch + supervise
    export.py      a GGUF as an HF folder (cached) for engines that want one

    plan = prepare_launch("vllm", settings, BackendModel(path, served_names=[name]),
                          passthrough=args_after_dashdash, engine_cfg=engines.get("vllm"))
    print(plan_to_dry_run(plan))          # or
    sys.exit(launch(plan, drain_timeout_s=settings.get("drain_timeout")))

`build_plan` alone (no probing of the installed engine) is what `--dry-run` wants: instant.
"""

from __future__ import annotations

from kiln.backends.discovery import (
    check_plan,
    find_engine,
    is_engine_available,
    parse_help,
    probe_engine,
)
from kiln.backends.launch import choose_engine, format_running_block, launch
from kiln.backends.plan import build_plan, plan_to_dry_run, prepare_launch
from kiln.backends.table import (
    ENGINE_DECIDES,
    ENGINES,
    Arg,
    Backend,
    BackendModel,
    EngineCommand,
    EngineHelp,
    Env,
    LaunchPlan,
    Map,
    PlanContext,
    Untranslatable,
    get_backend,
)

__all__ = [
    "ENGINES",
    "ENGINE_DECIDES",
    "Arg",
    "Backend",
    "BackendModel",
    "EngineCommand",
    "EngineHelp",
    "Env",
    "LaunchPlan",
    "Map",
    "PlanContext",
    "Untranslatable",
    "build_plan",
    "check_plan",
    "choose_engine",
    "find_engine",
    "format_running_block",
    "get_backend",
    "is_engine_available",
    "launch",
    "parse_help",
    "plan_to_dry_run",
    "prepare_launch",
    "probe_engine",
]
