"""What the engine needs from the resolved settings, frozen: `EngineConfig`, in groups.

A decision travels as one object: the quantization with the kernels that run it (`quant`), the
KV cache (`cache`), the scheduler's limits and knobs (`scheduler`), speculative decoding
(`speculative`), LoRA (`lora`), the MoE experts' placement (`experts`) and what the engine
records or injects (`diagnostics`); the model, its device, dtype, context and threads stay on
`EngineConfig` itself (vLLM's VllmConfig groups its settings the same way).

The groups are internal structure. Users keep the settings table's flat names (flags, KILN_*
env, config-file keys, the effective config): every field below names the row it holds
(`setting(...)`), and `EngineConfig.of(model, **settings)` / `from_settings` / `replace` place
each setting by that name, so the mapping from the table to the groups is written once, here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kiln.settings.resolve import ResolvedSettings
from kiln.settings.table import BY_NAME

_TABLE = object()  # "the table's default"


def setting(name: str, default: Any = _TABLE) -> Any:
    """A field that holds the settings row `name`, defaulting to the table's fixed default or,
    for rows the table decides by an auto rule, to the engine's plain fallback given here."""
    value = BY_NAME[name].default if default is _TABLE else default
    return field(default=value, metadata={"setting": name})


@dataclass(frozen=True)
class QuantConfig:
    """How the weights are stored and which kernels run them, decided together: the method, the
    bf16 copies kept beside quantized weights, kiln's CPU kernels (and their ISA level), the
    GGUF-block kernels, the batch-invariant kernels and the repacked tiles' cache."""

    method: str = setting("quantization", "none")
    dense_weights: bool = setting("dense_weights", False)  # bf16 copies for large steps
    cpu_kernels: bool = setting("cpu_kernels")
    cpu_isa: str = setting("cpu_isa")
    gguf_kernels: bool = setting("gguf_kernels")
    batch_invariant: bool = setting("batch_invariant")
    tile_cache: bool = setting("tile_cache")  # repacked GGUF weights kept between runs


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache: its blocks, their dtype, how large the pool may grow, prefix caching and
    the session cache kept on top of it."""

    block_size: int = setting("block_size")
    kv_cache_dtype: str = setting("kv_cache_dtype")
    gpu_memory_utilization: float = setting("gpu_memory_utilization")
    cpu_memory_utilization: float = setting("cpu_memory_utilization")
    kv_cache_memory: int | None = setting("kv_cache_memory")
    kv_max_blocks: int | None = setting("kv_max_blocks")
    enable_prefix_caching: bool = setting("enable_prefix_caching")
    session_cache: str = setting("session_cache")
    session_cache_max_entries: int = setting("session_cache_max_entries")
    session_cache_max_tokens: int | None = setting("session_cache_max_tokens")


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits and knobs (kiln/engine/scheduler.py takes this object as it is;
    the context length it also needs is decided by loading and passed beside it). The ferrum
    knobs are off (None / "immediate-only") unless set: kiln's one rule."""

    max_num_seqs: int = setting("max_num_seqs", 32)
    max_num_batched_tokens: int = setting("max_num_batched_tokens", 512)
    prefix_rendezvous_max_wait_ms: int | None = setting("prefix_rendezvous_max_wait_ms")
    prefill_step_chunk: int | None = setting("scheduler_prefill_step_chunk", None)
    active_decode_prefill_chunk: int | None = setting("scheduler_active_decode_prefill_chunk",
                                                      None)
    prefill_first_until_active: int | None = setting("scheduler_prefill_first_until_active",
                                                     None)
    sequence_fit_policy: str = setting("sequence_fit_policy")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding as asked (kiln/engine/spec.py checks it and builds the engine's
    SpecConfig); num_tokens "auto": from the acceptance rate."""

    method: str | None = setting("speculative_method", None)
    model: str | None = setting("speculative_model", None)  # the draft's resolved path
    num_tokens: int | str | None = setting("num_speculative_tokens", None)
    ngram_min: int = setting("ngram_prompt_lookup_min")
    ngram_max: int = setting("ngram_prompt_lookup_max")
    disable_by_batch_size: int | None = setting("speculative_disable_by_batch_size", None)
    draft_vocab: int = setting("speculative_draft_vocab")
    prompt_lookup: int = setting("speculative_prompt_lookup")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (kiln/engine/lora.py): NAME=PATH each, loaded at startup, and the slots."""

    modules: tuple[str, ...] = setting("lora_modules", ())
    max_loras: int = setting("max_loras")
    max_rank: int = setting("max_lora_rank")
    runtime_updates: bool = setting("enable_lora_runtime_updates")


