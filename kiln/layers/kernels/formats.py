"""The weight formats kiln's quantized layers and CPU kernels read, and their decoding in
PyTorch: GGUF's block types as llama.cpp defines them (`GGML_TYPES`, `dequantize_blocks`,
`GGUFBlocks`: a tensor's raw rows) and kiln's 4-bit groups (`GroupQuant`, which GGUF's Q4_0 and
Q4_1 blocks are exactly: `q4_groups`).

Here, at the bottom of the kernel layer, because three floors read them: the GGUF reader
(kiln/models/gguf.py) hands tensors over in these forms, the kernels' references and self-checks
(kiln/layers/kernels/reference.py) decode them, and the layers (kiln/layers/quant/linear.py, gguf_blocks.py)
are built from them. Pure data and torch: nothing here imports the rest of kiln.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# ggml tensor types: id -> (name, elements per block, bytes per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
}

# the 4-bit block types kiln's int4 tiles hold exactly (`GroupQuant`'s form: q4_groups)
Q4_TYPES = ("Q4_0", "Q4_1")
# ggml type name -> id (GGUF's tensor-table values): the types kernels/kquant.cpp reads
KQUANT_TYPES = {"Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
# the legacy block types an embedding lookup dequantizes in C++ (ops.embed_rows), by ggml id
EMBED_ROW_TYPES = {name: tid for tid, (name, _, _) in GGML_TYPES.items()
                   if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")}


@dataclass
class GroupQuant:
    """A weight in asymmetric groups along its input dimension: w = q * scale + min, q in 0..15.

    q: [N, K] uint8; scale, min: [N, K / group_size] fp32. GGUF Q4_1 blocks are exactly this
    (Q4_0 too, with min = -8 * scale; kiln/models/gguf.py hands them over as they are), and
    `Int4Linear` repacks it for the int4 kernel."""

    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor
    group_size: int = 32

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.q.shape
        g = self.group_size
        w = torch.addcmul(self.min.unsqueeze(-1), self.q.view(n, k // g, g).float(),
                          self.scale.unsqueeze(-1))
        return w.reshape(n, k).to(dtype)

    def permute_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> GroupQuant:
        return GroupQuant(fn(self.q), fn(self.scale), fn(self.min), self.group_size)

    @staticmethod
    def cat(parts: list[GroupQuant]) -> GroupQuant:
        """Row blocks of one weight (a merged layer's shards, gate then up) joined in order."""
        sizes = {p.group_size for p in parts}
        if len(sizes) != 1:
            raise ValueError(f"mixed group sizes {sizes}")
        return GroupQuant(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.min for p in parts]), sizes.pop())


