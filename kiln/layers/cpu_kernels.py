"""kiln's own CPU kernels (cpu_kernels.cpp), compiled on first use for this machine's CPU.

Attention over the paged KV pool (`decode_attention` for one token per sequence,
`prefill_attention` and `shared_attention`, a flash loop, for prefill chunks and a cascade's
shared prefix), weight-only int4/int8 linears (`w4_linear`, `w8_linear`, and `w4a8_linear`
for prefill, with int8 activations; kiln.layers.quant's modules call them), and
`decode_layer`, a whole Llama decoder layer of a decode step made of those, in one call: it
replaces the compiled per-layer graph, whose calls and per-op parallel regions cost ~2.4 ms of
an ~11 ms single-row step. Why the linears: PyTorch's
int4/int8 CPU kernels read weights at ~14 GB/s for one row and redo all of their work for each
further row (16 rows: ~44 ms for SmolLM2's 30 layers); kiln's read the packed weight once per
step and reuse each tile across up to 4 rows held in registers (16 rows: ~13 ms, fewer than
oneDNN's bf16 GEMM on a dense copy, ~20-24 ms, which reads 3x the bytes).

Why a C++ attention kernel: decode attention reads each sequence's KV rows scattered over the
paged pool. Neither PyTorch's ops nor inductor's generated loops do that well on CPU: eager needs a gathered
copy of the context, and inductor's fused loop recomputes the query's RoPE for every key and
reduces each dot product serially (16 rows x 256 positions: ~600 us per layer, vs ~185 us for
the kernel; 1 x 128: 160 vs 17 us). It is one small source file, built with
torch.utils.cpp_extension (~15 s, g++ and ninja) into ~/.cache/kiln/ext, keyed by the source,
torch, the compiler flags and this CPU, so later starts only load it. `make install` builds it
ahead (`python -m kiln.layers.cpu_kernels`).

Where it cannot be used (no compiler, no AVX512-BF16, another platform, --no-cpu-kernels),
`decode_attention_ok` says False and attention keeps its PyTorch paths; the build's failure is
logged once.

cpu_kernels_avx2.cpp (x86 with AVX2 + FMA + F16C, no AVX512-BF16) and kquant_avx2.cpp (GGUF's
blocks as they are) are built by the same `_build`; their Python faces are
kiln/layers/cpu_kernels_avx2.py and kiln/layers/kquant.py.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kiln.paths import cache_dir
from kiln.resolve.hardware import cpu_signature

log = logging.getLogger("kiln.cpu_kernels")

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
AVX2_SOURCE = Path(__file__).with_name("cpu_kernels_avx2.cpp")
KQUANT_SOURCE = Path(__file__).with_name("kquant_avx2.cpp")  # GGUF blocks as they are (kquant.py)
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]
HEAD_DIMS = (64, 96, 128, 256)
MAX_GROUP = 16  # query heads per KV head (the kernel's register budget)


def build_dir(source: Path = SOURCE) -> Path:
    # The source's path is part of the key: torch's builder rebuilds (~15 s) when the path in a
    # build folder's ninja file changes, so two checkouts sharing one folder rebuilt at each start.
    key = hashlib.sha256("\n".join([str(source.resolve()), source.read_text(), torch.__version__,
                                    " ".join(CFLAGS), cpu_signature(), sys.version]).encode()
                         ).hexdigest()[:16]
    return cache_dir("ext", f"{source.stem}-{key}")


def _build(name: str, source: Path) -> tuple[bool, bool]:
    """Builds (or loads the cached build of) one kernel source as library `name`: the one
    builder of both sources. Returns (loaded, was cached); a failure is logged."""
    out = build_dir(source)
    try:
        from torch.utils.cpp_extension import load

        _ninja_on_path()
        out.mkdir(parents=True, exist_ok=True)
        cached = any(out.glob("*.so"))
        load(name=name, sources=[str(source)], extra_cflags=CFLAGS,
             extra_ldflags=["-fopenmp"], build_directory=str(out), is_python_module=False,
             verbose=False)
    except Exception as e:  # noqa: BLE001 - no compiler, no headers, odd platform: fall back
        first = str(e).splitlines()[0] if str(e) else ""
        log.warning("kiln's CPU kernels (%s) could not be built (%s: %s); using PyTorch's paths",
                    source.name, type(e).__name__, first)
        return False, False
    return True, cached


def _x86_linux() -> bool:
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


def load_checked(library: str, source: Path, what: str, missing: str,
                  register: Callable[[], None], check: Callable[[], bool]) -> bool:
    """Builds (or loads) one kernel source, asks it whether this CPU has its instructions
    (`supported()`), registers its fake ops and checks it against PyTorch once. False, with the
    reason logged, where it cannot run here."""
    if not _x86_linux():
        return False
    t0 = time.monotonic()
    ok, cached = _build(library, source)
    if not ok:
        return False
    ops = {SOURCE: torch.ops.kiln_cpu, KQUANT_SOURCE: torch.ops.kiln_kquant}.get(
        source, torch.ops.kiln_avx2)
    if not ops.supported():
        log.info("this CPU has no %s: %s are off", missing, what)
        return False
    register()
    if not check():
        log.warning("%s disagree with PyTorch on this machine: not used", what)
        return False
    log.info("%s %s in %.1f s (%s)", what, "loaded" if cached else "built",
             time.monotonic() - t0, build_dir(source))
    return True


@functools.cache
def available() -> bool:
    """kiln's AVX512-BF16 kernels (cpu_kernels.cpp), built and self-checked once."""
    return load_checked("kiln_cpu_kernels", SOURCE, "kiln's CPU kernels", "AVX512-BF16",
                         _register_fakes, _self_check)


