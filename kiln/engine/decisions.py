"""What the model runner decided at startup, once, each with its reason: the KV cache dtype, the
decode path (kiln's one-call decode-layer kernel, compiled graphs per batch bucket, or eager
modules), whether torch.compile compiled anything, and whether dense bf16 weight copies were
kept. Settings resolve before the weights load; these follow from the loaded model and the
machine, so the startup code writes `RuntimeDecisions.to_dict()` back into the effective config.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any

import torch

from kiln.engine.compile import decode_buckets
from kiln.engine.memory import KV_DTYPES, gib
from kiln.errors import ConfigError
from kiln.i18n import msg
from kiln.settings.engine_config import EngineConfig
from kiln.settings.rules import AutoContext, auto_kv_cache_dtype

log = logging.getLogger("kiln.runner")


@dataclass(frozen=True)
class Decision:
    """What the runner decided, why in words a person acts on (they name the flag or the
    number to change), and a stable code, `<decision>.<why>`, naming the branch that decided:
    the decision trace carries it, and tests and tools match it instead of the words."""

    value: Any
    reason: str
    code: str


@dataclass(frozen=True)
class RuntimeDecisions:
    kv_cache_dtype: Decision  # "fp32" | "bf16" | "fp16" | "int8"
    decode_path: Decision  # "kernel" | "kernel+compiled" | "kernel+eager" | "compiled" | "eager"
    compiled: Decision  # bool: torch.compile built graphs
    dense_weights: Decision  # bool: quantized layers keep a dense copy of their weight
    batch_invariant: Decision  # bool: a row's numbers do not depend on the rest of its step
    cascade: Decision  # bool: cascade attention over shared prefixes
    # What the runner's step reads: decode steps of up to this many rows run the layer kernel
    # (0: none), and the batch buckets that have compiled graphs (empty: nothing compiled).
    cpu_kernels: Decision  # the ISA level kiln's kernels run at, and each layer's kernel
    decode_kernel_rows: int
    compile_buckets: tuple[int, ...]

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """{name: {"value": ..., "reason": ..., "code": ...}} for the effective-config JSON."""
        return {f.name: {"value": d.value, "reason": d.reason, "code": d.code} for f in fields(self)
                if isinstance(d := getattr(self, f.name), Decision)}


def choose_kv_cache_dtype(config: EngineConfig, device: torch.device,
                          mla: bool = False) -> Decision:
    """The KV pool's storage dtype. "auto" is resolved by the settings table; the same rule
    serves an EngineConfig built directly with "auto". `mla`: the model keeps a latent row per
    token (DeepSeek), which int8 storage does not support (its keys are stored rotated, and
    MLA's values are the keys' first columns): it falls back to the model dtype, saying so."""
    name = config.cache.kv_cache_dtype
    if name == "auto":
        from kiln.layers.kernels.choose import choose_cpu_kernels

        # the rule reads cpu_kernels on a CPU only; there, as before, whether kiln's kernels
        # run at all (--no-cpu-kernels is not asked: the KV dtype does not follow it)
        ctx = AutoContext(cpu_kernels=choose_cpu_kernels(device).kiln)
        value, reason, code = auto_kv_cache_dtype(ctx, {
            "dtype": config.dtype, "device": device.type, "quantization": config.quant.method})
        name, decided = value, Decision(value, reason, code)
    else:
        decided = None
    if name not in KV_DTYPES:
        raise ConfigError(msg("load.unknown_kv_dtype", name=repr(name)),
                          hint=msg("config.choose_one", choices=", ".join(["auto", *KV_DTYPES])))
    if mla and name == "int8":
        fallback, _, _ = auto_kv_cache_dtype(AutoContext(), {"dtype": config.dtype})
        log.warning("int8 KV is not supported for multi-head latent attention: using %s",
                    fallback)
        return Decision(fallback, "int8 KV is not supported for multi-head latent attention "
                                  f"(the latent rows are kept unrotated): the model dtype "
                                  f"{config.dtype}, as {fallback}", "kv_cache_dtype.mla_no_int8")
    if decided is not None:
        return decided
    reason = f"kv_cache_dtype {name} as configured"
    if name == "int8":
        reason += f"; an fp16 scale per (token, head), computed in {config.dtype}"
    elif name == "fp16" and device.type == "cpu" and config.dtype != "float16":
        log.info("fp16 KV on CPU: stored in fp16, computed in %s", config.dtype)
        reason += f"; stored in fp16, computed in {config.dtype}"
    return Decision(name, reason, "kv_cache_dtype.configured")


def decide(config: EngineConfig, model: torch.nn.Module, device: torch.device,
           kv_cache_dtype: Decision) -> RuntimeDecisions:
    """The decisions of a runner whose model is built and whose KV pool is attached (the layer
    kernel needs a pool the kernels read). Nothing here runs per step."""
    kernel_rows, kernel_why = _decode_kernel_rows(config, model, device)
    moe = _moe_eager(model)
    # Batch invariance, where its attention kernel runs, turns compile and cascade off.
    invariant = _batch_invariant(config, model, kernel_rows)
    buckets = (decode_buckets(kernel_rows, config.scheduler.max_num_seqs)
               if config.compile and not moe and not invariant.value else [])
    reads = any(getattr(layer.kv, "invariant", False) for layer in model.attention_layers())
    cascade = _cascade(model, invariant.value)
    kv = Decision(kv_cache_dtype.value, kv_cache_dtype.reason + (
        "; kiln's attend_rows reads the pool in place" if reads else ""), kv_cache_dtype.code)
    return RuntimeDecisions(
        kv_cache_dtype=kv,
        decode_path=_decode_path(config, kernel_rows, kernel_why, buckets, device,
                                 moe or ("--batch-invariant" if invariant.value else ""),
                                 cascade.value),
        compiled=_compiled(config, kernel_rows, buckets, device, moe, invariant.value,
                           cascade.value),
        dense_weights=_dense_weights(config, model),
        batch_invariant=invariant,
        cascade=cascade,
        cpu_kernels=_cpu_kernels(config, model, device),
        decode_kernel_rows=kernel_rows,
        compile_buckets=tuple(buckets))


def _decode_kernel_rows(config: EngineConfig, model: torch.nn.Module,
                        device: torch.device) -> tuple[int, str]:
    """Up to how many rows every decoder layer can run a decode step as one kernel call (kiln's
    CPU kernels under --batch-invariant with an fp32 pool; see decode_kernel_rows in models/llama.py), and why not when 0."""
    if device.type != "cpu":
        return 0, "kiln's decode-layer kernel is CPU-only"
    if not config.quant.cpu_kernels:
        return 0, "--no-cpu-kernels"
    layers = list(getattr(getattr(model, "model", None), "layers", []))
    if not layers or not all(hasattr(layer, "decode_kernel_rows") for layer in layers):
        return 0, "this model family has no one-call decode layer"
    rows = min(layer.decode_kernel_rows() for layer in layers)
    if rows:
        return rows, ""
    if config.quant.method in (None, "none"):
        return 0, "the layer kernels run quantized layers only, and nothing is quantized"
    if config.dtype != "float32":
        return 0, f"the layer kernel computes in fp32, the model runs {config.dtype}"
    return 0, ("the layer kernel runs under --batch-invariant, for Llama-form layers (no q/k "
               "norms, no sliding window, full RoPE) whose linears are int4 or GGUF blocks")


def _cpu_kernels(config: EngineConfig, model: torch.nn.Module, device: torch.device) -> Decision:
    """Which ISA level kiln's CPU kernels run at and which kernel each quantized layer took
    (kiln.layers.kernels.choose), with the reasons."""
    if device.type != "cpu":
        return Decision(None, f"kiln's CPU kernels do not run on {device.type}",
                        "cpu_kernels.not_cpu")
    if not config.quant.cpu_kernels:
        return Decision(None, "--no-cpu-kernels: PyTorch's paths", "cpu_kernels.off")
    from kiln.layers.kernels.choose import summary

    level, why = summary(model)
    return Decision(level, why, "cpu_kernels.chosen")


def _moe_eager(model: torch.nn.Module) -> str:
    """Why an MoE model's decode is not compiled ("" for a dense model)."""
    from kiln.layers.moe import experts_of

    experts = experts_of(model)
    if not experts:
        return ""
    return (f"MoE experts run eagerly: which of the {experts[0].num_experts} experts of each of "
            f"the {len(experts)} MoE layers run depends on each step's routing (data-dependent "
            "shapes break a compiled graph), and the padded rows of a batch bucket would be "
            "routed and counted too")


