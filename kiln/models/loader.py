"""Weights from disk into our modules: Hugging Face safetensors folders and single GGUF files.

The model is built on the meta device (no memory, no init cost), materialized empty on the target
device, then every parameter is filled from the checkpoint. Names are mapped to ours (GGUF names
to HF names first, then HF names to our packed modules); a checkpoint tensor we do not know, or a
parameter the checkpoint does not provide, is an error that names it.

GGUF specifics: the file is parsed here (header, metadata, tensor table; memory-mapped, a few ms)
rather than with `gguf.GGUFReader`, which takes seconds on a tokenizer's 50k-entry string arrays.
Quantized blocks are dequantized with vectorized torch code (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/
Q6_K; other types through the `gguf` package's numpy code). When the model is going to be
quantized anyway (`build_model(..., quantization=...)`), 4-bit blocks (Q4_0/Q4_1) are not
dequantized at all: they reach `kiln/layers/quant.py` as `GroupQuant` (codes, scale, min), which
the int4 path repacks exactly. llama.cpp stores Llama's Q and K rows permuted for its interleaved
RoPE; we undo that so the "rotate half" RoPE of the HF layout applies.
"""

from __future__ import annotations

import json
import mmap
import re
import struct
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.errors import ModelLoadError
from kiln.models.config import ModelConfig

ProgressFn = Callable[[int, int], None]  # (tensors done, tensors total)

_GGUF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# GGUF architectures whose Q/K rows llama.cpp's converter permuted (interleaved RoPE).
_GGUF_PERMUTED_QK = {"llama", "mistral"}


# --------------------------------------------------------------------------- GGUF parsing

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

# GGUF metadata value types: id -> struct format (scalars); 8 = string, 9 = array
_GGUF_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                10: "<Q", 11: "<q", 12: "<d"}
_GGUF_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
            6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
# String arrays too large to be worth decoding here: only their length is kept (`range(n)`).
_GGUF_SKIP_ARRAYS = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                     "tokenizer.ggml.token_type"}


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    type_id: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.type_id, (f"type{self.type_id}", 0, 0))[0]

    @property
    def torch_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))


