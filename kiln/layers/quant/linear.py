"""Weight-only quantized linears, swapped in as modules after loading (gpt-fast style) by
kiln/layers/quant/apply.py's pass:

    quantize_model(model, "int8")   every Linear -> Int8Linear (int8 per output channel)
    quantize_model(model, "int4")   every Linear -> Int4Linear (4-bit, asymmetric groups of 32)
                                    lm_head (and a tied embedding) -> Int8Linear / Int8Embedding

Decode is memory-bound, so fewer weight bytes read per token is more tokens/s.

Which kernel runs a layer is chosen once, at construction, by
kiln.layers.kernels.choose.choose_linear_kernel (its reasons go to the decision trace). Where
kiln's CPU kernels run (every x86 CPU with AVX2, at the best ISA level it has: see
kiln/layers/kernels/isa.py), int4 layers keep pack_q4's tiles and run q4_linear at every row
count (int8 activations, no dense copy). Elsewhere the packed forms are PyTorch's own CPU
kernels, which take bf16 activations:

    int8: torch.ops.aten._weight_int8pack_mm(x[M,K] bf16, w[N,K] int8, scales[N] bf16)
    int4: torch.ops.aten._weight_int4pack_mm_for_cpu(x[M,K] bf16, packed, 32, sz[K/32,N,2] bf16)
          packed = _convert_weight_to_int4pack_for_cpu(q[N,K] int32 in 0..15, 1)
          w = (q - 8) * scale + zero            (zero = min + 8 * scale)

These kernels dequantize inside the inner loop and do not reuse a weight tile across rows, so
their cost grows with M (the number of tokens) about linearly. Up to `kernel_max_m` rows they are
the fastest path (decode); above it (prefill chunks, big batches) the layer dequantizes its weight
to bf16 and runs one dense GEMM, which is several times faster there. Both paths give the same
numbers up to bf16 rounding.

With `keep_dense` (the default on CPU when memory allows, see the `dense_weights` setting) each
quantized layer also keeps its weight dequantized to bf16 (in oneDNN's packed layout where
torch has it, see kiln/layers/linear.py), and steps of many rows (prefill chunks, batches of 4
and more) run one dense GEMM on it: decode at low batch is bound by the bytes of weight read,
large steps by arithmetic, where the kernels' in-loop dequantization loses. The copy is the
quantized weight, dequantized: both paths compute with the same numbers. Int4 layers on kiln's
kernels keep no copy (q4_linear beats it at every size: AVX2_INT4 below).

GGUF Q4_0/Q4_1 blocks are exactly this int4 form (groups of 32, a scale and a min), so a 4-bit
GGUF becomes an int4 model with no requantization error: the loader stashes the blocks in the
dense Linear (`Linear.stash_quantized`) and `quantize_model` repacks them.

Where an op is missing (other torch builds, CUDA, odd shapes) a layer falls back to a reference
form that dequantizes on the fly and calls F.linear: slower, same numbers.

The lm_head (tied to the embedding in SmolLM2: 49152 x 576, the biggest matrix) is int8 in both
modes: logits are more sensitive than hidden layers (an int4 head cost 8 points of greedy
agreement). The embedding reads its rows from the same int8 storage.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from kiln.layers.kernels import choose, ops, reference
from kiln.layers.kernels.formats import GGUFBlocks, GroupQuant
from kiln.layers.linear import pack_weight, packed_linear

log = logging.getLogger("kiln.quant")

INT4_GROUP = 32
KERNEL_DTYPE = torch.bfloat16  # what the CPU kernels take: activations and scales
# Rows up to which the fused kernels beat dequantize + dense GEMM, measured in the whole SmolLM2
# model on Zen 5 (AVX-512 BF16): int4 kernel vs dequant at M=32 143 vs 73 tok/s, M=128 330 vs 312,
# M=512 306 vs 473; int8 at M=8 106 vs 98, M=16 106 vs 108. On Zen 3 (AVX2, no dense copy) the
# fallback converts the whole weight every step: the 49152 x 1024 int8 head, 2 threads,
# _weight_int8pack_mm vs convert + fp32 GEMM: M=1 3.9 vs 86 ms, M=8 11.5 vs 117, M=16 23 vs
# 121 (~1.45 ms a row against ~120 flat): the kernel up to 64 rows (a decode batch's logits).
INT8_KERNEL_MAX_M = 64
INT4_KERNEL_MAX_M = 128
# With a dense copy of the weight kept (`keep_dense`), steps of at least this many rows use it
# (one bf16 GEMM) instead of the kernels. Measured on Zen 5, 2 threads, bf16 GEMM vs kernel:
# one SmolLM2 layer's four linears at M=8 513 vs 377 us (int4) / 442 (int8), M=16 693 vs 784 /
# 927, M=32 1046 vs 1570 / 1991; the 49152 x 576 head at M=4 5.7 vs 3.8 ms (int8), M=8 6.2 vs
# 6.6, M=16 7.1 vs 13.2 (and 32 ms for the int8 -> bf16 conversion fallback).
INT8_DENSE_MIN_M = 8
INT4_DENSE_MIN_M = 12
# The same with the copy packed for oneDNN (`pack_weight`, where the build has it), which is
# ~2x faster than F.linear at these sizes: a layer's four linears at M=2 0.16-0.24 vs 0.17-0.18
# ms (int4 kernel), M=4 0.18-0.24 vs 0.24, M=8 0.24-0.31 vs 0.41-0.45; the head at M=2 2.7-3.3 vs
# 3.3-3.4 ms (int8 kernel), M=4 2.4 vs 3.6, M=8 3.0 vs 6.2-6.5. In the whole model (compiled
# decode) batch 2 ran slower on the copy (74-84 vs 115-166 tok/s), so 1-3 rows keep the kernels.
PACKED_DENSE_MIN_M = 4
# AVX2_INT4: where kiln's kernels run, int4 layers run q4_linear
# (kiln/layers/kernels/q4_tiles.cpp: activations quantized to int8 per group of 32, llama.cpp's
# Q8_0, int8 x 4-bit dot products) at every row count and keep no dense copy. One Zen 3 thread (a
# shared machine: ratios): [768, 1024] at M=1 38 us vs 140 for PyTorch's int4 kernel; M=16
# 378 vs 1281 (vs 970 for fp32 F.linear on a dense copy); against the dense copy at prefill
# sizes, M=64 / 256 / 512: 0.78 / 3.0 / 6.1 vs 1.29 / 4.4 / 8.7 ms ([1024, 384]: 0.43 / 1.7 /
# 3.3 vs 0.62 / 2.2 / 4.3), so there is no threshold to switch at.
# AVX2_INT8: there, under --batch-invariant, the int8 head runs kiln's q8_linear (fp32
# activations x int8 rows, each output one FMA chain) at every row count and drops the dense
# copy that this mode used to run at every size. The 49152 x 576 head, one thread of a 2-core
# EPYC shared with ~16 other busy processes (ms, min of 5, two runs: ratios only), q8 vs the
# fp32 copy vs PyTorch's int8 kernel: M=1 13-28 vs 54-57 vs 26-44, M=4 41-43 vs 65-74 vs 50-69,
# M=16 147-157 vs 119-153 vs 238-260. A head sees one row per sequence (at most --max-num-seqs
# 16): the int8 bytes win 2-4x at one row and the copy's GEMM is at most ~20% faster at 16
# (the same FMA count), so q8 is the one path. Prefill-sized int8 layers keep their copy.


# --------------------------------------------------------------------------- quantizers


def quantize_int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: w [N, K] -> (q int8 [N, K], scale fp32 [N])."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4_groups(w: torch.Tensor, group_size: int = INT4_GROUP) -> GroupQuant:
    """Asymmetric 4-bit groups along K (min/max, like GGUF Q4_1): w [N, K] -> GroupQuant."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    mn = g.amin(dim=-1)
    scale = ((g.amax(dim=-1) - mn) / 15.0).clamp(min=1e-12)
    q = torch.round((g - mn.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
    return GroupQuant(q.reshape(n, k), scale, mn, group_size)


def quantize_q4_0_groups(w: torch.Tensor, group_size: int = INT4_GROUP) -> GroupQuant:
    """Symmetric 4-bit groups along K in GGUF Q4_0's form (ggml's quantizer: d = the group's
    largest-magnitude value / -8, q = round(w / d) + 8 in 0..15, min = -8 d): w [N, K] ->
    GroupQuant. A weight dequantized from Q4_0 blocks comes back to the same codes and scales
    (its largest-magnitude value is -8 d exactly), so re-packing a joined or reshaped Q4_0
    tensor this way loses nothing; any other weight gets Q4_0's rounding."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    idx = g.abs().argmax(dim=-1, keepdim=True)
    d = (g.gather(-1, idx).squeeze(-1) / -8.0).to(torch.float16).float()  # fp16, as stored
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(g * inv.unsqueeze(-1) + 8.0).clamp(0, 15).to(torch.uint8)
    return GroupQuant(q.reshape(n, k), d, -8.0 * d, group_size)


# --------------------------------------------------------------------------- capability probes


def _has_op(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


@functools.cache
def native_int8(device_type: str) -> bool:
    if device_type != "cpu" or not _has_op("_weight_int8pack_mm"):
        return False
    try:
        g = torch.Generator().manual_seed(0)  # not the global RNG: probing must not shift it
        x = torch.randn(2, 64, generator=g).to(KERNEL_DTYPE)
        w = torch.randint(-127, 127, (32, 64), dtype=torch.int8, generator=g)
        s = torch.rand(32, generator=g).to(KERNEL_DTYPE)
        got = torch.ops.aten._weight_int8pack_mm(x, w, s).float()
        want = (x.float() @ w.float().t()) * s.float()
        return bool(torch.allclose(got, want, rtol=2e-2, atol=2e-1 * want.abs().max().item()))
    except Exception:  # noqa: BLE001 - any failure means: use the reference path
        return False


@functools.cache
def native_int4(device_type: str) -> bool:
    if device_type != "cpu" or not (_has_op("_weight_int4pack_mm_for_cpu")
                                    and _has_op("_convert_weight_to_int4pack_for_cpu")):
        return False
    try:
        n, k = 64, 64
        g = torch.Generator().manual_seed(0)
        q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        scale = torch.rand(k // INT4_GROUP, n, generator=g) + 0.5
        zero = torch.randn(k // INT4_GROUP, n, generator=g)
        sz = torch.stack([scale, zero], -1).to(KERNEL_DTYPE)
        x = torch.randn(3, k, generator=g).to(KERNEL_DTYPE)
        got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, sz).float()
        s = sz[..., 0].float().t().repeat_interleave(INT4_GROUP, 1)
        z = sz[..., 1].float().t().repeat_interleave(INT4_GROUP, 1)
        w = (q.float() - 8) * s + z
        want = x.float() @ w.t()
        return bool((got - want).abs().max() <= 2e-2 * want.abs().max() + 1e-2)
    except Exception:  # noqa: BLE001
        return False


@functools.cache
def int4_block_n() -> int | None:
    """The row-block width of the CPU int4 packed layout (64 with AVX-512, 32 with AVX2), found
    by packing a known pattern: within a block of B rows, byte j of column k holds row j in its
    low nibble and row j + B/2 in its high one. None if the layout is something else (then the
    large-M path uses the kernel too)."""
    if not native_int4("cpu"):
        return None
    n, k = 128, 64
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    for bn in (64, 32):
        try:
            if torch.equal(_unpack_int4_blocks(packed, n, k, bn).transpose(1, 2).reshape(n, k)
                           .int(), q):
                return bn
        except RuntimeError:
            continue
    return None


def _unpack_int4_blocks(packed: torch.Tensor, n: int, k: int, bn: int) -> torch.Tensor:
    """CPU int4 packed [N, K/2] -> codes [N/bn, K, bn] uint8 (a block's rows are its last dim)."""
    pv = packed.reshape(n // bn, k, bn // 2)
    return torch.cat([pv & 0x0F, pv >> 4], dim=-1)


# --------------------------------------------------------------------------- modules


class QuantizedLinear(nn.Module):
    """What Int8Linear and Int4Linear share: the activation dtype they return and the optional
    dense copy of their weight (`keep_dense`) that steps of `dense_min_m` rows or more use, and
    the kernel their chooser gave them (`kernel_choice`: kiln's q4 / gguf tiles, PyTorch's
    packed ops or the reference form, with the reasons)."""

    dense_min_m: int

    def __init__(self, out_dtype: torch.dtype) -> None:
        super().__init__()
        self.out_dtype = out_dtype
        self.kernel_choice = choose.Choice("reference", ())
        self.register_buffer("dense", None)  # [N, K] in out_dtype, see keep_dense
        self.dense_packed = False  # dense is in oneDNN's layout (kiln.layers.linear.pack_weight)
        # --batch-invariant: one path for every row count (fix_kernel_choice), so a row's
        # numbers do not depend on how many other rows share its step.
        self.fixed = False

    @property
    def kernel(self) -> str:
        return self.kernel_choice.kernel

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def keep_dense(self) -> None:
        self.dense = pack_weight(self.dequantize(self.out_dtype).contiguous())
        self.dense_packed = self.dense.is_mkldnn
        if self.dense_packed:
            self.dense_min_m = PACKED_DENSE_MIN_M

    def _use_dense(self, rows: int) -> bool:
        return self.dense is not None and (self.fixed or rows >= self.dense_min_m)

    def _dense_linear(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x.to(self.out_dtype), self.dense, self.dense_packed)


class Int8Linear(QuantizedLinear):
    """y = x @ (q * scale)^T + b with q int8 [N, K] and one scale per output row."""

    dense_min_m = INT8_DENSE_MIN_M

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype, use_kernels: bool = True) -> None:
        super().__init__(out_dtype)
        n, k = q.shape
        self.in_features, self.out_features = k, n
        self.kernel_choice = choose.choose_linear_kernel(
            "int8", q.device, n, k, use_kernels=use_kernels, native=native_int8(q.device.type))
        self.native = self.kernel == "torch-int8"
        self.kernel_max_m = INT8_KERNEL_MAX_M
        self.register_buffer("weight", q.contiguous())
        self.register_buffer("scales", scale.to(KERNEL_DTYPE if self.native else out_dtype))
        self.register_buffer("bias", bias.to(out_dtype) if bias is not None else None)
        # Whether kiln's q8_linear can run this layer; fix_kernel_choice sets `q8` on the head,
        # which then runs it at every row count (see AVX2_INT8 above).
        self.q8_ok = (choose.q8_ok(q.device, k, use_kernels)
                      and self.scales.dtype in (torch.float32, torch.bfloat16))
        self.q8 = False

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None,
                   out_dtype: torch.dtype, use_kernels: bool = True) -> Int8Linear:
        q, s = quantize_int8_rows(w)
        return cls(q, s, bias, out_dtype, use_kernels)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the int8 weight (what an embedding lookup reads)."""
        return self.weight[ids]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.q8:
            y = ops.q8_linear(x2.float(), self.weight, self.scales)
        elif self._use_dense(x2.shape[0]):
            y = self._dense_linear(x2)
        elif self.native and (self.fixed or x2.shape[0] <= self.kernel_max_m):
            y = torch.ops.aten._weight_int8pack_mm(x2.to(KERNEL_DTYPE), self.weight, self.scales)
        else:
            # Per-row scales commute with the matmul: scale the output, not the weight.
            cd = x2.dtype
            y = F.linear(x2, self.weight.to(cd)) * self.scales.to(cd)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.to(dtype) * self.scales.to(dtype).unsqueeze(1)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {_kernel_name(self)}"


def _kernel_name(layer: QuantizedLinear) -> str:
    return "q8" if getattr(layer, "q8", False) else layer.kernel


class Int8Embedding(nn.Module):
    """Embedding lookup from an Int8Linear's rows (a tied embedding shares the lm_head's int8
    storage: one copy of the biggest matrix, at half of bf16's bytes)."""

    def __init__(self, head: Int8Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self._head = [head]  # not a child: its buffers are counted once, under lm_head
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self._head[0]
        dense = head.dense
        if dense is not None and dense.dtype == self.dtype and not head.dense_packed:
            return dense[ids]  # (a packed copy has no rows to index: its numbers are these)
        return head.rows(ids).to(self.dtype) * head.scales[ids].to(self.dtype).unsqueeze(-1)


def _pack_blocks(blocks: list[GGUFBlocks], n: int, k: int) -> torch.Tensor | None:
    """GGUF Q4_0 / Q4_1 rows (a layer's shards in row order) -> reference.pack_q4's tiles of
    the same weight, byte for byte, moved from the file's bytes by ops.pack_q4_blocks: nothing
    unpacked (PyTorch's unpack and strided repack ran at ~90 MB/s). All Q4_0: without mins, as
    pack_q4 packs symmetric groups. None where a shard ends inside a tile of 8 rows."""
    tile = reference.Q4_TILE
    if any(b.shape[0] % tile for b in blocks[:-1]):
        return None
    sym = all(b.type_name == "Q4_0" for b in blocks)
    block = reference.Q4_SYM_BLOCK if sym else reference.Q4_BLOCK
    out = torch.empty(-(-n // tile), k // 32, block, dtype=torch.uint8)
    t = 0
    for b in blocks:
        nt = -(-b.shape[0] // tile)
        ops.pack_q4_blocks(b.raw, b.type_name, k, out=out[t:t + nt])
        t += nt
    return out


class Int4Linear(QuantizedLinear):
    """y = x @ W^T + b with W in asymmetric 4-bit groups of 32 along K."""

    dense_min_m = INT4_DENSE_MIN_M

    def __init__(self, gq: GroupQuant | list[GGUFBlocks], bias: torch.Tensor | None,
                 out_dtype: torch.dtype, use_kernels: bool = True) -> None:
        """`gq`: the weight as 4-bit groups, or as GGUF Q4_0 / Q4_1 blocks (a merged layer's
        shards in row order, views of the file), which kiln's kernel packs as they are."""
        super().__init__(out_dtype)
        blocks = gq if isinstance(gq, list) else None
        if blocks is not None:
            n, k = sum(b.shape[0] for b in blocks), blocks[0].in_features
            self.group_size, device = 32, blocks[0].raw.device
        else:
            n, k = gq.shape
            self.group_size, device = gq.group_size, gq.q.device
        self.in_features, self.out_features = k, n
        native = (native_int4(device.type) and k % self.group_size == 0 and n % 16 == 0
                  and self.group_size in (32, 64, 128, 256))
        self.kernel_choice = choose.choose_linear_kernel(
            "int4", device, n, k, group_size=self.group_size, use_kernels=use_kernels,
            native=native)
        self.native = self.kernel == "torch-int4"
        self.kernel_max_m = INT4_KERNEL_MAX_M
        bn = int4_block_n() if self.native else None
        self.block_n = bn if bn is not None and n % bn == 0 else None
        packed = _pack_blocks(blocks, n, k) if blocks and self.kernel == "q4" else None
        if blocks is not None and packed is None:
            gq = GroupQuant.cat([b.groups() for b in blocks])
        if self.kernel == "q4":  # reference.pack_q4's layout: tiles of 8 rows, fp16 scale/min
            # (symmetric groups, GGUF Q4_0's, without their mins: 10% fewer bytes to stream)
            if packed is None:
                mn = None if reference.symmetric(gq.scale, gq.min) else gq.min
                packed = reference.pack_q4(gq.q, gq.scale, mn)
            self.register_buffer("packed", packed)
            self.register_buffer("scales_zeros", None)
        elif self.native:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                gq.q.to(torch.int32).contiguous(), 1)
            zero = gq.min + 8.0 * gq.scale  # the kernel computes (q - 8) * scale + zero
            sz = torch.stack([gq.scale.t(), zero.t()], dim=-1).to(KERNEL_DTYPE).contiguous()
            self.register_buffer("packed", packed)
            self.register_buffer("scales_zeros", sz)  # [K/G, N, 2]
        else:
            # Reference form: plain nibbles (element 2j low, 2j+1 high) + fp32 scale/min.
            q = gq.q.reshape(n, k // 2, 2)
            self.register_buffer("packed", (q[..., 0] | (q[..., 1] << 4)).contiguous())
            self.register_buffer("scales_zeros",
                                 torch.stack([gq.scale, gq.min], dim=-1).float().contiguous())
        self.register_buffer("bias", bias.to(out_dtype) if bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        m = x2.shape[0]
        if self._use_dense(m):
            y = self._dense_linear(x2)
        elif self.kernel == "q4":
            xa = x2 if x2.dtype in (torch.float32, torch.bfloat16) else x2.float()
            y = ops.q4_linear(xa, self.packed, self.out_features)
        elif self.native and (self.fixed or m <= self.kernel_max_m or self.block_n is None):
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(KERNEL_DTYPE), self.packed, self.group_size, self.scales_zeros)
        elif self.native:
            y = x2 @ self._dequant_t(x2.dtype)
        else:
            y = F.linear(x2, self.dequantize(x2.dtype))
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def keep_dense(self) -> None:
        if self.kernel != "q4":  # kiln's kernel beats the copy at every size
            super().keep_dense()

    def _dequant_t(self, dtype: torch.dtype) -> torch.Tensor:
        """W^T [K, N] in `dtype`, from the CPU packed layout. Works block-wise ([N/B, K, B]) so
        that no uint8 transpose is needed; the one transpose left moves B-element runs."""
        assert self.block_n is not None
        n, k, g, bn = self.out_features, self.in_features, self.group_size, self.block_n
        nb = n // bn
        codes = _unpack_int4_blocks(self.packed, n, k, bn).view(nb, k // g, g, bn)
        sz = self.scales_zeros.float()  # [K/G, N, 2]
        s = sz[..., 0].view(k // g, nb, bn).permute(1, 0, 2).unsqueeze(2)
        z = (sz[..., 1] - 8.0 * sz[..., 0]).view(k // g, nb, bn).permute(1, 0, 2).unsqueeze(2)
        w = torch.addcmul(z, codes.float(), s).to(dtype)  # [nb, K/G, G, bn]
        return w.reshape(nb, k, bn).permute(1, 0, 2).reshape(k, n)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """W [N, K] in `dtype` (reference path; also used by tests)."""
        n, k, g = self.out_features, self.in_features, self.group_size
        if self.kernel == "q4":
            return GroupQuant(*reference.unpack_q4(self.packed, n), g).dequantize(dtype)
        if self.native:
            if self.block_n is not None:
                return self._dequant_t(torch.float32).t().to(dtype)
            eye = torch.eye(k, dtype=KERNEL_DTYPE)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                eye, self.packed, g, self.scales_zeros).t().to(dtype)
        q = torch.stack([self.packed & 0x0F, self.packed >> 4], dim=-1).reshape(n, k // g, g)
        sm = self.scales_zeros
        w = torch.addcmul(sm[..., 1].unsqueeze(-1), q.float(), sm[..., 0].unsqueeze(-1))
        return w.reshape(n, k).to(dtype)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, group={self.group_size}, "
                f"{_kernel_name(self)}")
