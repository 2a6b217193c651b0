"""The one GGUF reader: header, metadata, tensor table, and tensor bytes.

The file is parsed here (memory-mapped, a few ms) rather than with `gguf.GGUFReader`, which takes
seconds on a tokenizer's 50k-entry string arrays; the loader, the tokenizer and the export all
read GGUF files through `GGUFFile`. Quantized blocks are dequantized with vectorized torch code
(Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K: kiln/layers/kernels/formats.py, the block formats the
layers and kernels read too; other types through the `gguf` package's numpy code).
4-bit blocks (Q4_0/Q4_1) can instead be handed over undequantized as `GroupQuant` (codes, scale,
min), which the int4 path of `kiln/layers/quant/linear.py` repacks exactly; Q8_0/Q5_0/Q5_1/Q4_K/Q5_K/
Q6_K matrices as `GGUFBlocks` (raw rows), which `kiln/layers/quant/gguf_blocks.py` multiplies as they are.

Names stay GGUF's here: mapping them to a model's parameters is `kiln/models/loader.py`'s job.
"""

from __future__ import annotations

import math
import mmap
import struct
import warnings
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.errors import ModelLoadError
from kiln.i18n import msg
from kiln.layers.kernels.formats import (
    GGML_TYPES,
    GGUFBlocks,
    GroupQuant,
    dequantize_blocks,
)

# --------------------------------------------------------------------------- GGUF parsing

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
                raise ModelLoadError(msg("gguf.empty", path=self.path)) from e
        self.metadata: dict[str, Any] = {}
        self.tensors: list[GGUFTensorInfo] = []
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError, ZeroDivisionError,
                OverflowError) as e:
            raise ModelLoadError(msg("gguf.invalid", path=self.path, error=e),
                                 hint=msg("gguf.invalid.hint")) from e

    def release_pages(self) -> None:
        """Gives the map's resident pages back to the kernel (they are clean file pages of a
        private map: the next touch re-reads them from the file)."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._mm.madvise(mmap.MADV_DONTNEED)

    def _parse(self) -> None:
        mm = self._mm
        if mm[:4] != b"GGUF":
            raise ModelLoadError(msg("gguf.bad_magic", path=self.path, magic=repr(bytes(mm[:4]))),
                                 hint=msg("gguf.bad_magic.hint"))
        version, = struct.unpack_from("<I", mm, 4)
        if version < 2:
            raise ModelLoadError(msg("gguf.too_old", path=self.path, version=version),
                                 hint=msg("gguf.too_old.hint"))
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
        # Tensors are packed after the header, each at an aligned offset: one that is not, or
        # that lies beyond all the tensors' bytes together, means a damaged tensor table (not
        # a short file).
        packed = sum((t.nbytes + align - 1) // align * align for t in self.tensors)
        sized = all(t.type_id in GGML_TYPES for t in self.tensors)  # else sizes are unknown
        for t in self.tensors if sized else ():
            rel = t.offset - data_start
            if rel % align or rel + t.nbytes > packed:
                raise ModelLoadError(
                    msg("gguf.corrupt", path=self.path, tensor=repr(t.name), at=rel,
                        packed=packed), hint=msg("gguf.corrupt.hint"))
        end = max((t.offset + t.nbytes for t in self.tensors), default=0)
        if end > len(mm):
            # An interrupted download or copy: the header is whole, the data is not.
            raise ModelLoadError(msg("gguf.truncated", path=self.path, need=end, size=len(mm)),
                                 hint=msg("gguf.truncated.hint"))

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
        raise ModelLoadError(msg("gguf.unknown_metadata_type", path=self.path, type=vtype,
                                 key=repr(key)))

    def raw(self, t: GGUFTensorInfo) -> torch.Tensor:
        if t.type_id not in GGML_TYPES or t.offset + t.nbytes > len(self._mm):
            raise ModelLoadError(msg("gguf.tensor_unreadable", tensor=repr(t.name),
                                     type=t.type_name), hint=msg("gguf.tensor_unreadable.hint"))
        arr = np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ACCESS_COPY maps are writable; numpy says so
            return torch.from_numpy(arr)


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


# --------------------------------------------------------------------------- GGUF tensors


def gguf_tensor(gf: GGUFFile, t: GGUFTensorInfo, keep_4bit: bool = False,
                keep_blocks: Collection[str] = ()) -> torch.Tensor | GroupQuant | GGUFBlocks:
    """One GGUF tensor as a fp32 tensor in torch layout ([out, in] for weights), or as a
    `GroupQuant` when `keep_4bit` and its blocks are Q4_0/Q4_1 (stacked experts [E, out, in]
    come as one GroupQuant of E * out rows), or, when its type is in `keep_blocks` (the types
    kiln/layers/kernels/kquant.cpp reads, or those an embedding dequantizes per lookup), a 2-D
    tensor as `GGUFBlocks`: its raw rows, a view of the memory map (no copy and no decoding at
    load; the pages are the file's, shared with the page cache); stacked experts [E, out, in]
    as E * out rows, as for `keep_4bit`."""
    shape = t.torch_shape
    raw = gf.raw(t)
    if t.type_name in keep_blocks and len(shape) in (2, 3):
        # (stacked experts [E, out, in] as E * out rows, as GroupQuant stacks them)
        return GGUFBlocks(raw.view(math.prod(shape[:-1]), -1), t.type_name, shape[-1])
    if keep_4bit and t.type_name in ("Q4_0", "Q4_1") and len(shape) in (2, 3):
        return GGUFBlocks(raw.view(math.prod(shape[:-1]), -1), t.type_name, shape[-1]).groups()
    flat = dequantize_blocks(raw, t.type_name)
    if flat is None:
        import gguf

        try:
            arr = gguf.quants.dequantize(raw.numpy().reshape(-1, _row_bytes(t)),
                                         gguf.GGMLQuantizationType(t.type_id))
        except (NotImplementedError, ValueError) as e:
            raise ModelLoadError(
                msg("gguf.cannot_dequantize", tensor=repr(t.name), type=t.type_name),
                hint=msg("gguf.cannot_dequantize.hint")) from e
        flat = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
    return flat.reshape(shape)


def _row_bytes(t: GGUFTensorInfo) -> int:
    _, be, bb = GGML_TYPES[t.type_id]
    return t.shape[0] // be * bb if t.shape else bb