class GGUFFile:
    """A parsed GGUF file: `metadata` (key -> value), `tensors` (in file order), and raw tensor
    bytes on demand (`raw(t)`, a uint8 tensor viewing the memory map, copy-on-write)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            except ValueError as e:  # empty file
                raise ModelLoadError(f"{self.path} is not a GGUF file (empty)") from e
        self.metadata: dict[str, Any] = {}
        self.tensors: list[GGUFTensorInfo] = []
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError) as e:
            raise ModelLoadError(f"{self.path} is not a valid GGUF file ({e})",
                                 hint="the download may be truncated; fetch it again") from e

    def _parse(self) -> None:
        mm = self._mm
        if mm[:4] != b"GGUF":
            raise ModelLoadError(f"{self.path} is not a GGUF file (bad magic {bytes(mm[:4])!r})")
        version, = struct.unpack_from("<I", mm, 4)
        if version < 2:
            raise ModelLoadError(f"{self.path}: GGUF version {version} is too old",
                                 hint="convert it again with a recent llama.cpp")
        n_tensors, n_kv = struct.unpack_from("<QQ", mm, 8)
        # The pseudo-keys gguf.GGUFReader reports too.
        self.metadata.update({"GGUF.version": version, "GGUF.tensor_count": n_tensors,
                              "GGUF.kv_count": n_kv})
        pos = 24
        for _ in range(n_kv):
            key, pos = self._string(pos)
            vtype, = struct.unpack_from("<I", mm, pos)
            pos += 4
            self.metadata[key], pos = self._value(vtype, pos, key)
        infos = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            n_dims, = struct.unpack_from("<I", mm, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", mm, pos + 4)
            pos += 4 + 8 * n_dims
            type_id, offset = struct.unpack_from("<IQ", mm, pos)
            pos += 12
            infos.append((name, tuple(int(d) for d in dims), type_id, offset))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = (pos + align - 1) // align * align
        for name, dims, type_id, offset in infos:
            n = int(np.prod(dims)) if dims else 1
            if type_id in GGML_TYPES:
                _, be, bb = GGML_TYPES[type_id]
                nbytes = n // be * bb
            else:
                nbytes = 0  # unknown type: an error if the tensor is ever read
            self.tensors.append(GGUFTensorInfo(name, dims, type_id, data_start + offset, nbytes))

    def _string(self, pos: int) -> tuple[str, int]:
        n, = struct.unpack_from("<Q", self._mm, pos)
        return self._mm[pos + 8:pos + 8 + n].decode("utf-8", errors="replace"), pos + 8 + n

    def _value(self, vtype: int, pos: int, key: str) -> tuple[Any, int]:
        mm = self._mm
        if vtype in _GGUF_SCALAR:
            fmt = _GGUF_SCALAR[vtype]
            return struct.unpack_from(fmt, mm, pos)[0], pos + struct.calcsize(fmt)
        if vtype == 8:
            return self._string(pos)
        if vtype == 9:
            etype, n = struct.unpack_from("<IQ", mm, pos)
            pos += 12
            if etype in _GGUF_NP:
                dt = np.dtype(_GGUF_NP[etype])
                end = pos + n * dt.itemsize
                if key in _GGUF_SKIP_ARRAYS:
                    return range(n), end
                return np.frombuffer(mm, dtype=dt, count=n, offset=pos).tolist(), end
            if etype == 8:
                if key in _GGUF_SKIP_ARRAYS:
                    for _ in range(n):
                        ln, = struct.unpack_from("<Q", mm, pos)
                        pos += 8 + ln
                    return range(n), pos
                out = []
                for _ in range(n):
                    s, pos = self._string(pos)
                    out.append(s)
                return out, pos
            out = []
            for _ in range(n):
                v, pos = self._value(etype, pos, key)
                out.append(v)
            return out, pos
        raise ModelLoadError(f"{self.path}: unknown GGUF metadata type {vtype} for {key!r}")

    def raw(self, t: GGUFTensorInfo) -> torch.Tensor:
        if t.type_id not in GGML_TYPES or t.offset + t.nbytes > len(self._mm):
            raise ModelLoadError(f"GGUF tensor {t.name!r} ({t.type_name}) cannot be read",
                                 hint="the file may be truncated or use a newer tensor type")
        arr = np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ACCESS_COPY maps are writable; numpy says so
            return torch.from_numpy(arr)


# --------------------------------------------------------------------------- GGUF dequantization


@dataclass
class GroupQuant:
    """A weight in asymmetric groups along its input dimension: w = q * scale + min, q in 0..15.

    q: [N, K] uint8; scale, min: [N, K / group_size] fp32. GGUF Q4_1 blocks are exactly this
    (Q4_0 too, with min = -8 * scale); `kiln.layers.quant` repacks it for the int4 kernel."""

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


def _group_q4(blocks: torch.Tensor, type_name: str) -> GroupQuant:
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
        g = _group_q4(b, type_name)
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


def gguf_tensor(gf: GGUFFile, t: GGUFTensorInfo, keep_4bit: bool = False
                ) -> torch.Tensor | GroupQuant:
    """One GGUF tensor as a fp32 tensor in torch layout ([out, in] for weights), or as a
    `GroupQuant` when `keep_4bit` and its blocks are Q4_0/Q4_1."""
    shape = t.torch_shape
    raw = gf.raw(t)
    if keep_4bit and t.type_name in ("Q4_0", "Q4_1") and len(shape) == 2:
        g = _group_q4(raw.view(-1, GGML_TYPES[t.type_id][2]), t.type_name)
        n, k = shape
        return GroupQuant(g.q.reshape(n, k), g.scale.reshape(n, k // 32),
                          g.min.reshape(n, k // 32), 32)
    flat = dequantize_blocks(raw, t.type_name)
    if flat is None:
        import gguf

        try:
            arr = gguf.quants.dequantize(raw.numpy().reshape(-1, _row_bytes(t)),
                                         gguf.GGMLQuantizationType(t.type_id))
        except (NotImplementedError, ValueError) as e:
            raise ModelLoadError(
                f"GGUF tensor {t.name!r} uses {t.type_name}, which kiln cannot dequantize",
                hint="use a GGUF with Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K/F16/BF16/F32 "
                "tensors") from e
        flat = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
    return flat.reshape(shape)


def _row_bytes(t: GGUFTensorInfo) -> int:
    _, be, bb = GGML_TYPES[t.type_id]
    return t.shape[0] // be * bb if t.shape else bb


# --------------------------------------------------------------------------- opening


@dataclass
class Checkpoint:
    """A model on disk: where it is, its config, and how to stream its tensors."""

    path: Path  # folder, or the .gguf file
    config: ModelConfig
    format: str  # "safetensors" | "gguf"
    files: list[Path]
    gguf_meta: dict[str, Any] | None = None
    _reader: GGUFFile | None = field(default=None, repr=False)  # parsed once, memory-mapped

    def gguf_reader(self) -> GGUFFile:
        if self._reader is None:
            self._reader = GGUFFile(self.path)
        return self._reader

    def release(self) -> None:
        """Drops the GGUF memory map once the weights are loaded (they are copies): its pages
        read during loading would otherwise stay in RSS (96 MB for SmolLM2 Q4_1). The map is
        re-opened if a reader is asked for again."""
        self._reader = None

    @property
    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def open_checkpoint(path: str | Path, gguf_file: str | Path | None = None) -> Checkpoint:
    path = Path(path)
    if gguf_file is not None:
        path = Path(gguf_file) if Path(gguf_file).is_absolute() else path / gguf_file
    if path.is_file() and path.suffix == ".gguf":
        reader = GGUFFile(path)
        meta, names = read_gguf_metadata(reader)
        cfg = ModelConfig.from_gguf(meta, names)
        cfg.quantization = gguf_file_type_name(meta)
        return Checkpoint(path, cfg, "gguf", [path], meta, reader)
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.exists():
            ggufs = sorted(path.glob("*.gguf"))
            if ggufs:
                return open_checkpoint(ggufs[0])
            raise ModelLoadError(f"{path} has no config.json and no .gguf file",
                                 hint="point MODEL at a Hugging Face model folder or a .gguf")
        cfg = ModelConfig.from_hf(json.loads(cfg_file.read_text()))
        _merge_generation_config(path, cfg)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{path} has no *.safetensors weights",
                                 hint="kiln loads safetensors or GGUF; convert .bin weights first")
        return Checkpoint(path, cfg, "safetensors", files)
    raise ModelLoadError(f"{path} is neither a model folder nor a .gguf file")


def _merge_generation_config(folder: Path, cfg: ModelConfig) -> None:
    gen = folder / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids = [eos] if isinstance(eos, int) else list(eos or [])
        cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | set(ids))


def read_gguf_metadata(reader: GGUFFile | str | Path) -> tuple[dict[str, Any], set[str]]:
    """(metadata, tensor names). The tokenizer's big arrays are kept as `range(len)`."""
    if not isinstance(reader, GGUFFile):
        reader = GGUFFile(reader)
    return dict(reader.metadata), {t.name for t in reader.tensors}


