"""Hardware probe: pure parsers on sample text, a fake /proc + /sys tree, fail-closed devices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.errors import DeviceError
from kiln.resolve.device import check_device, supported_dtypes, supported_kv_dtypes
from kiln.resolve.hardware import (
    GPUInfo,
    HardwareInfo,
    count_numa_nodes,
    count_physical_cores_sysfs,
    cpu_flags,
    cpu_signature,
    parse_cgroup_cpu_max,
    parse_cgroup_memory_limit,
    parse_cpuinfo,
    parse_meminfo,
    parse_nvidia_smi,
    parse_status_bytes,
    probe_hardware,
    probe_hardware_at,
    ram_available_bytes,
    rss_bytes,
    rss_peak_bytes,
)

XEON_FLAGS = "fpu sse2 avx avx2 fma avx512f avx512_bf16 amx_tile amx_bf16 amx_int8 ht"


def two_socket_cpuinfo() -> str:
    """2 sockets x 2 cores x 2 hyperthreads = 8 logical CPUs, 4 physical cores."""
    blocks = []
    cpu = 0
    for socket in (0, 1):
        for thread in (0, 1):
            for core in (0, 1):
                blocks.append(
                    f"processor\t: {cpu}\nvendor_id\t: GenuineIntel\n"
                    f"model name\t: Intel(R) Xeon(R) Platinum 8480+\n"
                    f"physical id\t: {socket}\nsiblings\t: 4\ncore id\t\t: {core}\n"
                    f"cpu cores\t: 2\nflags\t\t: {XEON_FLAGS}\n"
                )
                cpu += 1
    del thread
    return "\n".join(blocks)


ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp bf16 sve
CPU implementer\t: 0x41

processor\t: 1
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp bf16 sve
CPU implementer\t: 0x41
"""

MEMINFO = """MemTotal:       65536000 kB
MemFree:         1000000 kB
MemAvailable:   32768000 kB
Cached:          2000000 kB
"""

NVIDIA_SMI = """NVIDIA H100 80GB HBM3, 9.0, 81559, 80000
Tesla T4, 7.5, 15360, [N/A]
"""


def test_parse_cpuinfo_two_sockets_counts_unique_core_pairs() -> None:
    info = parse_cpuinfo(two_socket_cpuinfo())
    assert info.logical_cores == 8
    assert info.physical_cores == 4 and info.sockets == 2
    assert info.model == "Intel(R) Xeon(R) Platinum 8480+"
    assert info.flags == sorted(
        ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"]
    )  # "fpu", "sse2", "ht" are not of interest


def test_parse_cpuinfo_arm_has_no_topology_but_features() -> None:
    info = parse_cpuinfo(ARM_CPUINFO)
    assert info.logical_cores == 2 and info.physical_cores is None
    assert {"asimd", "bf16", "sve"} <= set(info.flags)


def test_parse_meminfo_and_cgroup_files() -> None:
    assert parse_meminfo(MEMINFO) == (65536000 * 1024, 32768000 * 1024)
    # Old kernels without MemAvailable: free + cached.
    assert parse_meminfo("MemTotal: 100 kB\nMemFree: 10 kB\nCached: 5 kB\n") == (102400, 15360)
    assert parse_cgroup_memory_limit("max\n") is None
    assert parse_cgroup_memory_limit("8589934592\n") == 8 * 1024**3
    assert parse_cgroup_memory_limit("9223372036854771712") is None  # cgroup v1 "unlimited"
    assert parse_cgroup_cpu_max("max 100000") is None
    assert parse_cgroup_cpu_max("150000 100000") == 2


def test_parse_nvidia_smi_csv() -> None:
    gpus = parse_nvidia_smi(NVIDIA_SMI)
    assert [g.name for g in gpus] == ["NVIDIA H100 80GB HBM3", "Tesla T4"]
    assert gpus[0].compute_capability == (9, 0) and gpus[1].compute_capability == (7, 5)
    assert gpus[0].total_memory_bytes == 81559 * 1024**2
    assert gpus[0].free_memory_bytes == 80000 * 1024**2 and gpus[1].free_memory_bytes is None
    assert [g.index for g in gpus] == [0, 1]
    assert gpus[0].to_dict()["compute_capability"] == "9.0"


def fake_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "proc").mkdir(parents=True)
    (root / "proc/cpuinfo").write_text(ARM_CPUINFO)
    (root / "proc/meminfo").write_text(MEMINFO)
    for cpu, (pkg, core) in enumerate([(0, 0), (0, 1)]):
        topo = root / f"sys/devices/system/cpu/cpu{cpu}/topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{pkg}\n")
        (topo / "core_id").write_text(f"{core}\n")
    for node in (0, 1):
        (root / f"sys/devices/system/node/node{node}").mkdir(parents=True)
    cg = root / "sys/fs/cgroup"
    cg.mkdir(parents=True)
    (cg / "memory.max").write_text(str(16 * 1024**3))
    (cg / "memory.current").write_text(str(4 * 1024**3))
    (cg / "cpu.max").write_text("100000 100000")
    return root


def test_live_readers_on_a_fake_tree(tmp_path: Path) -> None:
    root = fake_root(tmp_path)
    # The same cgroup-aware figure the probe reports: limit 16 GiB minus 4 GiB in use.
    assert ram_available_bytes(root) == 12 * 1024**3
    (root / "sys/fs/cgroup/memory.max").write_text("max")
    assert ram_available_bytes(root) == 32768000 * 1024  # no limit: MemAvailable
    assert ram_available_bytes(tmp_path / "nothing") is None
    assert {"asimd", "bf16", "fp"} <= cpu_flags(root)  # every flag, not only those of interest
    assert cpu_signature(root).endswith("|" + " ".join(sorted(cpu_flags(root))))