def _ninja_on_path() -> None:
    """torch's extension builder runs `ninja` from PATH; the `ninja` package (a dependency)
    installs it next to this interpreter, which need not be on PATH (.venv/bin/python ...)."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path


def decode_attention_ok(k: torch.Tensor, num_heads: int) -> bool:
    """Whether a layer whose pool is `k` [S, Hk, D] can decode with the kernel."""
    return (k.device.type == "cpu" and k.dtype == torch.bfloat16 and k.shape[-1] in HEAD_DIMS
            and num_heads % k.shape[1] == 0 and num_heads // k.shape[1] <= MAX_GROUP
            and available())


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                     mask: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, D] bf16 against the pool k/v [S, Hk, D] through slots/mask [B, L] ->
    (out [B, Hq, D] fp32, lse [B, Hq] fp32: log-sum-exp of the row's scaled scores)."""
    return torch.ops.kiln_cpu.decode_attention(q, k, v, slots, mask, scale)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                      start: int, scale: float) -> torch.Tensor:
    """A prefill chunk's queries q [T, Hq, D] bf16 (query t at position start + t) attending
    causally over the pool k/v [S, Hk, D] through slots [start + T] (the chunk's own K/V
    already written) -> [T, Hq, D] bf16."""
    return torch.ops.kiln_cpu.prefill_attention(q, k, v, slots, start, scale)


