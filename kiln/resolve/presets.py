"""Runtime presets: named bundles of kiln settings for a kind of model on a kind of machine.

A preset sits below CLI, env and config file and above model defaults in the settings
resolution, so users can still override any single value. Keys are kiln setting names.
`infer_preset` picks one from the model's HF config and the probed hardware, with a reason and a
code (the branch that decided) that go into the decision trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.errors import ConfigError
from kiln.i18n import msg
from kiln.resolve.hardware import HardwareInfo
from kiln.resolve.registry import RegistryEntry, gpu_experts_per_layer
from kiln.settings.table import BY_NAME

# Dense models up to this size count as "small" on CPU: at bf16 that is ~4 GB of weights, which
# decodes at interactive speed from DRAM bandwidth.
CPU_SMALL_MAX_PARAMS = 2.0e9
# Fraction of VRAM the weights may take before a model counts as not fitting on one GPU (the rest
# is KV cache and activations).
WEIGHTS_VRAM_FRACTION = 0.75


@dataclass
class Preset:
    name: str
    description: str
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.settings) - set(BY_NAME)
        if unknown:  # a typo here would silently do nothing
            raise ConfigError(f"preset {self.name!r} sets unknown settings {sorted(unknown)}")


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "cpu-small",
            "small dense model (<= 2B) on CPU: moderate batching, short chunks keep latency low, "
            "compiled decode (per-op overhead dominates a small model's step)",
            {
                "device": "cpu",
                "max_num_seqs": 16,
                "max_num_batched_tokens": 512,
                "block_size": 16,
                "kv_cache_dtype": "auto",
                "enable_prefix_caching": True,
                "compile": True,
            },
        ),
        Preset(
            "cpu-large",
            "larger dense model on CPU: few sequences (decode is DRAM-bound), 16-bit KV cache",
            {
                "device": "cpu",
                "max_num_seqs": 4,
                "max_num_batched_tokens": 256,
                "max_model_len": 4096,
                "block_size": 16,
                # auto: fp16 for quantized weights (what kiln's layer kernels read and write),
                # else the model dtype (bf16 on CPU): 16 bits either way
                "kv_cache_dtype": "auto",
                "enable_prefix_caching": True,
                "compile": False,
            },
        ),
        Preset(
            "gpu-single",
            "model fits one GPU: large batches, prefix caching, compiled decode",
            {
                "device": "cuda",
                "tensor_parallel_size": 1,
                "gpu_memory_utilization": 0.90,
                "max_num_seqs": 256,
                "max_num_batched_tokens": 8192,
                "block_size": 16,
                "enable_prefix_caching": True,
                "compile": True,
            },
        ),
        Preset(
            "gpu-throughput",
            "maximum tokens/s across all GPUs (tensor parallel): big batches and chunks",
            {
                "device": "cuda",
                "gpu_memory_utilization": 0.92,
                "max_num_seqs": 512,
                "max_num_batched_tokens": 16384,
                "block_size": 16,
                "enable_prefix_caching": True,
                "compile": True,
            },
        ),
        Preset(
            "moe-hybrid",
            "MoE too big for VRAM: attention + some experts on GPU, the other experts on CPU",
            {
                "device": "cuda",
                "cpu_offload_experts": True,
                "gpu_memory_utilization": 0.90,
                "max_num_seqs": 32,
                "max_num_batched_tokens": 4096,
                "block_size": 16,
                "enable_prefix_caching": True,
                "compile": False,
            },
        ),
        Preset(
            "embed",
            "an embedding model (--kind embed): no KV cache and no decode, so big batches of "
            "whole inputs, one forward each",
            {
                "max_num_seqs": 128,
                "max_num_batched_tokens": 16384,
            },
        ),
        # What kt-cli's `kt run` passes SGLang on every launch (its settings' defaults), for
        # SGLang with kt-kernel; startup picks it there. The kt-kernel flags themselves come
        # from the auto rules (thread pools, cpuinfer, method, GPU experts) and the registry.
        Preset(
            "kt",
            "SGLang with kt-kernel (MoE experts split GPU/CPU): the flags kt-cli's `kt run` "
            "passes on every launch",
            {
                "attention_backend": "triton",
                "max_total_tokens": 40000,
                "max_num_seqs": 32,
                "max_num_batched_tokens": 4096,
                "gpu_memory_utilization": 0.98,
                "watchdog_timeout": 3000.0,
                "enable_mixed_chunk": True,
                "enable_p2p_check": True,
            },
        ),
        Preset(
            "latency",
            "one user at a time: single sequence, compiled decode, prefix cache for chat turns",
            {
                "max_num_seqs": 1,
                "max_num_batched_tokens": 2048,
                "enable_prefix_caching": True,
                "compile": True,
            },
        ),
    )
}


def get_preset(name: str) -> Preset:
    preset = PRESETS.get(name.strip().lower())
    if preset is None:
        raise ConfigError(
            msg("preset.unknown", name=repr(name)),
            hint=msg("preset.known", presets=", ".join(
                f"{p.name} ({p.description.split(':')[0]})" for p in PRESETS.values())),
        )
    return preset


def num_experts(config: dict[str, Any]) -> int:
    """Routed experts per MoE layer across HF naming schemes (0 for a dense model)."""
    for key in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"):
        value = config.get(key)
        if isinstance(value, int) and value > 1:
            return value
    return 0


def experts_per_token(config: dict[str, Any]) -> int:
    """Routed experts each token runs (HF `num_experts_per_tok`; 2, kiln's default, if absent)."""
    value = config.get("num_experts_per_tok") or config.get("moe_topk")
    return int(value) if isinstance(value, int) and value > 0 else 2


def _moe_layer_count(config: dict[str, Any], layers: int) -> int:
    """Layers with experts: not Qwen's `mlp_only_layers`, on its `decoder_sparse_step`, past
    DeepSeek's `first_k_dense_replace` dense layers, on its `moe_layer_freq`."""
    dense = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step") or 1)
    first = int(config.get("first_k_dense_replace") or 0)
    freq = int(config.get("moe_layer_freq") or 1)
    return sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0
               and i >= first and (i - first) % freq == 0)


