"""Hardware probe: CPU, memory, NUMA, GPUs, and the PyTorch build.

Every parser here is a pure function of text (or of a root folder holding a fake /proc and /sys),
so tests feed it sample files instead of mocking the machine. `probe_hardware()` glues them to
the real files once per process and caches the result. What kiln makes of the result (which
device a request names, which dtypes are worth using there) is kiln/resolve/device.py.
"""

from __future__ import annotations

import functools
import math
import os
import platform
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Flags that change which kernels or dtypes are worth using. x86 names come from /proc/cpuinfo
# "flags"; the ARM ones ("asimd", "sve", "bf16") from its "Features" line.
FLAGS_OF_INTEREST: tuple[str, ...] = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
    "bf16",
)

# cgroup v1 writes "no limit" as a page-rounded LONG_MAX; anything above this is unlimited.
_CGROUP_UNLIMITED = 1 << 60

_GIB = 1024**3
_MIB = 1024**2


def _flags() -> Any:
    """What the CPU flags mean (kiln/layers/kernels/flags.py), imported when asked: importing it
    runs kiln.layers.kernels' package, whose ISA probe imports this module."""
    from kiln.layers.kernels import flags

    return flags


@dataclass
class GPUInfo:
    index: int
    name: str
    compute_capability: tuple[int, int] | None
    total_memory_bytes: int
    free_memory_bytes: int | None = None

    @property
    def compute_capability_str(self) -> str:
        cc = self.compute_capability
        return f"{cc[0]}.{cc[1]}" if cc else "unknown"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["compute_capability"] = self.compute_capability_str if self.compute_capability else None
        return d


@dataclass
class CpuInfo:
    """What /proc/cpuinfo says; `physical_cores` is None when it has no topology fields."""

    model: str
    logical_cores: int
    physical_cores: int | None
    sockets: int | None
    flags: list[str] = field(default_factory=list)  # the FLAGS_OF_INTEREST it has
    all_flags: frozenset[str] = frozenset()  # every flag, for keys that must see them all


@dataclass
class HardwareInfo:
    cpu_model: str
    physical_cores: int
    logical_cores: int
    usable_cores: int
    cpu_flags: list[str]
    numa_nodes: int
    ram_total_bytes: int
    ram_available_bytes: int
    cgroup_memory_limit_bytes: int | None
    gpus: list[GPUInfo]
    # Where the GPU list came from: "torch" (usable by kiln), "nvidia-smi" (present, but this
    # torch cannot drive it), or None.
    gpu_source: str | None
    torch_version: str | None
    cuda_version: str | None
    torch_cuda_available: bool
    machine: str = field(default_factory=platform.machine)

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    @property
    def has_usable_cuda(self) -> bool:
        return self.torch_cuda_available and bool(self.gpus)

    @property
    def cpu_native_bf16(self) -> bool:
        """bf16 matmuls run in hardware (AVX512-BF16, AMX, or ARMv8.6 BF16), not by conversion."""
        return _flags().flags_native_bf16(self.cpu_flags)

    @property
    def cpu_fast_bf16(self) -> bool:
        """bf16 is worth using on this CPU: AVX512F's fast oneDNN paths or native bf16 (without
        them each bf16 op converts through fp32 and is slower than fp32)."""
        return _flags().flags_fast_bf16(self.cpu_flags)

    @property
    def cpu_amx(self) -> bool:
        """The CPU says it has AMX tiles (kt-kernel's AMX methods; whether the OS grants them
        is kiln.layers.kernels.isa.amx_granted's question, asked of this machine only)."""
        return _flags().flags_amx(self.cpu_flags)

    @property
    def cpu_avx2(self) -> bool:
        """The CPU has the instructions of kiln's lowest kernel level (AVX2 + FMA + F16C)."""
        return _flags().flags_avx2(self.cpu_flags)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["gpus"] = [g.to_dict() for g in self.gpus]
        d["gpu_count"] = self.gpu_count
        d["cpu_native_bf16"] = self.cpu_native_bf16
        return d