# llama_ftype -> name, as gguf.LlamaFileType spells it without "MOSTLY_"
_FILE_TYPES = {0: "ALL_F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
               10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M",
               16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}


def gguf_file_type_name(meta: dict[str, Any]) -> str | None:
    ft = meta.get("general.file_type")
    if ft is None:
        return None
    if int(ft) in _FILE_TYPES:
        return _FILE_TYPES[int(ft)]
    import gguf

    try:
        return gguf.LlamaFileType(int(ft)).name.removeprefix("MOSTLY_")
    except ValueError:
        return None


# --------------------------------------------------------------------------- tensor streams


def iter_tensors(ckpt: Checkpoint, keep_4bit: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor | GroupQuant]]:
    """(HF-style name, fp32/fp16/bf16 CPU tensor) for every tensor of the checkpoint; with
    `keep_4bit`, GGUF Q4_0/Q4_1 matrices come as `GroupQuant` instead."""
    if ckpt.format == "gguf":
        yield from _iter_gguf(ckpt, keep_4bit)
        return
    from safetensors import safe_open

    for f in ckpt.files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


def _iter_gguf(ckpt: Checkpoint, keep_4bit: bool = False
               ) -> Iterator[tuple[str, torch.Tensor | GroupQuant]]:
    assert ckpt.gguf_meta is not None
    arch = ckpt.gguf_meta["general.architecture"]
    cfg = ckpt.config
    gf = ckpt.gguf_reader()
    for t in gf.tensors:
        name = _gguf_to_hf(t.name)
        if name is None:
            raise ModelLoadError(f"unknown GGUF tensor {t.name!r} in {ckpt.path}",
                                 hint="this GGUF has tensors kiln's Llama-family model lacks")
        tensor = gguf_tensor(gf, t, keep_4bit=keep_4bit and name.endswith("proj.weight"))
        if name == "rope_freqs":
            yield name, tensor
            continue
        if arch in _GGUF_PERMUTED_QK:
            heads = (cfg.num_attention_heads if name.endswith("q_proj.weight")
                     else cfg.num_key_value_heads if name.endswith("k_proj.weight") else None)
            if heads is not None:
                if isinstance(tensor, GroupQuant):
                    tensor = tensor.permute_rows(lambda x, h=heads: _unpermute(x, h))
                else:
                    tensor = _unpermute(tensor, heads)
        yield name, tensor


def _gguf_to_hf(name: str) -> str | None:
    if name in _GGUF_TOP:
        return _GGUF_TOP[name]
    if name == "rope_freqs.weight":
        return "rope_freqs"
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m and m.group(2) in _GGUF_LAYER:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER[m.group(2)]}"
    return None


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's convert permute: rows (head, pair, half) -> (head, half, pair)."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


# --------------------------------------------------------------------------- building


