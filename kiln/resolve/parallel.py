"""Planning for MoE models and several GPUs, before anything loads: where the experts go
(kiln's engine: the expert-placement plan; an external engine: the registry's experts-per-GPU
rule), how far a model can be split (whole heads per GPU), kt-kernel's preconditions, and what
the preset picker reads from the model's config. startup.plan() calls these in order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.errors import ConfigError
from kiln.i18n import msg
from kiln.layers.kernels.flags import AMX_FLAGS
from kiln.settings.resolve import ResolvedSettings
from kiln.settings.rules import GiB


def plan_expert_placement(sp: Any) -> None:
    """kiln's engine with split experts: the placement as planned before loading (estimated
    expert bytes, cached ranking), for the dry run and the effective config; the engine's own,
    measured one replaces it when it loads (record_engine)."""
    from kiln.engine.expert_placement import plan_from_config

    s, mc, src = sp.settings, sp.model_config, sp.source
    assert s is not None
    if not s.get("cpu_offload_experts") or mc is None or src is None:
        return
    if not mc.is_moe:
        s.warnings.append(msg("startup.offload_dense", source=s.source("cpu_offload_experts"),
                              model=src.name))
        return
    placement = plan_from_config(mc, s, sp.hardware, str(src.gguf_file or src.path))
    record_placement(sp, placement, source="auto")


def record_placement(sp: Any, placement: Any, source: str) -> None:
    s = sp.settings
    assert s is not None
    if s.source("num_gpu_experts") not in ("cli", "env", "file"):  # the plan's N, and why
        s.override("num_gpu_experts", placement.num_device_experts, placement.rule,
                   source=source, code=placement.rule_code or None)
    sp.extra["moe_placement"] = placement.to_dict()
    sp.extra.setdefault("decisions", {})["moe_placement"] = {
        "chosen": placement.summary(), "reason": f"N: {placement.rule}; which: {placement.hot}"}


def model_is_moe(entry: Any, mc: Any) -> bool:
    return bool(entry and entry.kind == "moe") or bool(mc and mc.is_moe)


def model_max_tp(entry: Any, mc: Any) -> int | None:
    """The most GPUs one replica may split over: the registry's number, else the largest power
    of two (<= 8) dividing both the attention heads and the KV heads (whole heads per rank),
    the rule models.toml's numbers follow."""
    if entry is not None:
        return int(entry.max_tensor_parallel)
    if mc is None or not mc.num_attention_heads:
        return None
    tp = 8
    while tp > 1 and (mc.num_attention_heads % tp or (mc.num_key_value_heads or 1) % tp):
        tp //= 2
    return tp


def reduce_tp_to_model_max(s: ResolvedSettings, max_tp: int | None) -> None:
    """An explicit TP above the model's maximum would only make the engine refuse to start:
    reduce it and say so (kt-cli does the same)."""
    r = s.values["tensor_parallel_size"]
    asked, source = r.value, r.source
    if not max_tp or not asked or asked <= max_tp:
        return
    reason = (f"{source} asked {asked}; this model splits over at most {max_tp} GPUs (whole "
              f"attention and KV heads per GPU), so reduced to {max_tp}")
    s.override("tensor_parallel_size", max_tp, reason, code="tensor_parallel_size.model_max")
    s.warnings.append(msg("startup.tp_reduced", asked=asked, source=source, max_tp=max_tp))


def check_kt(s: ResolvedSettings, sp: Any, hw: Any) -> None:
    """kt-kernel on (SGLang, an MoE model): the expert weights are where they are said to be,
    and the CPU runs the method asked for, before SGLang spends minutes finding out."""
    src = sp.source
    assert src is not None
    weights = s.get("kt_weight_path")
    if weights:
        if not Path(weights).expanduser().is_dir():
            raise ConfigError(msg("startup.kt_weights_missing", path=weights),
                              hint=msg("startup.kt_weights_missing.hint"))
    elif src.format == "safetensors":
        s.override("kt_weight_path", str(src.path),
                   "kt-cli's default: no converted weights given, so kt-kernel reads the "
                   "experts from the model folder", code="kt_weight_path.model_folder")
    method = str(s.get("kt_method") or "").upper()
    if method.startswith("AMX") and not hw.cpu_amx:
        how = (msg("startup.kt_default_method") if s.source("kt_method") == "auto"
               else s.source("kt_method"))
        raise ConfigError(
            msg("startup.kt_no_amx", method=method, how=how, flags="/".join(sorted(AMX_FLAGS))),
            hint=msg("startup.kt_no_amx.hint"))


def preset_info(sp: Any, mc: Any) -> dict[str, Any]:
    """What infer_preset reads, in HF config names, from the checkpoint's config (HF or GGUF):
    an MoE's experts too, so the preset sees its total and its active parameters."""
    assert sp.source is not None
    info = {"architectures": [mc.architecture], "hidden_size": mc.hidden_size,
            "num_hidden_layers": mc.num_hidden_layers,
            "num_attention_heads": mc.num_attention_heads,
            "num_key_value_heads": mc.num_key_value_heads, "head_dim": mc.head_dim,
            "intermediate_size": mc.intermediate_size, "vocab_size": mc.vocab_size,
            "tie_word_embeddings": mc.tie_word_embeddings,
            "quantization": sp.source.quant or mc.quantization,
            "total_bytes": sp.source.total_bytes}
    entry = sp.source.registry_entry
    if entry is not None:
        # The published counts beat the estimate from the config (MLA, routers, rounding).
        total, active = entry.param_counts
        info.update({k: v for k, v in (("num_params", total), ("active_params", active)) if v})
    if mc.is_moe:
        info.update(num_experts=mc.num_experts, num_experts_per_tok=mc.num_experts_per_tok,
                    moe_intermediate_size=mc.moe_intermediate_size,
                    shared_expert_intermediate_size=mc.shared_expert_intermediate_size,
                    mlp_only_layers=sorted(mc.dense_layers))
    return info


def auto_gpu_experts(s: ResolvedSettings, entry: Any, hw: Any, noted: bool = False) -> None:
    """Hybrid MoE: how many experts of each layer stay on the GPUs, from VRAM per GPU and TP
    (the registry's rule per model family, as ktransformers sizes it). `noted`: the user was
    already told the model has no registry entry (and how to give it one)."""
    if not s.get("cpu_offload_experts") or s.get("num_gpu_experts") is not None \
            or s.get("engine") == "kiln":  # kiln's engine: its placement plan decides
        return
    if entry is None or entry.gpu_experts_rule is None or not hw.gpus:
        if not (noted and entry is None):
            s.warnings.append(msg("startup.gpu_experts_unsized"))
        return
    from kiln.resolve.registry import gpu_experts_per_layer

    vram = min(g.total_memory_bytes for g in hw.gpus)
    tp = s["tensor_parallel_size"] or 1
    n = gpu_experts_per_layer(entry, vram, tp)
    s.override("num_gpu_experts", n, f"{n} experts per layer fit in {vram / GiB:.0f} GiB per "
               f"GPU x TP {tp} after the dense weights ({entry.name} rule)",
               code="num_gpu_experts.registry_rule")