# ---------------------------------------------------------------------------------------------
# Pure parsers


def parse_cpuinfo(text: str) -> CpuInfo:
    """Parse /proc/cpuinfo. Physical cores = unique (physical id, core id) pairs."""
    model = ""
    flags: set[str] = set()
    logical = 0
    pairs: set[tuple[str, str]] = set()
    sockets: set[str] = set()
    # One block per logical CPU, separated by blank lines.
    for block in re.split(r"\n\s*\n", text.strip()):
        kv: dict[str, str] = {}
        for line in block.splitlines():
            if ":" not in line:
                continue
            key, _, value = line.partition(":")
            kv[key.strip().lower()] = value.strip()
        if "processor" not in kv:
            # ARM puts "Hardware"/"Model" in a trailing block without "processor".
            model = model or kv.get("model name") or kv.get("hardware") or ""
            continue
        logical += 1
        model = model or kv.get("model name") or kv.get("cpu model") or ""
        for key in ("flags", "features"):
            if key in kv:
                flags.update(kv[key].split())
        if "physical id" in kv and "core id" in kv:
            pairs.add((kv["physical id"], kv["core id"]))
            sockets.add(kv["physical id"])
    return CpuInfo(
        model=model,
        logical_cores=logical,
        physical_cores=len(pairs) or None,
        sockets=len(sockets) or None,
        flags=sorted(f for f in flags if f in FLAGS_OF_INTEREST),
        all_flags=frozenset(flags),
    )


def parse_meminfo(text: str) -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes from /proc/meminfo (values there are in kB)."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"^(\w+):\s+(\d+)\s*(kB)?", line)
        if m:
            values[m.group(1)] = int(m.group(2)) * (1024 if m.group(3) else 1)
    total = values.get("MemTotal", 0)
    # Kernels before 3.14 lack MemAvailable; free + page cache is the usual estimate.
    available = values.get("MemAvailable", values.get("MemFree", 0) + values.get("Cached", 0))
    return total, available


def parse_status_bytes(text: str, key: str) -> int | None:
    """One "Key:  N kB" line of /proc/<pid>/status (VmRSS, VmHWM, ...) in bytes."""
    for line in text.splitlines():
        if line.startswith(key + ":"):
            fields = line.split()
            return int(fields[1]) * 1024 if len(fields) > 1 and fields[1].isdigit() else None
    return None


def parse_cgroup_memory_limit(text: str) -> int | None:
    """cgroup v2 memory.max ("max" or bytes) or v1 memory.limit_in_bytes; None = no limit."""
    value = text.strip()
    if not value or value == "max":
        return None
    try:
        limit = int(value)
    except ValueError:
        return None
    return None if limit >= _CGROUP_UNLIMITED else limit