def test_rss_readers() -> None:
    status = "Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n"
    assert parse_status_bytes(status, "VmRSS") == 1024 * 1024
    assert parse_status_bytes(status, "VmHWM") == 2048 * 1024
    assert parse_status_bytes(status, "VmSwap") is None
    if Path("/proc/self/status").exists():
        assert 0 < rss_bytes() <= rss_peak_bytes()
    assert rss_bytes(2**31 - 1) == 0  # no such process


def test_probe_on_a_fake_tree_respects_the_cgroup(tmp_path: Path) -> None:
    root = fake_root(tmp_path)
    assert count_physical_cores_sysfs(root / "sys") == 2
    assert count_numa_nodes(root / "sys") == 2
    hw = probe_hardware_at(root, query_gpus=False)
    assert hw.logical_cores == 2 and hw.physical_cores == 2  # from sysfs, cpuinfo has none
    assert hw.usable_cores == 1  # cpu.max quota of one CPU
    assert hw.numa_nodes == 2
    # The container limit (16 GiB) is below MemTotal (62.5 GiB): it wins, minus what is used.
    assert hw.ram_total_bytes == 16 * 1024**3
    assert hw.ram_available_bytes == 12 * 1024**3
    assert hw.cpu_native_bf16  # ARM bf16
    assert hw.gpus == [] and not hw.has_usable_cuda


def test_probe_this_machine_is_cached_and_serializable() -> None:
    hw = probe_hardware()
    assert hw is probe_hardware()
    assert hw.logical_cores >= hw.usable_cores >= 1 and hw.physical_cores >= 1
    assert hw.ram_total_bytes >= hw.ram_available_bytes > 0
    assert hw.torch_version is not None  # torch is in the venv
    d = json.loads(json.dumps(hw.to_dict()))
    assert d["gpu_count"] == len(hw.gpus)


def make_hw(
    gpus: list[GPUInfo], *, torch_cuda: bool, flags: list[str] | None = None
) -> HardwareInfo:
    return HardwareInfo(
        cpu_model="test",
        physical_cores=4,
        logical_cores=8,
        usable_cores=8,
        cpu_flags=flags if flags is not None else ["avx2"],
        numa_nodes=1,
        ram_total_bytes=64 * 1024**3,
        ram_available_bytes=32 * 1024**3,
        cgroup_memory_limit_bytes=None,
        gpus=gpus,
        gpu_source=("torch" if torch_cuda else "nvidia-smi") if gpus else None,
        torch_version="2.13.0" + ("" if torch_cuda else "+cpu"),
        cuda_version="12.8" if torch_cuda else None,
        torch_cuda_available=torch_cuda,
    )


def test_check_device_fails_closed_on_this_machine() -> None:
    hw = probe_hardware()
    if hw.has_usable_cuda:
        pytest.skip("this machine has a usable GPU")
    assert check_device("auto", hw) == "cpu"
    assert check_device("CPU", hw) == "cpu"
    for req in ("cuda", "cuda:0"):
        with pytest.raises(DeviceError) as err:
            check_device(req, hw)
        assert err.value.code == "device.no_cuda" and "--device cpu" in str(err.value)
    with pytest.raises(DeviceError) as err:
        check_device("tpu", hw)
    assert err.value.code == "device.unknown"


def test_check_device_gpu_seen_by_nvidia_smi_but_cpu_torch() -> None:
    hw = make_hw(parse_nvidia_smi(NVIDIA_SMI), torch_cuda=False)
    assert check_device("auto", hw) == "cpu"  # auto never picks a device torch cannot drive
    with pytest.raises(DeviceError) as err:
        check_device("cuda", hw)
    assert err.value.code == "device.gpus_unusable"
    assert err.value.message.fields["cuda"].key == "device.cpu_only_build"


def test_check_device_with_usable_gpus() -> None:
    hw = make_hw(parse_nvidia_smi(NVIDIA_SMI), torch_cuda=True)
    assert check_device("auto", hw) == "cuda"
    assert check_device("cuda:1", hw) == "cuda:1"
    with pytest.raises(DeviceError) as err:
        check_device("cuda:2", hw)
    assert err.value.code == "device.bad_index" and "cuda:0..cuda:1" in str(err.value)


def test_supported_dtypes_follow_the_hardware() -> None:
    avx2 = make_hw([], torch_cuda=False, flags=["avx2"])
    amx = make_hw([], torch_cuda=False, flags=["avx2", "avx512f", "amx_bf16"])
    assert supported_dtypes("cpu", avx2) == ["float32", "float16"]  # bf16 would be emulated
    assert supported_dtypes("cpu", amx) == ["bfloat16", "float32", "float16"]
    assert supported_kv_dtypes("cpu", amx) == ["auto", "fp32", "bf16", "fp16", "int8"]
    assert "bf16" not in supported_kv_dtypes("cpu", avx2)
    gpus = make_hw(parse_nvidia_smi(NVIDIA_SMI), torch_cuda=True)
    assert supported_dtypes("cuda:0", gpus) == ["bfloat16", "float16", "float32"]  # H100
    assert supported_dtypes("cuda:1", gpus) == ["float16", "float32"]  # T4: no bf16
    assert supported_dtypes("cuda", gpus) == ["float16", "float32"]  # all GPUs must agree
    assert "fp8" in supported_kv_dtypes("cuda:0", gpus)
    assert "fp8" not in supported_kv_dtypes("cuda:1", gpus)
