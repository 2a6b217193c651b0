"""`kiln doctor`: what this machine can run, and what to fix. One OK/WARN line per check.

Details and fixes are in the CLI's language (kiln/i18n/); --json carries them in English.
Check names and OK/WARN stay as they are: scripts grep for them."""

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

from kiln.cli import add_json_flag, add_lang_flag, add_model_dir_flag
from kiln.errors import KilnError
from kiln.i18n import english, join, msg

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
        # code: the detail's catalogue key, what a program matches (None for plain text)
        return {**asdict(self), "detail": english(self.detail),
                "fix": None if self.fix is None else english(self.fix),
                "code": getattr(self.detail, "key", None)}


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "doctor", help="check hardware, PyTorch, engines, model folders and the HF cache",
        description="Check what this machine can run. Every WARN line comes with a fix.")
    add_model_dir_flag(p)
    add_json_flag(p, "print JSON (checks + hardware)")
    p.add_argument("--strict", action="store_true", help="exit 1 when any check warns")
    add_lang_flag(p)
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
    from kiln.resolve.device import supported_dtypes
    from kiln.resolve.hardware import format_bytes

    out: list[Check] = []
    flags = " ".join(hw.cpu_flags) or msg("doctor.no_simd")
    cores = msg("doctor.cores", physical=hw.physical_cores, logical=hw.logical_cores)
    if hw.usable_cores < hw.logical_cores:
        cores = join([cores, msg("doctor.cores_usable", usable=hw.usable_cores)])
    detail = join([hw.cpu_model, ": ", cores, "; ", flags])
    no_avx2 = hw.machine in ("x86_64", "AMD64") and not hw.cpu_avx2
    out.append(_check("cpu", no_avx2, detail, msg("doctor.cpu_no_avx2", detail=detail),
                      msg("doctor.cpu_no_avx2.fix")))
    dtypes = supported_dtypes("cpu", hw)
    why = msg("doctor.native_bf16") if hw.cpu_native_bf16 else msg("doctor.no_native_bf16")
    out.append(Check("cpu dtypes", "OK", msg("doctor.dtypes", dtypes=", ".join(dtypes),
                                             best=dtypes[0], why=why)))
    out.append(_check("numa", hw.numa_nodes > 1, msg("doctor.numa_one"),
                      msg("doctor.numa_many", nodes=hw.numa_nodes), msg("doctor.numa_many.fix")))
    mem = msg("doctor.memory", total=format_bytes(hw.ram_total_bytes),
              free=format_bytes(hw.ram_available_bytes))
    if hw.cgroup_memory_limit_bytes is not None:
        mem = join([mem, msg("doctor.memory_limit",
                             limit=format_bytes(hw.cgroup_memory_limit_bytes))])
    out.append(_check("memory", hw.ram_available_bytes < MIN_FREE_RAM, mem,
                      msg("doctor.memory_low", detail=mem), msg("doctor.memory_low.fix")))
    return out


def _torch_checks(hw: Any) -> list[Check]:
    from kiln.resolve.device import supported_dtypes
    from kiln.resolve.hardware import format_bytes

    out: list[Check] = []
    build = (msg("doctor.torch_build_cuda", version=hw.cuda_version) if hw.cuda_version
             else msg("doctor.torch_build_cpu"))
    out.append(_check("pytorch", hw.torch_version is None,
                      msg("doctor.torch", version=hw.torch_version, build=build),
                      msg("doctor.torch_missing"), msg("doctor.torch_missing.fix")))
    if hw.has_usable_cuda:
        for g in hw.gpus:
            free = (msg("doctor.gpu_free", free=format_bytes(g.free_memory_bytes))
                    if g.free_memory_bytes else "")
            dt = ", ".join(supported_dtypes(f"cuda:{g.index}", hw))
            out.append(Check(f"gpu cuda:{g.index}", "OK",
                             msg("doctor.gpu", name=g.name, cc=g.compute_capability_str,
                                 total=format_bytes(g.total_memory_bytes), free=free,
                                 dtypes=dt)))
    elif hw.gpus:  # nvidia-smi sees GPUs that this torch cannot use
        names = ", ".join(sorted({g.name for g in hw.gpus}))
        why = (msg("doctor.torch_build_cpu") if not hw.cuda_version
               else msg("doctor.cuda_unavailable"))
        fix = (msg("doctor.cuda_torch.fix") if not hw.cuda_version
               else msg("doctor.cuda_driver.fix", version=hw.cuda_version))
        out.append(Check("gpu", "WARN", msg("doctor.gpu_unusable", count=len(hw.gpus),
                                            names=names, why=why), fix))
    else:
        out.append(Check("gpu", "OK", msg("doctor.no_gpu")))
    return out