@dataclass
class GGUFBlocks:
    """A 2-D GGUF tensor's raw blocks: raw uint8 [rows, row_bytes] (each row the blocks of one
    output row, in file order), of `type_name`, `in_features` values per row."""

    raw: torch.Tensor
    type_name: str
    in_features: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.raw.shape[0], self.in_features))

    @property
    def type_id(self) -> int:
        return KQUANT_TYPES[self.type_name]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        flat = dequantize_blocks(self.raw.reshape(-1), self.type_name)
        assert flat is not None
        return flat.reshape(self.shape).to(dtype)

    def permute_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> GGUFBlocks:
        return GGUFBlocks(fn(self.raw).contiguous(), self.type_name, self.in_features)

    def groups(self) -> GroupQuant:
        """Q4_0 / Q4_1 rows as the same weight in 4-bit groups [rows, in_features], exactly
        (`q4_groups`: the codes unpacked to a byte each)."""
        k = self.in_features
        g = q4_groups(self.raw.reshape(-1, self.raw.shape[1] * 32 // k), self.type_name)
        return GroupQuant(g.q.reshape(-1, k), g.scale.reshape(-1, k // 32),
                          g.min.reshape(-1, k // 32), 32)


# --------------------------------------------------------------------------- dequantization


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 (any strides) -> [n] fp32."""
    return b.contiguous().view(torch.float16).float().squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] uint8 -> [n, 32]: low nibbles are elements 0..15, high nibbles 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] uint8 (a little-endian uint32 per block) -> [n, 32] bit j of element j (0/1)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], 32)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12-byte packed 6-bit scales and mins -> ([n, 8], [n, 8]) uint8."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def q4_groups(blocks: torch.Tensor, type_name: str) -> GroupQuant:
    """Q4_0 / Q4_1 blocks [n_blocks, bytes] -> codes, scale, min per block of 32 (flat)."""
    d = _f16(blocks[:, 0:2])
    if type_name == "Q4_1":
        m = _f16(blocks[:, 2:4])
        qs = blocks[:, 4:20]
    else:
        m = d * -8.0
        qs = blocks[:, 2:18]
    return GroupQuant(_nibbles(qs), d, m, 32)


def dequantize_blocks(raw: torch.Tensor, type_name: str) -> torch.Tensor | None:
    """Raw GGUF bytes of one tensor -> flat fp32 values, or None for types done by `gguf`."""
    if type_name == "F32":
        return raw.view(torch.float32)
    if type_name == "F16":
        return raw.view(torch.float16).float()
    if type_name == "BF16":
        return raw.view(torch.bfloat16).float()
    if type_name not in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"):
        return None
    _, _, bb = next(v for v in GGML_TYPES.values() if v[0] == type_name)
    b = raw.view(-1, bb)
    n = b.shape[0]
    if type_name in ("Q4_0", "Q4_1"):
        g = q4_groups(b, type_name)
        return torch.addcmul(g.min.unsqueeze(-1), g.q.float(), g.scale.unsqueeze(-1)).reshape(-1)
    if type_name == "Q8_0":
        d = _f16(b[:, 0:2])
        return (b[:, 2:34].contiguous().view(torch.int8).float() * d.unsqueeze(-1)).reshape(-1)
    if type_name in ("Q5_0", "Q5_1"):
        d = _f16(b[:, 0:2])
        off = 4 if type_name == "Q5_1" else 2
        q = (_nibbles(b[:, off + 4:off + 20]) | (_high_bits(b[:, off:off + 4]) << 4)).float()
        if type_name == "Q5_1":
            return torch.addcmul(_f16(b[:, 2:4]).unsqueeze(-1), q, d.unsqueeze(-1)).reshape(-1)
        return ((q - 16.0) * d.unsqueeze(-1)).reshape(-1)
    if type_name in ("Q4_K", "Q5_K"):
        d = _f16(b[:, 0:2]).unsqueeze(-1)
        dmin = _f16(b[:, 2:4]).unsqueeze(-1)
        sc, mn = _k_scales(b[:, 4:16])
        scale = (d * sc.float()).unsqueeze(-1)  # [n, 8, 1]
        minv = (dmin * mn.float()).unsqueeze(-1)
        if type_name == "Q4_K":
            qs = b[:, 16:144].reshape(n, 4, 1, 32)
            q = ((qs >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)) & 0x0F)
        else:
            qh = b[:, 16:48].reshape(n, 1, 1, 32)
            qs = b[:, 48:176].reshape(n, 4, 1, 32)
            ql = (qs >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)) & 0x0F
            hb = (qh >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1, 1)) & 1  # [n, 8, 1, 32]
            q = ql.reshape(n, 8, 32) | (hb.reshape(n, 8, 32) << 4)
        q = q.reshape(n, 8, 32).float()
        return (scale * q - minv).reshape(-1)
    # Q6_K: ql[128], qh[64], scales[16] int8, d f16
    ql = b[:, 0:128].reshape(n, 2, 1, 64)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[:, 208:210]).unsqueeze(-1)
    lo = ((ql >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)) & 0x0F)
    lo = lo.reshape(n, 2, 4, 32)  # [n, half, quarter, 32]
    hi = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 0x03
    q = (lo | (hi.reshape(n, 2, 4, 32) << 4)).to(torch.int16) - 32
    q = q.reshape(n, 16, 16).float()
    return ((d * scales).unsqueeze(-1) * q).reshape(-1)
