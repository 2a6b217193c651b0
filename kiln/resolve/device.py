"""What kiln runs on the probed machine: the device a `--device` request names (failing closed
where it cannot run) and the weight and KV-cache dtypes worth using there.

The probe (kiln/resolve/hardware.py) says what the machine has; this module turns that into
kiln's choices, so the policy (bf16 needs Ampere or AVX512; FP8 needs Ada or Hopper) lives apart
from the parsers. Pure functions of a HardwareInfo, so tests pass a made-up machine.
"""

from __future__ import annotations

import re

from kiln.errors import DeviceError
from kiln.i18n import msg
from kiln.resolve.hardware import GPUInfo, HardwareInfo


def _gpus_for(device: str, hw: HardwareInfo) -> list[GPUInfo]:
    if ":" in device:
        idx = int(device.split(":", 1)[1])
        return [g for g in hw.gpus if g.index == idx]
    return hw.gpus


def _cuda_bf16(device: str, hw: HardwareInfo | None) -> bool:
    # Without a probe we cannot know; bf16 needs Ampere (8.0) or newer.
    if hw is None:
        return False
    gpus = _gpus_for(device, hw)
    return bool(gpus) and all(g.compute_capability and g.compute_capability >= (8, 0) for g in gpus)


def _cpu_bf16_reasonable(hw: HardwareInfo | None) -> bool:
    # bf16 runs everywhere in torch, but without AVX512 each op converts through fp32 and is
    # slower than plain fp32; with AVX512F oneDNN has fast bf16 paths, with AVX512-BF16/AMX native.
    if hw is None:
        return True
    return hw.cpu_fast_bf16


def supported_dtypes(device: str, hw: HardwareInfo | None = None) -> list[str]:
    """Weight/activation dtypes for `device` ("cpu", "cuda", "cuda:N"); first = recommended."""
    if device.startswith("cuda"):
        return (
            ["bfloat16", "float16", "float32"]
            if _cuda_bf16(device, hw)
            else [
                "float16",
                "float32",
            ]
        )
    if device != "cpu":
        raise DeviceError(f"unknown device {device!r}", hint="use cpu, cuda or cuda:N")
    dtypes = ["float32"]
    if _cpu_bf16_reasonable(hw):
        dtypes.append("bfloat16")
    dtypes.append("float16")
    if hw is not None and hw.cpu_native_bf16:
        # Native bf16 halves memory traffic at full speed, so it beats fp32 for decoding.
        dtypes.remove("bfloat16")
        dtypes.insert(0, "bfloat16")
    return dtypes


def supported_kv_dtypes(device: str, hw: HardwareInfo | None = None) -> list[str]:
    """Values accepted for kv_cache_dtype on `device`; "auto" follows the model dtype."""
    if device.startswith("cuda"):
        kinds = ["auto", "fp16"]
        if _cuda_bf16(device, hw):
            kinds.append("bf16")
        kinds += ["fp32", "int8"]
        gpus = _gpus_for(device, hw) if hw else []
        # FP8 tensor cores arrive with Ada/Hopper (8.9).
        if gpus and all(g.compute_capability and g.compute_capability >= (8, 9) for g in gpus):
            kinds.append("fp8")
        return kinds
    if device != "cpu":
        raise DeviceError(f"unknown device {device!r}", hint="use cpu, cuda or cuda:N")
    kinds = ["auto", "fp32"]
    if _cpu_bf16_reasonable(hw):
        kinds.append("bf16")
    return kinds + ["fp16", "int8"]


def check_device(requested: str, hw: HardwareInfo) -> str:
    """Resolve auto|cpu|cuda|cuda:N to "cpu", "cuda" or "cuda:N"; fail closed if unusable."""
    req = (requested or "auto").strip().lower()
    if req == "auto":
        return "cuda" if hw.has_usable_cuda else "cpu"
    if req == "cpu":
        return "cpu"
    m = re.fullmatch(r"cuda(?::(\d+))?", req)
    if m is None:
        raise DeviceError(msg("device.unknown", device=repr(requested)),
                          hint=msg("device.unknown.hint"))
    if not hw.has_usable_cuda:
        if hw.gpus:  # nvidia-smi sees them, torch does not
            build = (f"torch {hw.torch_version}" if hw.torch_version
                     else msg("device.torch_missing"))
            cuda = f"CUDA {hw.cuda_version}" if hw.cuda_version else msg("device.cpu_only_build")
            raise DeviceError(
                msg("device.gpus_unusable", requested=requested, count=len(hw.gpus),
                    build=build, cuda=cuda),
                hint=msg("device.cuda_fix"),
            )
        raise DeviceError(msg("device.no_cuda", requested=requested),
                          hint=msg("device.cuda_fix"))
    if m.group(1) is not None:
        idx = int(m.group(1))
        if idx >= hw.gpu_count:
            raise DeviceError(
                msg("device.bad_index", requested=requested, count=hw.gpu_count,
                    last=hw.gpu_count - 1),
                hint=msg("device.bad_index.hint"),
            )
        return f"cuda:{idx}"
    return "cuda"
