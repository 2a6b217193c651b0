"""GGUF's quantized blocks (Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) run as the file stores them.

Before this, kiln re-quantized every such tensor at load to its own int4 groups of 32 (or int8
rows): a second rounding on top of the GGUF's (a Q5_0 or Q6_K weight lost bits), a slow first
start (~57 s for Qwen2.5-Coder-0.5B Q4_K_M on 2 cores) and a second copy of the weights while
loading. Now the loader hands such a tensor over as `GGUFBlocks` (its rows of raw blocks, a
view of the file's memory map: no copy, no decoding at load), and `KQuantLinear` multiplies
with them through kiln/layers/kernels/kquant.cpp (`kq_linear`: activations quantized to int8 per
group of 32, or per super-block of 256 for the K-quants, int8 dot products per block, as
llama.cpp's vec_dot does with its Q8_0 and Q8_K). The blocks are first reordered (`pack`,
once at load, nothing rounded) into tiles of 8 output rows, one row per 32-bit lane; the
row-at-a-time kernel over the raw blocks is the tiles' check.

`kq_reference` (kiln/layers/kernels/reference.py) is what the kernel computes, in PyTorch (the
weight dequantized by kiln/layers/kernels/formats.py, the activation rounded as the kernel rounds
it): the builder's self-check and the tests compare the
two on blocks written by the `gguf` package's quantizers. Where the kernel is not built (no
AVX2, not x86 Linux, --no-cpu-kernels / --no-gguf-kernels) the loader keeps the old path (the
blocks dequantized, then re-quantized by --quantization), which is faster than this module's
fallback (dequantize every forward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.layers import kernels
from kiln.layers.kernels import ops
from kiln.layers.kernels.choose import choose_embedding_kernel, choose_linear_kernel
from kiln.layers.kernels.formats import EMBED_ROW_TYPES, KQUANT_TYPES, GGUFBlocks
from kiln.layers.quant.linear import QuantizedLinear

# types an untied embedding keeps as blocks (kiln/layers/kernels/formats.py's dequantizer reads
# them row by row): Qwen2.5-0.5B's 151936 x 896 token_embd is 545 MB in fp32, 94 MB as Q5_0
EMBED_TYPES = {"Q4_0", "Q4_1", *KQUANT_TYPES}


def _lib():
    return kernels.lib()


def kq_linear(x: torch.Tensor, weights: list[torch.Tensor], types: list[int],
              rows: list[int] | None = None) -> torch.Tensor:
    """x [M, K] fp32/bf16 @ W^T, W = the parts' rows stacked (each raw GGUF rows of its type,
    or `pack`'s tiles of them; `rows`: each part's row count, needed for tiles) -> [M, N] in
    x's dtype."""
    if rows is None:
        rows = [w.shape[0] for w in weights]
    return _lib().kq_linear(x, weights, types, rows)


def has_tiles(type_name: str) -> bool:
    """Whether kq_linear has the 8-row tiled layout for this type (all of KQUANT_TYPES today;
    a type without one would run on the row-at-a-time kernel over the raw rows)."""
    return bool(_lib().has_tiles(KQUANT_TYPES[type_name]))


def pack(blocks: GGUFBlocks) -> torch.Tensor:
    """The blocks reordered into kq_linear's tiles of 8 output rows (kernels/kquant.cpp's layout:
    the same codes and scales, moved, nothing rounded): uint8 [ceil(rows / 8), blocks per
    row, tile block bytes], about the blocks' size (Q4_K +2.8%, Q5_K +2.3%, the others +0)."""
    return _lib().kq_pack(blocks.raw.contiguous(), blocks.type_id)


def unpack(packed: torch.Tensor, type_name: str, rows: int, in_features: int) -> GGUFBlocks:
    """`pack`'s inverse: the raw GGUF rows, bit for bit."""
    raw = _lib().kq_unpack(packed, KQUANT_TYPES[type_name], rows)
    return GGUFBlocks(raw, type_name, in_features)