def _kernel_reach(kernel_rows: int) -> str:
    """The steps the layer kernel runs, in words."""
    from kiln.models.llama import DECODE_KERNEL_ANY_ROWS

    return (f"up to {kernel_rows} rows" if kernel_rows < DECODE_KERNEL_ANY_ROWS
            else "any row count")


def _decode_path(config: EngineConfig, kernel_rows: int, kernel_why: str, buckets: list[int],
                 device: torch.device, moe: str = "", cascade: bool = True) -> Decision:
    graphs = (f"compiled graphs for batch buckets {buckets} (padded up to the bucket"
              + ("; cascade variants for shared prefixes)" if device.type == "cpu" and cascade
                 else ")"))
    if kernel_rows:
        kernel = (f"decode steps of {_kernel_reach(kernel_rows)} run kiln's one-call "
                  "decode-layer kernel")
        if kernel_rows >= config.scheduler.max_num_seqs:
            return Decision("kernel", f"{kernel} (every batch: --max-num-seqs "
                                      f"{config.scheduler.max_num_seqs})",
                            "decode_path.kernel_every_batch")
        if buckets:
            return Decision("kernel+compiled", f"{kernel}; larger ones {graphs}",
                            "decode_path.kernel_then_compiled")
        return Decision("kernel+eager", f"{kernel}; larger ones eager modules (--compile is off)",
                        "decode_path.kernel_then_eager")
    if buckets:
        return Decision("compiled", f"decode steps run {graphs}; no layer kernel: {kernel_why}",
                        "decode_path.compiled")
    # `moe`: why --compile cannot apply here (MoE routing, or --batch-invariant)
    why, code = ((moe, "decode_path.eager_uncompilable") if config.compile and moe
                 else ("--compile is off", "decode_path.eager_compile_off"))
    return Decision("eager", f"eager modules: {why}; no layer kernel: {kernel_why}", code)