def shared_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query of q [B, Hq, D] bf16 against all the keys at `slots` [P] of the pool k/v
    (a cascade's shared prefix) -> (out [B, Hq, D] fp32, lse [B, Hq] fp32), to be merged with
    decode_attention's result over each row's own keys."""
    return torch.ops.kiln_cpu.shared_attention(q, k, v, slots, scale)


def decode_layer(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ln1: torch.Tensor,
                 ln2: torch.Tensor, eps: float, weights: list[torch.Tensor],
                 scales: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor, gather: torch.Tensor, mask: torch.Tensor,
                 shared: torch.Tensor | None, num_heads: int, scale: float) -> torch.Tensor:
    """One Llama decoder layer of a decode step in one call (cpu_kernels.cpp decode_layer):
    x [B, H] bf16 -> [B, H] bf16, writing the step's K/V to the pool k/v at slot_mapping.
    weights: qkv, o, gate_up, down in pack_w4's (uint8) or pack_w8's (int8) layout; scales:
    their w8 row scales (empty tensors for w4). gather/mask [B, L] and shared [P] as for
    decode_attention / shared_attention; cos/sin [B, 1, D] from RotaryEmbedding.lookup."""
    return torch.ops.kiln_cpu.decode_layer(x, cos, sin, ln1, ln2, eps, weights, scales, k, v,
                                           slot_mapping, gather, mask, shared, num_heads, scale)


def _elementwise_ops(dtype: torch.dtype) -> Any:
    """The library whose rms_norm / silu_mul / rope_write take `dtype`: the AVX512 kernels
    (cpu_kernels.cpp) bf16, the AVX2 ones (cpu_kernels_avx2.cpp) fp32."""
    return torch.ops.kiln_cpu if dtype == torch.bfloat16 else torch.ops.kiln_avx2


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, slots: torch.Tensor, num_heads: int) -> torch.Tensor:
    """A step's RoPE and K/V write in one pass: qkv [T, (Hq + 2 Hk) * D] bf16 (AVX512) or fp32
    (AVX2), cos and signed sin [T, 1, D] in its dtype (RotaryEmbedding.lookup); k and v
    rotated/stored at `slots` [T] of the pools [S, Hk, D] (same dtype; fp16 too on AVX2).
    Returns the rotated q [T, Hq, D]."""
    return _elementwise_ops(qkv.dtype).rope_write(qkv, cos, sin, k, v, slots, num_heads)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [M, H] bf16 (AVX512) or fp32 (AVX2) with weight [H] of x's dtype in one
    pass (kiln.layers.norm's math)."""
    return _elementwise_ops(x.dtype).rms_norm(x, weight, eps)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(g) * u for gu = [g u], [M, 2 I] bf16 (AVX512) or fp32 (AVX2) -> [M, I], in one
    pass."""
    return _elementwise_ops(gu.dtype).silu_mul(gu)


def elementwise_kernels_ok(dtype: torch.dtype) -> bool:
    """Whether rms_norm / silu_mul / rope_write run for a model computing in `dtype` here."""
    if dtype == torch.bfloat16:
        return available()
    from kiln.layers.cpu_kernels_avx2 import avx2_available

    return dtype == torch.float32 and avx2_available()


def use_elementwise_kernels(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Lets the modules of a CPU model that have an `elementwise_kernel` flag (RMSNorm,
    LlamaMLP, LlamaAttention) run rms_norm / silu_mul / rope_write in their eager steps, where
    the kernels for the model's dtype run here."""
    if not elementwise_kernels_ok(dtype):
        return
    for m in model.modules():
        if getattr(m, "elementwise_kernel", None) is False:
            m.elementwise_kernel = True


def pack_w4(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """4-bit groups of 32 (codes q [N, K] in 0..15, scale and min [N, K/32]; w = scale * q + min)
    -> the kernel's layout, uint8 [N/16, K/32, 320] (see w4 in cpu_kernels.cpp)."""
    n, k = q.shape
    nb, g = n // 16, k // 32
    # [N, K] -> [NB, 16 rows, K/4 quads, 2 halves, 2] -> [NB, quads, 16 rows, 2, halves]
    c = q.to(torch.uint8).reshape(nb, 16, k // 4, 2, 2).permute(0, 2, 1, 4, 3)
    codes = (c[..., 0] | (c[..., 1] << 4)).reshape(nb, g, 256)

    def f16(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [NB, G, 32 bytes]
        return t.to(torch.float16).reshape(nb, 16, g).transpose(1, 2).contiguous() \
            .view(torch.uint8)

    return torch.cat([codes, f16(scale), f16(mn)], dim=-1).contiguous()


def pack_w8(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the kernel's layout, int8 [N/16, K/2, 32] (see w8 in cpu_kernels.cpp)."""
    n, k = q.shape
    return q.reshape(n // 16, 16, k // 2, 2).transpose(1, 2).reshape(n // 16, k // 2, 32) \
        .contiguous()


def unpack_w4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack_w4's inverse: (codes uint8 [N, K], scale fp32 [N, K/32], min fp32 [N, K/32])."""
    nb, g, _ = packed.shape
    b = packed[..., :256].reshape(nb, g, 8, 16, 2)  # [NB, G, quad, row, e]
    q = torch.stack([b & 0x0F, b >> 4], dim=-2)  # [NB, G, quad, row, half, e]
    q = q.permute(0, 3, 1, 2, 4, 5).reshape(nb * 16, g * 32)

    def f32(off: int) -> torch.Tensor:
        return packed[..., off:off + 32].contiguous().view(torch.float16).transpose(1, 2) \
            .reshape(nb * 16, g).float()

    return q, f32(256), f32(288)


def unpack_w8(packed: torch.Tensor) -> torch.Tensor:
    """pack_w8's inverse: int8 [N, K]."""
    nb, kp, _ = packed.shape
    return packed.view(nb, kp, 16, 2).transpose(1, 2).reshape(nb * 16, kp * 2)


def unpack_w8_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows of the int8 weight [len(rows), K] from its packed form (an embedding lookup)."""
    nb, kp, _ = packed.shape
    return packed.view(nb, kp, 16, 2)[rows // 16, :, rows % 16].reshape(*rows.shape, 2 * kp)


def linear_ok(device: torch.device, n: int, k: int) -> bool:
    """Whether a linear of n outputs over k inputs can run on w4_linear / w8_linear here."""
    return device.type == "cpu" and n % 16 == 0 and k % 32 == 0 and available()


def w4_linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] bf16 @ W^T with W in pack_w4's layout -> [M, N] bf16."""
    return torch.ops.kiln_cpu.w4_linear(x, packed, n)


def w4a8_linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """w4_linear for many rows (prefill): x quantized to int8 (a scale per row, refined per
    group of 32 by a power of two; see cpu_kernels.cpp), int8 x 4-bit dot products
    (AVX512-VNNI), 0.59-0.82x the time of oneDNN's bf16 GEMM on a dense copy of the weight at
    16-512 rows. Same layout as w4_linear; results differ from it by the activations' rounding
    (relative error ~1.4e-2 on random data)."""
    return torch.ops.kiln_cpu.w4a8_linear(x, packed, n)


def w8_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 @ (scale * q)^T with q in pack_w8's layout, scale fp32 [N] -> [M, N] bf16."""
    return torch.ops.kiln_cpu.w8_linear(x, packed, scale)


def _register_fakes() -> None:
    """Output shapes for torch.compile's tracing (the kernels run as one opaque call each)."""
    @torch.library.register_fake("kiln_cpu::w4_linear")
    def _(x, packed, n):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("kiln_cpu::w4a8_linear")
    def _(x, packed, n):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("kiln_cpu::w8_linear")
    def _(x, packed, scale):
        return x.new_empty((x.shape[0], packed.shape[0] * 16))

    @torch.library.register_fake("kiln_cpu::prefill_attention")
    def _(q, k, v, slots, start, scale):
        return torch.empty_like(q)

    @torch.library.register_fake("kiln_cpu::shared_attention")
    def _(q, k, v, slots, scale):
        return (q.new_empty(q.shape, dtype=torch.float32),
                q.new_empty(q.shape[:2], dtype=torch.float32))

    register_elementwise_fakes("kiln_cpu")

    @torch.library.register_fake("kiln_cpu::decode_attention")
    def _(q, k, v, slots, mask, scale):
        b, hq, d = q.shape
        return q.new_empty((b, hq, d), dtype=torch.float32), q.new_empty((b, hq),
                                                                          dtype=torch.float32)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              mask: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel computes, in fp32 PyTorch: for tests and the self-check."""
    b, hq, d = q.shape
    hk = k.shape[1]
    ck = k.index_select(0, slots.reshape(-1)).view(b, -1, hk, d).float()
    cv = v.index_select(0, slots.reshape(-1)).view(b, -1, hk, d).float()
    ck = ck.repeat_interleave(hq // hk, dim=2).transpose(1, 2)  # [B, Hq, L, D]
    cv = cv.repeat_interleave(hq // hk, dim=2).transpose(1, 2)
    s = (q.float().unsqueeze(2) @ ck.transpose(-1, -2)).squeeze(2) * scale  # [B, Hq, L]
    s = s.masked_fill(~mask.view(b, 1, -1), float("-inf"))
    return (torch.softmax(s, -1).unsqueeze(2) @ cv).squeeze(2), torch.logsumexp(s, -1)


def prefill_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                      start: int, scale: float) -> torch.Tensor:
    """What prefill_attention computes, in fp32 PyTorch (tests)."""
    t, hq, _ = q.shape
    hk = k.shape[1]
    ck = k.index_select(0, slots).float().repeat_interleave(hq // hk, dim=1).transpose(0, 1)
    cv = v.index_select(0, slots).float().repeat_interleave(hq // hk, dim=1).transpose(0, 1)
    s = (q.float().transpose(0, 1) @ ck.transpose(-1, -2)) * scale  # [Hq, T, L]
    visible = torch.arange(slots.shape[0])[None, :] <= start + torch.arange(t)[:, None]
    s = s.masked_fill(~visible, float("-inf"))
    return (torch.softmax(s, -1) @ cv).transpose(0, 1)


def _self_check() -> bool:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(64, 2, 64, generator=g).bfloat16()
    v = torch.randn(64, 2, 64, generator=g).bfloat16()
    q = torch.randn(3, 6, 64, generator=g).bfloat16()
    slots = torch.randint(0, 64, (3, 20), generator=g)
    mask = torch.arange(20).unsqueeze(0) < torch.tensor([[20], [7], [1]])
    got = decode_attention(q, k, v, slots, mask, 0.125)
    want = reference(q, k, v, slots, mask, 0.125)
    return all(torch.allclose(a, b, rtol=1e-3, atol=1e-3) for a, b in zip(got, want))


# --------------------------------------------------------------------------- AVX2 kernels
# cpu_kernels_avx2.cpp: int4 x int8 linears and the grouped MoE op for x86 CPUs without
# AVX512-BF16 (AVX2 + FMA + F16C: every x86 CPU since ~2013). Where the AVX512 kernels run,
# kiln uses those; the two share this builder.

def register_elementwise_fakes(ns: str) -> None:
    """rope_write / rms_norm / silu_mul's shapes, alike in both libraries (`ns`)."""
    @torch.library.register_fake(f"{ns}::rope_write")
    def _(qkv, cos, sin, k, v, slots, num_heads):
        return qkv.new_empty((qkv.shape[0], num_heads, k.shape[2]))

    @torch.library.register_fake(f"{ns}::rms_norm")
    def _(x, w, eps):
        return torch.empty_like(x)

    @torch.library.register_fake(f"{ns}::silu_mul")
    def _(gu):
        return gu.new_empty((gu.shape[0], gu.shape[1] // 2))


# --------------------------------------------------------------------------- GGUF-block kernels
# kquant_avx2.cpp: Q8_0 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K rows as the GGUF stores them, for
# x86 CPUs with AVX2 + FMA + F16C (kiln/layers/kquant.py holds the module and the reference).


@functools.cache
def kquant_available() -> bool:
    """kquant_avx2.cpp, built and self-checked once (False where it cannot run here)."""
    from kiln.layers import kquant

    return load_checked("kiln_kquant", KQUANT_SOURCE, "kiln's GGUF-block kernels",
                         "AVX2/FMA/F16C", kquant.register_fakes, kquant.self_check)


if __name__ == "__main__":  # `python -m kiln.layers.cpu_kernels`: build now (make install)
    from kiln.layers.cpu_kernels_avx2 import avx2_available

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("kiln CPU kernels:", "on" if available() else "off (PyTorch paths)")
    print("kiln AVX2 kernels:", "on" if avx2_available() else "off")
    print("kiln GGUF-block kernels:", "on" if kquant_available() else "off")