def _engine_checks(hw: Any) -> list[Check]:
    out: list[Check] = []
    for name in OPTIONAL_ENGINES:
        found: list[str] = []
        if importlib.util.find_spec(name) is not None:
            try:
                found.append(msg("doctor.engine_package",
                                 version=importlib.metadata.version(name)))
            except importlib.metadata.PackageNotFoundError:
                found.append(msg("doctor.engine_package_plain"))
        exe = shutil.which(name)
        if exe:
            found.append(msg("doctor.engine_on_path", path=exe))
        if not found:
            out.append(Check(f"engine {name}", "OK", msg("doctor.engine_absent", name=name)))
        elif not hw.has_usable_cuda:
            out.append(Check(f"engine {name}", "WARN",
                             msg("doctor.engine_no_gpu", found=join(found, "; ")),
                             msg("doctor.engine_no_gpu.fix", name=name)))
        else:
            out.append(Check(f"engine {name}", "OK", join(found, "; ")))
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
            out.append(Check(label, "OK", msg("doctor.model_dir", path=path, count=n,
                                              origin=origin)))
        elif origin == "default":
            out.append(Check(label, "OK", msg("doctor.model_dir_default_absent", path=path)))
        else:
            src = "--model-dir" if origin == "flag" else "KILN_MODEL_DIRS"
            out.append(Check(label, "WARN", msg("doctor.model_dir_missing", path=path, source=src),
                             msg("doctor.model_dir_missing.fix", path=path, source=src)))
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
        detail = msg("doctor.hf_cache", path=cache, count=len(models))
    else:
        detail = msg("doctor.hf_cache_empty", path=cache)
    if offline_mode():
        detail = join([detail, msg("doctor.hf_offline")])
    out.append(_check("hf cache", not os.access(base, os.W_OK), detail,
                      msg("doctor.hf_cache_readonly", detail=detail),
                      msg("doctor.hf_cache_readonly.fix")))
    try:
        free = shutil.disk_usage(base).free
    except OSError:
        free = None
    if free is not None:
        where = msg("doctor.disk", free=format_bytes(free), path=base)
        out.append(_check("disk", free < MIN_FREE_DISK, where, where, msg("doctor.disk.fix")))
    return out


def _default_model_check() -> Check:
    from kiln.resolve.hardware import format_bytes
    from kiln.resolve.local import DEFAULT_MODEL_INSTALL, default_model_path

    try:
        path = default_model_path()
    except KilnError:
        return Check("default model", "WARN", msg("doctor.default_model_missing"),
                     DEFAULT_MODEL_INSTALL)
    return Check("default model", "OK", f"{path} ({format_bytes(path.stat().st_size)})")


def format_checks(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines: list[str] = []
    for c in checks:
        lines.append(f"{c.status:<4}  {c.name:<{width}}  {c.detail}")
        if c.fix:
            lines.append(f"{'':<4}  {'':<{width}}  {msg('doctor.fix', fix=c.fix)}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    try:
        checks, facts = run_checks(getattr(args, "model_dir", None))
    except KilnError as e:
        print(msg("doctor.error", error=e), file=sys.stderr)
        return e.exit_code
    warns = sum(c.status == "WARN" for c in checks)
    if getattr(args, "json", False):
        print(json.dumps({"checks": [c.to_dict() for c in checks], **facts}, indent=2))
    else:
        print(format_checks(checks))
        print(msg("doctor.summary", ok=len(checks) - warns, warn=warns))
    return 1 if warns and getattr(args, "strict", False) else 0