def _batch_invariant(config: EngineConfig, model: torch.nn.Module,
                     kernel_rows: int) -> Decision:
    """Whether every row's arithmetic is its own (see the batch_invariant setting)."""
    if not config.quant.batch_invariant:
        return Decision(False, "--no-batch-invariant: kernels chosen by each step's row count, "
                               "compiled decode and cascade attention allowed",
                        "batch_invariant.off")
    layers = list(model.attention_layers()) if hasattr(model, "attention_layers") else []
    if any(getattr(layer, "softcap", None) is not None for layer in layers):
        return Decision(False, "asked, but this model soft-caps its attention scores (Gemma "
                               "2), which kiln's batch-invariant kernel (attend_rows) does not: "
                               "its layers attend through PyTorch", "batch_invariant.softcap")
    if not layers or not all(getattr(layer.kv, "invariant", False) for layer in layers):
        return Decision(False, "asked, but the batch-invariant attention kernel does not run "
                               "here (it needs kiln's CPU kernels, --cpu-kernels, an fp32/bf16 "
                               "KV pool in the model dtype)", "batch_invariant.no_kernel")
    layer_kernel = ("decode steps run each layer as one call of the same kernels"
                    if kernel_rows else "decode steps run the eager layers (no layer kernel "
                                        "for this model's layers)")
    return Decision(True, "attention row by row in one fixed order (kiln's attend_rows), one "
                          "kernel per quantized layer at every row count; "
                          f"{layer_kernel}; decode not compiled, no cascade attention",
                    "batch_invariant.on")