def _param_counts(config: dict[str, Any]) -> tuple[float, float] | None:
    """(total, active per token) parameters from an HF config: embeddings + attention + MLPs;
    an MoE layer holds every routed expert, a token runs `experts_per_token` of them plus the
    shared experts. Equal for a dense model. None without hidden_size/num_hidden_layers."""
    try:
        h = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        return None
    heads = int(config.get("num_attention_heads") or max(1, h // 128))
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or h // heads)
    vocab = int(config.get("vocab_size") or 32000)
    attn = h * head_dim * (2 * heads + 2 * kv)
    embed = vocab * h * (1 if config.get("tie_word_embeddings") else 2)
    dense_mlp = 3 * h * int(config.get("intermediate_size") or 4 * h)
    experts = num_experts(config)
    if not experts:
        total = float(embed + layers * (attn + dense_mlp))
        return total, total
    inter = int(config.get("moe_intermediate_size") or config.get("intermediate_size") or 4 * h)
    shared = int(config.get("shared_expert_intermediate_size") or 0) or (
        int(config.get("n_shared_experts") or 0) * inter)
    moe_layers = _moe_layer_count(config, layers)
    always = (embed + layers * attn + (layers - moe_layers) * dense_mlp
              + moe_layers * (3 * h * shared + h * experts))  # shared experts, routers
    expert = 3 * h * inter
    return (float(always + moe_layers * expert * experts),
            float(always + moe_layers * expert * min(experts_per_token(config), experts)))


def estimate_params(config: dict[str, Any]) -> float | None:
    """Rough total parameter count from an HF config (what must fit in memory)."""
    counts = _param_counts(config)
    return counts[0] if counts else None


def estimate_active_params(config: dict[str, Any]) -> float | None:
    """Rough parameters one token runs through (what decode speed follows): the total for a
    dense model; for an MoE, all but the experts a token is not routed to."""
    counts = _param_counts(config)
    return counts[1] if counts else None


def _bytes_per_param(model_info: dict[str, Any]) -> float:
    quant = str(model_info.get("quantization") or "").upper()
    qc = model_info.get("quantization_config")
    if isinstance(qc, dict):
        bits = qc.get("bits") or qc.get("w_bit")
        if isinstance(bits, int):
            return bits / 8 + 0.05  # plus scales/zeros
        if str(qc.get("quant_method", "")).lower() == "fp8":
            return 1.0
    if quant.startswith(("Q2", "Q3", "IQ2", "IQ3")):
        return 0.45
    if quant.startswith(("Q4", "IQ4", "INT4")):
        return 0.6
    if quant.startswith(("Q5", "Q6")):
        return 0.8
    if quant.startswith(("Q8", "INT8", "FP8")):
        return 1.05
    if str(model_info.get("torch_dtype", "")).lower() in ("float32", "fp32"):
        return 4.0
    return 2.0


def infer_preset(model_info: dict[str, Any], hw: HardwareInfo
                 ) -> tuple[str | None, str, str]:
    """Pick a preset for this model on this machine: (preset, why in words, code). The code,
    `preset.<why>`, names the branch that decided (what the decision trace, the effective config
    and tests match); `_over_ram` ends it where the CPU's weights do not fit the available RAM.

    `model_info` is the model's HF config.json dict, optionally with "quantization" (e.g. a
    GGUF quant such as "Q4_K_M"), "num_params", "active_params" (an MoE's per token) and/or
    "total_bytes" (weights on disk), which beat the estimates from the config. An MoE must fit
    by its total parameters and is classed for speed by its active ones. Returns (None, reason)
    when there is too little to go on.
    """
    total_bytes = model_info.get("total_bytes")
    params = model_info.get("num_params") or estimate_params(model_info)
    if not total_bytes and params:
        total_bytes = int(params * _bytes_per_param(model_info))
    if not total_bytes:
        return (None, "no size information (need hidden_size/num_hidden_layers or total_bytes)",
                "preset.no_size")
    if not params:
        params = total_bytes / _bytes_per_param(model_info)
    experts = num_experts(model_info)
    arch = (model_info.get("architectures") or [model_info.get("model_type", "model")])[0]
    gib = total_bytes / 1024**3
    size = f"{arch} ~{params / 1e9:.1f}B params, {gib:.1f} GiB weights"
    ram = hw.ram_available_bytes or hw.ram_total_bytes
    over_ram = bool(ram) and total_bytes >= ram
    if experts:
        # Memory needs every expert (the total); a decode step reads only the routed ones, so
        # its speed follows the active parameters, like a dense model of that size.
        active = (model_info.get("active_params") or estimate_active_params(model_info)
                  or params)
        fits = "" if hw.has_usable_cuda else (
            ", more than the available RAM!" if over_ram else ", fits in RAM")
        size = (f"{arch} ~{params / 1e9:.1f}B total ({gib:.1f} GiB weights{fits}), "
                f"~{active / 1e9:.1f}B active ({experts} experts, "
                f"{experts_per_token(model_info)} per token)")

    if not hw.has_usable_cuda:
        ram_code = "_over_ram" if over_ram else ""
        if experts:
            if active <= CPU_SMALL_MAX_PARAMS:
                return "cpu-small", (f"{size}; no usable GPU: the MoE runs on CPU and decodes "
                                     "like a small dense model (<= 2B active)"
                                     ), f"preset.moe_small_active{ram_code}"
            return "cpu-large", (f"{size}; no usable GPU: the MoE runs on CPU and decodes like "
                                 "a dense model of over 2B (active)"
                                 ), f"preset.moe_large_active{ram_code}"
        if params <= CPU_SMALL_MAX_PARAMS:
            return ("cpu-small", f"{size}; no usable GPU and the model is small (<= 2B)",
                    f"preset.small_model{ram_code}")
        fit = " (more than the available RAM!)" if over_ram else ""
        return ("cpu-large", f"{size}; no usable GPU and the model is over 2B{fit}",
                f"preset.large_model{ram_code}")

    vram = min(g.total_memory_bytes for g in hw.gpus)
    one_gpu = total_bytes <= vram * WEIGHTS_VRAM_FRACTION
    all_gpus = total_bytes <= vram * hw.gpu_count * WEIGHTS_VRAM_FRACTION
    gpus = f"{hw.gpu_count} GPU(s) of {vram / 1024**3:.0f} GiB"
    if one_gpu:
        return "gpu-single", f"{size}; fits one of {gpus}", "preset.fits_one_gpu"
    if all_gpus and hw.gpu_count > 1:
        return ("gpu-throughput", f"{size}; needs tensor parallel over {gpus}",
                "preset.needs_tensor_parallel")
    if experts:
        return ("moe-hybrid", f"{size}; too big for {gpus}, so experts are split GPU/CPU",
                "preset.experts_split")
    return None, (
        f"{size}; too big for {gpus} even sharded: use a quantized variant "
        "(owner/repo:Q4_K_M) or --device cpu"
    ), "preset.too_big"


def moe_hybrid_settings(
    entry: RegistryEntry, hw: HardwareInfo, *, tp: int = 1, quant: str | None = None
) -> dict[str, Any]:
    """The moe-hybrid preset with num_gpu_experts filled in for this machine's smallest GPU."""
    if not hw.gpus:
        raise ConfigError(msg("preset.moe_hybrid_needs_gpu"),
                          hint=msg("preset.moe_hybrid_needs_gpu.hint"))
    vram = min(g.total_memory_bytes for g in hw.gpus)
    n = gpu_experts_per_layer(entry, vram, tp, quant=quant)
    return {**PRESETS["moe-hybrid"].settings, "tensor_parallel_size": tp, "num_gpu_experts": n}
