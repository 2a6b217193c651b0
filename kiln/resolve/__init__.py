"""What to run: the model source (alias, HF id, folder, .gguf), the hardware, the preset."""

from __future__ import annotations

from kiln.resolve.device import check_device, supported_dtypes, supported_kv_dtypes
from kiln.resolve.hardware import GPUInfo, HardwareInfo, probe_hardware
from kiln.resolve.hf_cache import hf_cache_dir
from kiln.resolve.presets import PRESETS, Preset, get_preset, infer_preset, moe_hybrid_settings
from kiln.resolve.registry import (
    GpuExpertsRule,
    RegistryEntry,
    gpu_experts_per_layer,
    infer_entry,
    load_registry,
    lookup,
)
from kiln.resolve.sources import (
    LocalModel,
    ModelSource,
    configured_model_dirs,
    default_model_path,
    list_local_models,
    resolve_model,
)

__all__ = [
    "PRESETS",
    "GPUInfo",
    "GpuExpertsRule",
    "HardwareInfo",
    "LocalModel",
    "ModelSource",
    "Preset",
    "RegistryEntry",
    "check_device",
    "configured_model_dirs",
    "default_model_path",
    "get_preset",
    "gpu_experts_per_layer",
    "hf_cache_dir",
    "infer_entry",
    "infer_preset",
    "list_local_models",
    "load_registry",
    "lookup",
    "moe_hybrid_settings",
    "probe_hardware",
    "resolve_model",
    "supported_dtypes",
    "supported_kv_dtypes",
]