def build_model(ckpt: Checkpoint, *, dtype: torch.dtype, device: torch.device | str,
                max_positions: int, progress: ProgressFn | None = None,
                quantization: str = "none", keep_dense: bool = False,
                cpu_kernels: bool = True) -> torch.nn.Module:
    """The model with its weights loaded. With `quantization` ("int8" | "int4") its linear layers
    are swapped for quantized ones (`kiln.layers.quant.quantize_model`); GGUF 4-bit blocks then
    go straight into them, never through a dense copy (`keep_dense` adds one afterwards, made
    from the quantized weight, for large steps). On CPU, bf16 linear layers left dense are
    packed for oneDNN (`kiln.layers.linear.pack_linears`)."""
    from kiln.models.registry import model_class

    cls = model_class(ckpt.config.architecture)
    with torch.device("meta"):
        model = cls(ckpt.config, max_positions).to(dtype)  # cast while it costs nothing
    _materialize(model, device)
    for rotary in model.rotary_embeddings():
        rotary.build(device=device)
    load_weights(model, ckpt, progress=progress, keep_4bit=quantization != "none")
    if quantization != "none":
        from kiln.layers.quant import quantize_model

        quantize_model(model, quantization, keep_dense=keep_dense, use_kernels=cpu_kernels)
    if torch.device(device).type == "cpu":
        from kiln.layers.linear import pack_linears

        pack_linears(model)  # bf16 layers left dense: ~2x faster GEMMs at 4-16 rows
        if cpu_kernels and dtype == torch.bfloat16:
            from kiln.layers import cpu_kernels as kernels

            kernels.use_elementwise_kernels(model)
    model.eval()
    return model


def _materialize(model: torch.nn.Module, device: torch.device | str) -> None:
    """Meta parameters/buffers -> uninitialized ones on `device` (what `to_empty` does, without
    its trip through torch's reference ops, which imports sympy: ~2 s of startup)."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.device.type == "meta":
                module._parameters[name] = torch.nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device=device),
                    requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None and b.device.type == "meta":
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)


def load_weights(model: torch.nn.Module, ckpt: Checkpoint,
                 progress: ProgressFn | None = None, keep_4bit: bool = False) -> None:
    """Fills every parameter from the checkpoint. With `keep_4bit`, GGUF 4-bit matrices are
    handed to their module's `stash_quantized` (a quantization pass must follow: see
    `kiln.layers.linear.Linear`)."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules", {})
    expected: set[tuple[str, str | None]] = set()
    for pname in params:
        mod_name, _, leaf = pname.rpartition(".")
        shards = getattr(modules.get(mod_name), "shards", None)
        if shards:
            expected.update((pname, s) for s in shards)
        else:
            expected.add((pname, None))
    loaded: set[tuple[str, str | None]] = set()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    names_total = _count_tensors(ckpt) if progress is not None else 0
    for i, (name, tensor) in enumerate(iter_tensors(ckpt, keep_4bit=keep_4bit)):
        if progress is not None:
            progress(i + 1, names_total)
        if name == "rope_freqs":
            assert isinstance(tensor, torch.Tensor)
            for rotary in model.rotary_embeddings():
                rotary.build(freq_factors=tensor)
            continue
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue
        mod_name, _, leaf = name.rpartition(".")
        parent, _, child = mod_name.rpartition(".")
        shard = None
        if child in packed:
            target, shard = packed[child]
            mod_name = f"{parent}.{target}" if parent else target
        pname = f"{mod_name}.{leaf}"
        param = params.get(pname)
        if param is None:
            raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the model",
                                 hint="the checkpoint does not match its config.json architecture")
        module = modules[mod_name]
        with torch.no_grad():
            if isinstance(tensor, GroupQuant) and hasattr(module, "stash_quantized") \
                    and leaf == "weight":
                module.stash_quantized(shard, tensor)
            else:
                if isinstance(tensor, GroupQuant):
                    tensor = tensor.dequantize()
                if shard is not None:
                    module.load_shard(param, shard, tensor.to(param.dtype))
                else:
                    if tuple(param.shape) != tuple(tensor.shape):
                        raise ModelLoadError(
                            f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                            f"the model expects {tuple(param.shape)}")
                    param.data.copy_(tensor.to(param.dtype))
        loaded.add((pname, shard))
    missing = sorted(f"{p}[{s}]" if s else p for p, s in expected - loaded)
    if missing:
        raise ModelLoadError(
            f"checkpoint {ckpt.path} lacks {len(missing)} tensor(s): {', '.join(missing[:8])}"
            + (" ..." if len(missing) > 8 else ""),
            hint="the weight files are incomplete or do not match config.json")


def _count_tensors(ckpt: Checkpoint) -> int:
    if ckpt.format == "gguf":
        return len(ckpt.gguf_reader().tensors)
    from safetensors import safe_open

    n = 0
    for f in ckpt.files:
        with safe_open(str(f), framework="pt") as sf:
            n += len(list(sf.keys()))
    return n