@dataclass(frozen=True)
class ExpertConfig:
    """MoE experts split into a device pool and CPU pools (kiln/engine/expert_placement.py)."""

    cpu_offload: bool = setting("cpu_offload_experts", False)
    num_gpu: int | None = setting("num_gpu_experts", None)
    kt_threadpool_count: int | None = setting("kt_threadpool_count", None)
    kt_cpuinfer: int | None = setting("kt_cpuinfer", None)
    kt_gpu_prefill_token_threshold: int | None = setting("kt_gpu_prefill_token_threshold", None)
    calibration: str = setting("expert_calibration")


@dataclass(frozen=True)
class DiagnosticsConfig:
    """While serving (kiln/obs/): the traces the engine writes and the faults it injects."""

    profile_jsonl: str | None = setting("profile_jsonl", None)
    profile_detail: str = setting("profile_detail")
    profile_sample_rate: float = setting("profile_sample_rate")
    scheduler_trace_jsonl: str | None = setting("scheduler_trace_jsonl", None)
    faults: tuple[Any, ...] = setting("diagnostic_faults", ())


@dataclass(frozen=True)
class EngineConfig:
    """What the engine needs, frozen, in groups. Built from resolved settings by `from_settings`
    (every front-end does: kiln serve, kiln run, LLM, kiln bench --offline); tests and
    benchmarks build it by the table's names with `of`, or pass the groups.

    Settings with a fixed default take it from the table. Those the table decides by an auto
    rule (dtype, quantization, threads, batch limits, ...) have no single default; the values
    here are the engine's plain fallback for direct construction: float32, unquantized, CPU
    limits."""

    model: str  # folder or .gguf path
    gguf_file: str | None = None
    device: str = setting("device", "cpu")
    dtype: str = setting("dtype", "float32")
    max_model_len: int | None = setting("max_model_len", None)  # None: the model's own limit
    max_model_len_explicit: bool = False  # the user asked for it: refuse rather than lower it
    num_threads: int | None = setting("num_threads", None)
    adaptive_threads: bool = setting("adaptive_threads")
    seed: int = setting("seed")
    compile: bool = setting("compile")
    quant: QuantConfig = field(default_factory=QuantConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    experts: ExpertConfig = field(default_factory=ExpertConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)

    @classmethod
    def of(cls, model: str, gguf_file: str | None = None, max_model_len_explicit: bool = False,
           **settings: Any) -> EngineConfig:
        """The config with each setting (by its table name) placed in its group."""
        unknown = sorted(set(settings) - set(PLACES))
        if unknown:
            raise TypeError(f"EngineConfig has no setting(s) {', '.join(unknown)}")
        top: dict[str, Any] = {}
        groups: dict[str, dict[str, Any]] = {}
        for name, value in settings.items():
            group, attr = PLACES[name]
            (groups.setdefault(group, {}) if group else top)[attr] = value
        for group, kw in groups.items():
            top[group] = cls.__dataclass_fields__[group].default_factory(**kw)  # type: ignore[misc]
        return cls(model=model, gguf_file=gguf_file,
                   max_model_len_explicit=max_model_len_explicit, **top)

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with the given settings (table names) or model / gguf_file /
        max_model_len_explicit changed."""
        own = {k: changes.pop(k) for k in ("model", "gguf_file", "max_model_len_explicit")
               if k in changes}
        kw: dict[str, Any] = {}
        for name, value in changes.items():
            if name not in PLACES:
                raise TypeError(f"EngineConfig has no setting {name}")
            group, attr = PLACES[name]
            if group:
                kw[group] = dataclasses.replace(kw.get(group, getattr(self, group)),
                                                **{attr: value})
            else:
                kw[attr] = value
        return dataclasses.replace(self, **own, **kw)

    def settings(self) -> dict[str, Any]:
        """Every setting this config holds, by its table name (the inverse of `of`)."""
        return {name: getattr(getattr(self, g) if g else self, attr)
                for name, (g, attr) in PLACES.items()}

    @classmethod
    def from_settings(cls, s: ResolvedSettings, model: str, gguf_file: str | None = None
                      ) -> EngineConfig:
        kw = {n: s.get(n) for n in PLACES if n in s.values and s.get(n) is not None}
        mml = s.values.get("max_model_len")
        explicit = mml is not None and mml.source in ("cli", "env", "file")
        return cls.of(model, gguf_file, explicit, **kw)


def _places() -> dict[str, tuple[str | None, str]]:
    """Settings row name -> (group attribute or None for EngineConfig's own, field name)."""
    out: dict[str, tuple[str | None, str]] = {}
    for f in dataclasses.fields(EngineConfig):
        if "setting" in f.metadata:
            out[f.metadata["setting"]] = (None, f.name)
        elif isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
            for g in dataclasses.fields(f.default_factory):
                out[g.metadata["setting"]] = (f.name, g.name)
    return out


PLACES: dict[str, tuple[str | None, str]] = _places()