def parse_cgroup_cpu_max(text: str) -> int | None:
    """cgroup v2 cpu.max ("max 100000" or "200000 100000") -> whole CPUs allowed, or None."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return max(1, math.ceil(quota / period))


def parse_nvidia_smi(text: str) -> list[GPUInfo]:
    """Parse `nvidia-smi --query-gpu=name,compute_cap,memory.total,memory.free
    --format=csv,noheader,nounits` (memory in MiB)."""
    gpus: list[GPUInfo] = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        # The name may itself contain commas only in theory; the last three fields never do.
        parts = [p.strip() for p in line.rsplit(",", 3)]
        if len(parts) != 4:
            continue
        name, cc_text, total_text, free_text = parts
        gpus.append(
            GPUInfo(
                index=len(gpus),
                name=name,
                compute_capability=_parse_cc(cc_text),
                total_memory_bytes=_mib(total_text) or 0,
                free_memory_bytes=_mib(free_text),
            )
        )
    return gpus


def _parse_cc(text: str) -> tuple[int, int] | None:
    m = re.match(r"^(\d+)\.(\d+)$", text.strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


def _mib(text: str) -> int | None:
    try:
        return int(float(text) * _MIB)
    except ValueError:  # "[N/A]" on some boards
        return None


def count_physical_cores_sysfs(sys_root: Path) -> int | None:
    """Unique (package, core) pairs from sys_root/devices/system/cpu/cpu*/topology."""
    pairs: set[tuple[str, str]] = set()
    for topo in (sys_root / "devices/system/cpu").glob("cpu[0-9]*/topology"):
        pkg = _read(topo / "physical_package_id")
        core = _read(topo / "core_id")
        if pkg is not None and core is not None:
            pairs.add((pkg.strip(), core.strip()))
    return len(pairs) or None


def count_numa_nodes(sys_root: Path) -> int:
    nodes = [p for p in (sys_root / "devices/system/node").glob("node[0-9]*") if p.is_dir()]
    return max(1, len(nodes))


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------
# The probe


def probe_hardware(refresh: bool = False) -> HardwareInfo:
    """Probe this machine once per process (GPU queries can take a second)."""
    if refresh:
        _probe_cached.cache_clear()
    return _probe_cached()


@functools.lru_cache(maxsize=1)
def _probe_cached() -> HardwareInfo:
    return probe_hardware_at(Path("/"), query_gpus=True)


def probe_hardware_at(root: Path, *, query_gpus: bool = True) -> HardwareInfo:
    """Probe with /proc and /sys read under `root` (tests pass a fake tree, the probe "/")."""
    proc, sys_ = root / "proc", root / "sys"
    cpu = parse_cpuinfo(_read(proc / "cpuinfo") or "")
    logical = cpu.logical_cores or os.cpu_count() or 1
    physical = cpu.physical_cores or count_physical_cores_sysfs(sys_) or logical

    usable = _affinity_count() if root == Path("/") else logical
    quota = parse_cgroup_cpu_max(_read(sys_ / "fs/cgroup/cpu.max") or "")
    if quota is not None:
        usable = min(usable, quota)

    total, available, limit = _memory(proc, sys_)

    torch_version, cuda_version, gpus, cuda_ok = _torch_gpus() if query_gpus else _NO_GPU
    gpu_source: str | None = "torch" if gpus else None
    if not gpus and query_gpus:
        gpus = _nvidia_smi_gpus()
        gpu_source = "nvidia-smi" if gpus else None

    return HardwareInfo(
        cpu_model=cpu.model or platform.processor() or platform.machine(),
        physical_cores=physical,
        logical_cores=logical,
        usable_cores=max(1, usable),
        cpu_flags=cpu.flags,
        numa_nodes=count_numa_nodes(sys_),
        ram_total_bytes=total,
        ram_available_bytes=available,
        cgroup_memory_limit_bytes=limit,
        gpus=list(gpus),
        gpu_source=gpu_source,
        torch_version=torch_version,
        cuda_version=cuda_version,
        torch_cuda_available=cuda_ok,
    )


def _memory(proc: Path, sys_: Path) -> tuple[int, int, int | None]:
    """(total, available, cgroup limit) in bytes; 0, 0 where /proc/meminfo cannot be read."""
    total, available = parse_meminfo(_read(proc / "meminfo") or "")
    limit = _cgroup_memory_limit(sys_)
    if limit is not None and limit < total:
        # Inside a container the host's MemTotal lies; the cgroup limit is what OOM-kills us.
        used = _cgroup_memory_used(sys_) or 0
        total = limit
        available = min(available, max(0, limit - used))
    return total, available, limit


def _affinity_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS has no sched_getaffinity
        return os.cpu_count() or 1


def _cgroup_memory_limit(sys_root: Path) -> int | None:
    for rel in ("fs/cgroup/memory.max", "fs/cgroup/memory/memory.limit_in_bytes"):
        text = _read(sys_root / rel)
        if text is not None:
            return parse_cgroup_memory_limit(text)
    return None


def _cgroup_memory_used(sys_root: Path) -> int | None:
    for rel in ("fs/cgroup/memory.current", "fs/cgroup/memory/memory.usage_in_bytes"):
        text = _read(sys_root / rel)
        if text is not None and text.strip().isdigit():
            return int(text.strip())
    return None


_NO_GPU: tuple[None, None, list[GPUInfo], bool] = (None, None, [], False)


def _torch_gpus() -> tuple[str | None, str | None, list[GPUInfo], bool]:
    """(torch version, CUDA runtime version, GPUs torch can use, cuda available)."""
    try:
        import torch
    except ImportError:
        return None, None, [], False
    version = str(torch.__version__)
    cuda = torch.version.cuda
    try:
        available = bool(torch.cuda.is_available())
    except RuntimeError:  # a broken driver raises here rather than returning False
        available = False
    gpus: list[GPUInfo] = []
    if available:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            free: int | None
            try:
                free, _ = torch.cuda.mem_get_info(i)
            except (RuntimeError, AssertionError):
                free = None
            gpus.append(
                GPUInfo(
                    index=i,
                    name=props.name,
                    compute_capability=(props.major, props.minor),
                    total_memory_bytes=int(props.total_memory),
                    free_memory_bytes=free,
                )
            )
    return version, cuda, gpus, available


def _nvidia_smi_gpus() -> list[GPUInfo]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    query = "--query-gpu=name,compute_cap,memory.total,memory.free"
    try:
        out = subprocess.run(
            [exe, query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse_nvidia_smi(out.stdout) if out.returncode == 0 else []


# ---------------------------------------------------------------------------------------------
# Live readers: what other modules ask of /proc while kiln runs (one copy of each, here)


def ram_available_bytes(root: Path = Path("/")) -> int | None:
    """RAM this process can still take, read now (not cached: planning runs after the weights
    took their share): MemAvailable, capped by the cgroup's limit minus its usage, since the
    host's figure ignores the container's limit. None where /proc/meminfo cannot be read."""
    total, available, _ = _memory(root / "proc", root / "sys")
    return available if total else None


def cpu_flags(root: Path = Path("/")) -> frozenset[str]:
    """Every feature flag of this CPU (x86 "flags", ARM "Features"); empty where /proc/cpuinfo
    cannot be read."""
    return _cpuinfo(root).all_flags


def cpu_signature(root: Path = Path("/")) -> str:
    """"model|flag flag ...": what -march=native compiles for, so a build cache keyed by it is
    never reused on another CPU. platform's names where /proc/cpuinfo cannot be read."""
    cpu = _cpuinfo(root)
    if not cpu.logical_cores and not cpu.all_flags:
        return platform.processor() or platform.machine()
    return f"{cpu.model}|{' '.join(sorted(cpu.all_flags))}"


