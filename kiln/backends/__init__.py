"""External engines: translate kiln's settings for vLLM / SGLang, find them, launch them.

    plan = prepare_launch("vllm", settings, BackendModel(path, served_names=[name]),
                          passthrough=args_after_dashdash, engine_cfg=engines.get("vllm"))
    print(plan_to_dry_run(plan))          # or
    sys.exit(launch(plan, drain_timeout_s=settings.get("drain_timeout")))

`build_plan` alone (no probing of the installed engine) is what `--dry-run` wants: instant.
"""

from __future__ import annotations

from kiln.backends.base import (
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
    auto_tensor_parallel,
    build_plan,
    check_plan,
    choose_engine,
    find_engine,
    format_running_block,
    get_backend,
    gpu_experts_per_layer,
    is_engine_available,
    launch,
    parse_help,
    plan_to_dry_run,
    prepare_launch,
    probe_engine,
)

__all__ = [
    "ENGINE_DECIDES", "ENGINES", "Arg", "Backend", "BackendModel", "EngineCommand", "EngineHelp",
    "Env", "LaunchPlan", "Map", "PlanContext", "Untranslatable", "auto_tensor_parallel",
    "build_plan", "check_plan", "choose_engine", "find_engine", "format_running_block",
    "get_backend", "gpu_experts_per_layer", "is_engine_available", "launch", "parse_help",
    "plan_to_dry_run", "prepare_launch", "probe_engine",
]