def _windowed_or_capped(model: torch.nn.Module) -> str:
    """Why some attention layer reads each row's context its own way ("" if none does):
    a sliding window (its start differs per row) or soft-capped scores."""
    layers = list(model.attention_layers()) if hasattr(model, "attention_layers") else []
    if any(getattr(layer, "softcap", None) is not None for layer in layers):
        return "attention-logit soft-capping (Gemma 2)"
    if any(getattr(layer, "sliding_window", None) is not None for layer in layers):
        return "sliding-window attention layers"
    return ""


def _cascade(model: torch.nn.Module, invariant: bool) -> Decision:
    if invariant:
        return Decision(False, "--batch-invariant: every decode row reads its whole context in "
                               "one order (a shared prefix read once for all rows would merge "
                               "in another)", "cascade.batch_invariant")
    special = _windowed_or_capped(model)
    if special:
        return Decision(False, f"{special}: each decode row attends over its own context "
                               "(a prefix shared by all rows may lie outside a row's window, "
                               "and the cascade kernels neither slide nor cap)",
                        "cascade.window_or_softcap")
    return Decision(True, "decode rows sharing a cached prefix attend to it once", "cascade.on")


def _compiled(config: EngineConfig, kernel_rows: int, buckets: list[int],
              device: torch.device, moe: str = "", invariant: bool = False,
              cascade: bool = True) -> Decision:
    if not config.compile:
        return Decision(False, "--compile is off", "compiled.compile_off")
    if moe:
        return Decision(False, moe, "compiled.moe")
    if kernel_rows and not buckets:
        return Decision(False, f"decode steps of {_kernel_reach(kernel_rows)} run kiln's layer "
                               "kernel: nothing to compile", "compiled.layer_kernel")
    if invariant:
        return Decision(False, "--batch-invariant: inductor's fused decode graphs round "
                               "differently from the eager steps that mix decodes with prefill "
                               "chunks (and from one batch bucket to another)",
                        "compiled.batch_invariant")
    if not buckets:
        return Decision(False, "no batch bucket to compile", "compiled.no_bucket")
    variants = " and their cascade variants" if device.type == "cpu" and cascade else ""
    return Decision(True, f"the decode layer for batch buckets {buckets}{variants}, compiled "
                          "at startup; prefill and mixed steps run eager", "compiled.buckets")


def _dense_weights(config: EngineConfig, model: torch.nn.Module) -> Decision:
    from kiln.layers.quant.linear import Int4Linear, Int8Linear

    quantized = [m for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    if not quantized:
        return Decision(False, "nothing is quantized: the weights are dense already",
                        "dense_weights.nothing_quantized")
    if not config.quant.dense_weights:
        return Decision(False, "dense_weights off: quantized weights only", "dense_weights.off")
    kept = [m for m in quantized if m.dense is not None]
    size = gib(sum(m.dense.numel() * m.dense.element_size() for m in kept))
    skipped = sum(isinstance(m, Int4Linear) and m.kernel == "q4" for m in quantized)
    none_int4 = ("int4 layers on kiln's kernels keep none (their int8-activation kernel is "
                 "faster at every size)")
    q8 = any(isinstance(m, Int8Linear) and m.q8 for m in quantized)
    none_int8 = ("the int8 head runs kiln's q8_linear at every size (--batch-invariant) "
                 "and keeps none")
    none = "; ".join(r for r, on in ((none_int4, skipped), (none_int8, q8)) if on)
    if not kept:
        return Decision(False, none or none_int4, "dense_weights.kernels_keep_none")
    reason = (f"{len(kept)} of {len(quantized)} quantized linears keep a dense copy ({size}) "
              "for steps of many rows")
    return Decision(True, reason + (f"; {none}" if none else ""), "dense_weights.kept")
