"""What startup decided, shown and recorded (kiln/startup.py decides): --dry-run's description,
the effective config (--effective-config-json, /v1/dashboard/config, `LLM.effective_config`), its
hash, the decision trace (--decision-trace-jsonl), and the failure report that still writes
both when a phase fails."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.errors import ConfigError, KilnError, error_record
from kiln.i18n import coded, english, msg
from kiln.settings.rules import GiB

if TYPE_CHECKING:
    from kiln.startup_plan import StartupPlan


def describe(sp: StartupPlan) -> str:
    hw, src, s = sp.hardware, sp.source, sp.settings
    # Labels and sentences in the CLI's language; values, setting names, sources and the auto
    # rules' reasons as they are (the same words the effective config and the trace carry).
    lines: list[str] = [msg("dry.hardware")]
    if hw is not None:
        lines.append(msg("dry.cpu", model=hw.cpu_model, cores=hw.physical_cores,
                         numa=hw.numa_nodes))
        lines.append(msg("dry.ram", available=hw.ram_available_bytes / GiB,
                         total=hw.ram_total_bytes / GiB))
        gpus = ", ".join(f"{g.name} {g.total_memory_bytes / GiB:.0f} GiB" for g in hw.gpus)
        lines.append(msg("dry.gpus", gpus=gpus or msg("dry.none")))
    if src is not None:
        lines.append(msg("dry.model"))
        lines.append(msg("dry.name", name=src.name, kind=src.kind, origin=src.origin))
        lines.append(msg("dry.path", path=src.gguf_file or src.path))
        lines.append(msg("dry.format", format=src.format,
                         quant=f" {src.quant}" if src.quant else "",
                         size=src.total_bytes / GiB))
        if sp.model_config is not None:
            mc = sp.model_config
            lines.append(msg("dry.arch", arch=mc.architecture, layers=mc.num_hidden_layers,
                             hidden=mc.hidden_size, context=mc.max_position_embeddings))
            if mc.is_moe:
                moe_layers = sum(map(mc.is_moe_layer, range(mc.num_hidden_layers)))
                shared = (msg("dry.shared_experts", width=mc.shared_expert_intermediate_size)
                          if mc.shared_expert_intermediate_size else "")
                lines.append(msg("dry.experts", experts=mc.num_experts, moe_layers=moe_layers,
                                 layers=mc.num_hidden_layers, active=mc.num_experts_per_tok,
                                 shared=shared))
    if sp.preset:
        lines.append(msg("dry.preset", preset=sp.preset, reason=sp.preset_reason))
    if s is not None:
        lines.append(msg("dry.settings"))
        for r in s.non_default():
            value = "***" if r.name == "api_key" else r.value
            # "preset kt", not "preset": which bundle a value came from is its provenance.
            source = f"preset {sp.preset}" if r.source == "preset" and sp.preset else r.source
            lines.append(f"  {r.name:<24} = {value!s:<14} [{source}] {r.reason}")
        for w in s.warnings:
            lines.append(msg("dry.warning", warning=w))
    placement = sp.extra.get("moe_placement")
    if placement:
        from kiln.engine.expert_placement import LayerPlacement, PlacementPlan

        plan = PlacementPlan(**{**placement, "layers": [LayerPlacement(**lp) for lp in
                                                        placement["layers"]]})
        lines.append(msg("dry.moe_placement"))
        lines.extend(plan.describe())
    return "\n".join(lines)


def effective_config(sp: StartupPlan, status: str, error: BaseException | None = None
                     ) -> dict[str, Any]:
    out: dict[str, Any] = {"status": status, "phase": sp.phase}
    if error is not None:
        out["error"] = error_record(error)
    out["settings"] = sp.settings.to_json() if sp.settings else {}
    if sp.settings and "api_key" in out["settings"] and out["settings"]["api_key"]["value"]:
        out["settings"]["api_key"]["value"] = "***"
    out["warnings"] = [coded(w) for w in sp.settings.warnings] if sp.settings else []
    out["preset"] = {"name": sp.preset, "reason": sp.preset_reason, "code": sp.preset_code}
    out["hardware"] = sp.hardware.to_dict() if sp.hardware is not None else None
    model: dict[str, Any] | None = sp.source.to_dict() if sp.source is not None else None
    if model is not None and sp.model_config is not None:
        from dataclasses import asdict

        model["config"] = asdict(sp.model_config)
    out["model"] = model
    out["config_file"] = str(sp.config_file) if sp.config_file else None
    out.update(sp.extra)
    return out


def config_hash(sp: StartupPlan) -> str:
    """sha256 of the resolved settings (api key masked): what a request dump and a profile
    record, so two runs can be told apart or matched."""
    import hashlib

    settings = effective_config(sp, "ok")["settings"]
    text = json.dumps(settings, sort_keys=True, default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def write_artifacts(sp: StartupPlan, status: str, error: BaseException | None = None, *,
                    lenient: bool = False) -> list[Any]:
    """Writes --effective-config-json and --decision-trace-jsonl. With `lenient` (after a
    failure) a file that cannot be written is returned as a one-line problem, not raised: the
    startup error is what the user must see, not a traceback about the artifact."""
    args = sp.args
    problems: list[Any] = []
    for attr, write in (("effective_config_json", _write_effective),
                        ("decision_trace_jsonl", _write_trace)):
        path: Path | None = getattr(args, attr, None)
        if not path:
            continue
        flag = "--" + attr.replace("_", "-")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write(path, sp, status, error)
        except OSError as e:
            if not lenient:
                # The user's path, not kiln's state: a one-line error that names the flag.
                sp.phase = "artifacts"
                raise ConfigError(msg("startup.artifact_failed", flag=flag, path=path,
                                        error=e.strerror or e),
                                    hint=msg("startup.artifact_failed.hint")) from None
            problems.append(msg("startup.artifact_unwritable", flag=flag, path=path,
                                error=e.strerror or e))
    return problems


def _write_effective(path: Path, sp: StartupPlan, status: str,
                     error: BaseException | None) -> None:
    path.write_text(json.dumps(effective_config(sp, status, error), indent=2, default=str))


def _write_trace(path: Path, sp: StartupPlan, status: str, error: BaseException | None) -> None:
    with path.open("w") as f:
        f.write(json.dumps({"decision": "preset", "chosen": sp.preset,
                            "reason": sp.preset_reason, "code": sp.preset_code},
                           default=str) + "\n")
        if sp.source is not None:
            f.write(json.dumps({"decision": "model", "chosen": str(sp.source.gguf_file
                                                                 or sp.source.path),
                                "reason": f"{sp.source.kind} via {sp.source.origin}"},
                               default=str) + "\n")
        for row in (sp.settings.trace() if sp.settings else []):
            f.write(json.dumps({"decision": "setting", **row}, default=str) + "\n")
        for key, value in sp.extra.get("decisions", {}).items():
            f.write(json.dumps({"decision": key, **value}, default=str) + "\n")
        f.write(json.dumps({"decision": "startup", "status": status, "phase": sp.phase,
                            "error_code": getattr(error, "code", None) if error else None,
                            "error": english(error) if error else None}) + "\n")


def fail(sp: StartupPlan, err: BaseException) -> int:
    """Records the failure, prints it the way a user can act on, and gives the exit code. An
    artifact that cannot be written is one warning line after the error."""
    from kiln.obs.trace import shutdown_stages

    shutdown_stages()
    if isinstance(err, KilnError):
        print(msg("cli.error", phase=sp.phase, error=err), file=sys.stderr)
        code = err.exit_code
    else:
        print(msg("cli.unexpected_error", phase=sp.phase, type=type(err).__name__, error=err),
              file=sys.stderr)
        code = 1
    for problem in write_artifacts(sp, "failed", err, lenient=True):
        print(msg("cli.warning", warning=problem), file=sys.stderr)
    return code