class KQuantLinear(QuantizedLinear):
    """y = x @ W^T + b, W the GGUF blocks of one or more checkpoint tensors stacked by rows (a
    merged qkv / gate_up may mix types: Q4_K_M files put Q5_0, Q6_K or Q8_0 beside Q4_K).
    One kernel at every row count (the kernel is batch-invariant), no dense copy.

    With the kernel, the parts are repacked once here into tiles of 8 output rows (`pack`):
    each activation load then serves 8 rows and the tile's results come out of its integer
    sums in row order, where the raw rows needed a horizontal sum and a float scale per row and
    block (1.8-3.4x slower per layer than the int4 tile kernel). The raw
    blocks are not kept (the tiles are a copy of their size, the file's map is released)."""

    dense_min_m = 1 << 62

    def __init__(self, parts: list[GGUFBlocks], bias: torch.Tensor | None,
                 out_dtype: torch.dtype) -> None:
        super().__init__(out_dtype)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.raw.shape[0] for p in parts)
        self.native = False
        self.types = [p.type_id for p in parts]
        self.type_names = [p.type_name for p in parts]
        self.rows = [p.raw.shape[0] for p in parts]
        self.kernel_choice = choose_linear_kernel("gguf", parts[0].raw.device,
                                                  self.out_features, self.in_features)
        # per part: True where blocks{i} holds `pack`'s tiles, False for raw rows
        self.tiled = [self.kernel == "gguf" and has_tiles(p.type_name) for p in parts]
        for i, p in enumerate(parts):
            self.register_buffer(f"blocks{i}", pack(p) if self.tiled[i] else p.raw.contiguous())
        self.register_buffer("bias", bias.to(out_dtype) if bias is not None else None)

    def _parts(self) -> list[torch.Tensor]:
        return [getattr(self, f"blocks{i}") for i in range(len(self.types))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.kernel == "gguf":
            xa = x2 if x2.dtype in (torch.float32, torch.bfloat16) else x2.float()
            y = kq_linear(xa, self._parts(), self.types, self.rows).to(x.dtype)
        else:
            y = F.linear(x2, self.dequantize(x2.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def keep_dense(self) -> None:
        pass  # one kernel at every size: a dense copy would cost 3-8x the blocks' memory

    def blocks(self) -> list[GGUFBlocks]:
        """The parts as the file's raw blocks (tiles unpacked, bit for bit)."""
        return [unpack(w, t, n, self.in_features) if tiled
                else GGUFBlocks(w, t, self.in_features)
                for w, t, n, tiled in zip(self._parts(), self.type_names, self.rows, self.tiled)]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([b.dequantize(dtype) for b in self.blocks()])

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, "
                f"{'+'.join(self.type_names)}, {self.kernel}")


class BlockEmbedding(nn.Module):
    """An embedding table kept as the GGUF's blocks: a lookup dequantizes just the ids' rows,
    in one call of kiln's embed_rows for the legacy types (choose_embedding_kernel), else by
    formats.py's PyTorch ops (~12 of them: 100-160 us a decode step on 2 cores)."""

    def __init__(self, blocks: GGUFBlocks, dtype: torch.dtype) -> None:
        super().__init__()
        self.type_name = blocks.type_name
        self.num_embeddings, self.embedding_dim = blocks.shape
        self.dtype = dtype
        self.register_buffer("blocks", blocks.raw)
        self.kernel_choice = choose_embedding_kernel(self.type_name, blocks.raw.device)

    def as_blocks(self) -> GGUFBlocks:
        return GGUFBlocks(self.blocks, self.type_name, self.embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.kernel_choice.kiln:
            flat = ops.embed_rows(self.blocks, ids.reshape(-1), EMBED_ROW_TYPES[self.type_name],
                                  self.embedding_dim).to(self.dtype)
        else:
            rows = GGUFBlocks(self.blocks[ids.reshape(-1)], self.type_name, self.embedding_dim)
            flat = rows.dequantize(self.dtype)
        return flat.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.type_name} blocks"
