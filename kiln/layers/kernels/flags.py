"""What a set of /proc/cpuinfo flags means: pure functions of the flag names, no probe. Here,
below both, so that the hardware probe (kiln/resolve/hardware.py: HardwareInfo.native_bf16),
`kiln doctor` and the kt-kernel hand-off read a probe of any machine the same way, and the ISA
probe (isa.py) builds its levels on the same sets, without an import circle between them.
"""

from __future__ import annotations

from collections.abc import Iterable

AMX_FLAGS = frozenset({"amx_tile", "amx_int8", "amx_bf16"})
# the lowest kernel level's instructions (isa.LEVELS' avx2)
AVX2_FLAGS = frozenset({"avx2", "fma", "f16c"})


def flags_native_bf16(flags: Iterable[str]) -> bool:
    """bf16 matmuls in hardware: AVX512-BF16, AMX-BF16 or ARMv8.6 BF16."""
    return bool({"avx512_bf16", "amx_bf16", "bf16"} & set(flags))


def flags_fast_bf16(flags: Iterable[str]) -> bool:
    """bf16 worth computing in: native, or AVX512F (oneDNN's fast conversions); without either
    every op converts through fp32 and is slower than fp32."""
    return flags_native_bf16(flags) or "avx512f" in set(flags)


def flags_amx(flags: Iterable[str]) -> bool:
    """The CPU says it has AMX tiles (whether the OS grants them: `amx_granted`)."""
    return bool(AMX_FLAGS & set(flags))


def flags_avx2(flags: Iterable[str]) -> bool:
    """The CPU has the lowest level's instructions (AVX2 + FMA + F16C)."""
    return AVX2_FLAGS <= set(flags)
