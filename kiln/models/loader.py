"""Weights from disk into our modules: Hugging Face safetensors folders and single GGUF files.

The model is built on the meta device (no memory, no init cost), materialized empty on the target
device, then every parameter is filled from the checkpoint. Names are mapped to ours (GGUF names
to HF names first, then HF names to our packed modules); a checkpoint tensor we do not know, or a
parameter the checkpoint does not provide, is an error that names it.

GGUF specifics: tensors are dequantized with the `gguf` package to fp32, then cast to the runtime
dtype. llama.cpp stores Llama's Q and K rows permuted for its interleaved RoPE; we undo that so
the "rotate half" RoPE of the HF layout applies.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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


@dataclass
class Checkpoint:
    """A model on disk: where it is, its config, and how to stream its tensors."""

    path: Path  # folder, or the .gguf file
    config: ModelConfig
    format: str  # "safetensors" | "gguf"
    files: list[Path]
    gguf_meta: dict[str, Any] | None = None
    _reader: Any = None  # the GGUF reader (memory-mapped), opened once

    def gguf_reader(self) -> Any:
        if self._reader is None:
            import gguf

            self._reader = gguf.GGUFReader(str(self.path))
        return self._reader

    @property
    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


# --------------------------------------------------------------------------- opening


def open_checkpoint(path: str | Path, gguf_file: str | Path | None = None) -> Checkpoint:
    path = Path(path)
    if gguf_file is not None:
        path = Path(gguf_file) if Path(gguf_file).is_absolute() else path / gguf_file
    if path.is_file() and path.suffix == ".gguf":
        import gguf

        reader = gguf.GGUFReader(str(path))
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


def read_gguf_metadata(reader: Any) -> tuple[dict[str, Any], set[str]]:
    meta: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                   "tokenizer.ggml.token_type"):
            meta[key] = range(len(f.data))  # only the length is needed here; cheap
            continue
        try:
            meta[key] = f.contents()
        except Exception:  # noqa: BLE001 - an odd field must not stop loading
            continue
    return meta, {t.name for t in reader.tensors}


def gguf_file_type_name(meta: dict[str, Any]) -> str | None:
    import gguf

    ft = meta.get("general.file_type")
    try:
        return gguf.LlamaFileType(int(ft)).name.removeprefix("MOSTLY_") if ft is not None else None
    except ValueError:
        return None


# --------------------------------------------------------------------------- tensor streams


def iter_tensors(ckpt: Checkpoint) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF-style name, fp32/fp16/bf16 CPU tensor) for every tensor of the checkpoint."""
    if ckpt.format == "gguf":
        yield from _iter_gguf(ckpt)
        return
    from safetensors import safe_open

    for f in ckpt.files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


def _iter_gguf(ckpt: Checkpoint) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf

    assert ckpt.gguf_meta is not None
    arch = ckpt.gguf_meta["general.architecture"]
    cfg = ckpt.config
    for t in ckpt.gguf_reader().tensors:
        name = _gguf_to_hf(t.name)
        if name is None:
            raise ModelLoadError(f"unknown GGUF tensor {t.name!r} in {ckpt.path}",
                                 hint="this GGUF has tensors kiln's Llama-family model lacks")
        if name == "rope_freqs":
            yield name, torch.from_numpy(np.array(t.data, dtype=np.float32))
            continue
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(
                f"GGUF tensor {t.name!r} uses {t.tensor_type.name}, which kiln cannot dequantize",
                hint="use a GGUF with Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K/F16/BF16/F32 tensors",
            ) from e
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims fastest-first
        tensor = torch.from_numpy(np.array(arr, dtype=np.float32).reshape(shape))
        if arch in _GGUF_PERMUTED_QK:
            if name.endswith("q_proj.weight"):
                tensor = _unpermute(tensor, cfg.num_attention_heads)
            elif name.endswith("k_proj.weight"):
                tensor = _unpermute(tensor, cfg.num_key_value_heads)
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
                max_positions: int, progress: ProgressFn | None = None) -> torch.nn.Module:
    from kiln.models.registry import model_class

    cls = model_class(ckpt.config.architecture)
    with torch.device("meta"):
        model = cls(ckpt.config, max_positions)
    model = model.to_empty(device=device).to(dtype)
    for rotary in model.rotary_embeddings():
        rotary.build()
    load_weights(model, ckpt, progress=progress)
    model.eval()
    return model


def load_weights(model: torch.nn.Module, ckpt: Checkpoint,
                 progress: ProgressFn | None = None) -> None:
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
    names_total = None
    for i, (name, tensor) in enumerate(iter_tensors(ckpt)):
        if progress is not None:
            if names_total is None:
                names_total = _count_tensors(ckpt)
            progress(i + 1, names_total)
        if name == "rope_freqs":
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
        with torch.no_grad():
            if shard is not None:
                modules[mod_name].load_shard(param, shard, tensor.to(param.dtype))
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