@functools.lru_cache(maxsize=4)
def _cpuinfo(root: Path) -> CpuInfo:
    # The CPU does not change while kiln runs; /proc/cpuinfo of a big machine is ~1 MB of text.
    return parse_cpuinfo(_read(root / "proc" / "cpuinfo") or "")


def rss_bytes(pid: int | str = "self") -> int:
    """Resident memory of a process now (VmRSS); 0 where its status cannot be read."""
    return _status_bytes(pid, "VmRSS")


def rss_peak_bytes(pid: int | str = "self") -> int:
    """Peak resident memory of a process (VmHWM) since it started or since reset_rss_peak();
    0 where its status cannot be read."""
    return _status_bytes(pid, "VmHWM")


def reset_rss_peak() -> int:
    """Resets this process's peak-RSS mark (Linux clear_refs "5", so the next rss_peak_bytes()
    measures one phase alone) and returns the current RSS; 0 where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return 0
    return rss_bytes()


def _status_bytes(pid: int | str, key: str) -> int:
    return parse_status_bytes(_read(Path("/proc") / str(pid) / "status") or "", key) or 0


def format_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    if n >= _GIB:
        return f"{n / _GIB:.1f} GiB"
    if n >= _MIB:
        return f"{n / _MIB:.0f} MiB"
    return f"{n / 1024:.0f} KiB"
