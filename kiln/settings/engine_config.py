"""What the engine needs from the resolved settings, frozen: `EngineConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.settings.resolve import ResolvedSettings
from kiln.settings.table import BY_NAME


def _table_default(name: str) -> Any:
    return BY_NAME[name].default


@dataclass(frozen=True)
class EngineConfig:
    """What the engine needs, frozen. Built from resolved settings by `from_settings` (every
    front-end does: kiln serve, kiln run, LLM, kiln bench --offline); tests build it directly.

    Settings with a fixed default take it from the table. Those the table decides by an auto
    rule (dtype, quantization, threads, batch limits, ...) have no single default; the values
    here are the engine's plain fallback for direct construction: float32, unquantized, CPU
    limits."""

    model: str  # folder or .gguf path
    gguf_file: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    quantization: str = "none"
    dense_weights: bool = False  # keep bf16 copies of quantized weights for large steps
    max_model_len: int | None = None  # None: the model's own limit (capped by memory)
    max_model_len_explicit: bool = False  # the user asked for it: refuse rather than lower it
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    num_threads: int | None = None
    block_size: int = _table_default("block_size")
    kv_cache_dtype: str = _table_default("kv_cache_dtype")
    gpu_memory_utilization: float = _table_default("gpu_memory_utilization")
    cpu_memory_utilization: float = _table_default("cpu_memory_utilization")
    kv_cache_memory: int | None = _table_default("kv_cache_memory")
    kv_max_blocks: int | None = _table_default("kv_max_blocks")
    enable_prefix_caching: bool = _table_default("enable_prefix_caching")
    seed: int = _table_default("seed")
    compile: bool = _table_default("compile")
    cpu_kernels: bool = _table_default("cpu_kernels")
    cpu_isa: str = _table_default("cpu_isa")
    adaptive_threads: bool = _table_default("adaptive_threads")
    gguf_kernels: bool = _table_default("gguf_kernels")
    batch_invariant: bool = _table_default("batch_invariant")
    prefix_rendezvous_max_wait_ms: int | None = _table_default("prefix_rendezvous_max_wait_ms")
    sequence_fit_policy: str = _table_default("sequence_fit_policy")
    scheduler_prefill_first_until_active: int | None = None
    scheduler_prefill_step_chunk: int | None = None
    scheduler_active_decode_prefill_chunk: int | None = None
    session_cache: str = _table_default("session_cache")
    session_cache_max_entries: int = _table_default("session_cache_max_entries")
    session_cache_max_tokens: int | None = _table_default("session_cache_max_tokens")
    # MoE experts split into a device pool and CPU pools (kiln/engine/expert_placement.py)
    cpu_offload_experts: bool = False
    num_gpu_experts: int | None = None
    kt_threadpool_count: int | None = None
    kt_cpuinfer: int | None = None
    kt_gpu_prefill_token_threshold: int | None = None
    expert_calibration: str = _table_default("expert_calibration")
    # while serving (kiln/obs/): traces and faults the engine itself writes / injects
    profile_jsonl: str | None = None
    profile_detail: str = _table_default("profile_detail")
    profile_sample_rate: float = _table_default("profile_sample_rate")
    scheduler_trace_jsonl: str | None = None
    diagnostic_faults: tuple[Any, ...] = ()
    # LoRA adapters (kiln/engine/lora.py): NAME=PATH each, loaded at startup
    lora_modules: tuple[str, ...] = ()
    max_loras: int = _table_default("max_loras")
    max_lora_rank: int = _table_default("max_lora_rank")
    enable_lora_runtime_updates: bool = _table_default("enable_lora_runtime_updates")
    # speculative decoding (kiln/engine/spec.py); num_speculative_tokens "auto": from acceptance
    speculative_method: str | None = None
    speculative_model: str | None = None  # the draft model's resolved path (engine/draft.py)
    num_speculative_tokens: int | str | None = None
    ngram_prompt_lookup_min: int = _table_default("ngram_prompt_lookup_min")
    ngram_prompt_lookup_max: int = _table_default("ngram_prompt_lookup_max")
    speculative_disable_by_batch_size: int | None = None  # None: draft at every batch size
    speculative_draft_vocab: int = _table_default("speculative_draft_vocab")
    speculative_prompt_lookup: int = _table_default("speculative_prompt_lookup")

    @classmethod
    def from_settings(cls, s: ResolvedSettings, model: str, gguf_file: str | None = None
                      ) -> EngineConfig:
        names = {f for f in cls.__dataclass_fields__} - {"model", "gguf_file",
                                                          "max_model_len_explicit"}
        kw = {n: s.get(n) for n in names if n in s.values and s.get(n) is not None}
        mml = s.values.get("max_model_len")
        explicit = mml is not None and mml.source in ("cli", "env", "file")
        return cls(model=model, gguf_file=gguf_file, max_model_len_explicit=explicit, **kw)
