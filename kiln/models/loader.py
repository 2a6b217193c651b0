"""Weights from disk into our modules: Hugging Face safetensors folders and single GGUF files.

The model is built on the meta device (no memory, no init cost), materialized empty on the target
device, then every parameter is filled from the checkpoint. Names are mapped to ours (GGUF names
to HF names first, then HF names to our packed modules); a checkpoint tensor we do not know, or a
parameter the checkpoint does not provide, is an error that names it.

GGUF files are read and dequantized by `kiln/models/gguf.py`; this module only maps their names.
When the model is going to be quantized anyway (`build_model(..., quant=...)`), 4-bit
blocks (Q4_0/Q4_1) are not dequantized at all: they reach `kiln/layers/quant/linear.py` as `GroupQuant`
(codes, scale, min), which the int4 path repacks exactly. llama.cpp stores Llama's Q and K rows
permuted for its interleaved RoPE; we undo that so the "rotate half" RoPE of the HF layout applies.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kiln.errors import ModelLoadError
from kiln.i18n import msg
from kiln.layers.kernels.formats import KQUANT_TYPES, Q4_TYPES, GGUFBlocks, GroupQuant
from kiln.layers.linear import TiedLMHead
from kiln.layers.moe import Experts
from kiln.layers.quant.gguf_blocks import EMBED_TYPES, BlockEmbedding
from kiln.models.config import ModelConfig
from kiln.models.gguf import GGUFFile, gguf_file_type_name, gguf_tensor, read_gguf_metadata
from kiln.settings.engine_config import QuantConfig

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
# Mixture-of-experts tensors (llama.cpp stacks each layer's experts in one `*_exps` tensor).
_GGUF_MOE = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# Multi-head latent attention (llama.cpp's deepseek2). Newer converters split kv_b_proj into
# attn_k_b [H, r, nope] (each head's block transposed) and attn_v_b [H, v, r]; `_iter_gguf` joins
# them back into kv_b_proj.
_GGUF_MLA = {
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
}
_GGUF_LAYER.update(_GGUF_MOE)
_GGUF_LAYER.update(_GGUF_MLA)
_GGUF_KV_B_SPLIT = re.compile(r"blk\.(\d+)\.attn_(k|v)_b\.weight")
_GGUF_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Per-architecture names where a family's layer differs from Llama's (llama.cpp reuses
# `ffn_norm` for Gemma's pre-MLP norm, stores Phi-3's fused matrices as attn_qkv / ffn_up).
_GEMMA_NORMS = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GGUF_ARCH_LAYER: dict[str, dict[str, str]] = {
    "gemma2": _GEMMA_NORMS,
    "gemma3": _GEMMA_NORMS,
    "olmo2": {"post_attention_norm.weight": "post_attention_layernorm.weight",
              "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight",
             "ffn_up.weight": "mlp.gate_up_proj.weight"},
}
# GGUF architectures whose Q/K rows llama.cpp's converter permuted (interleaved RoPE).
_GGUF_PERMUTED_QK = {"llama", "mistral", "granite"}
# Architectures whose norm weights llama.cpp stores with Gemma's 1 added (x * w, not
# x * (1 + w)); kiln's modules hold the checkpoint's zero-centred weight.
_GGUF_NORM_SHIFT = {"gemma2", "gemma3"}

# A checkpoint's expert tensor: per expert (`experts.3.gate_proj.weight`, Mixtral's `w1`) or
# stacked (GGUF's `*_exps` mapped above, transformers-5's fused `experts.gate_up_proj`).
_EXPERT = re.compile(r"(?P<module>.+\.experts)\.(?:(?P<expert>\d+)\.)?"
                     r"(?P<proj>gate_proj|up_proj|down_proj|gate_up_proj|w1|w2|w3)(?:\.weight)?")
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                "down_proj": "down", "w2": "down", "gate_up_proj": "gate_up"}


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
        re-opened if a reader is asked for again. Blocks kept as they are (an embedding served
        from the file's rows) keep the map alive, and with it every page that loading read
        (380 MB for Qwen2.5-0.5B Q4_K_M, whose blocks were repacked into tiles): those pages
        are given back too. Nothing writes into the map, so a page touched again is read back
        from the file, the same bytes."""
        self.release_pages()
        self._reader = None

    def release_pages(self) -> None:
        """Gives the GGUF map's resident pages back, keeping the map (loading may go on)."""
        if self._reader is not None:
            self._reader.release_pages()

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
        _gguf_longrope(reader, meta, cfg)
        return Checkpoint(path, cfg, "gguf", [path], meta, reader)
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.exists():
            ggufs = sorted(path.glob("*.gguf"))
            if ggufs:
                return open_checkpoint(ggufs[0])
            raise ModelLoadError(msg("load.no_config", path=path), hint=msg("load.no_config.hint"))
        cfg = read_hf_config(path)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(msg("load.no_safetensors", path=path),
                                 hint=msg("load.no_safetensors.hint"))
        return Checkpoint(path, cfg, "safetensors", files)
    raise ModelLoadError(msg("load.not_a_model", path=path))


# llama.cpp stores LongRoPE's per-dim factors as tensors; kiln's RoPE reads them from the config
_GGUF_ROPE_FACTORS = {"rope_factors_short.weight": "short_factor",
                      "rope_factors_long.weight": "long_factor"}


def _gguf_longrope(reader: GGUFFile, meta: dict[str, Any], cfg: ModelConfig) -> None:
    """Phi-3's LongRoPE from a GGUF: the factor tensors and llama.cpp's keys into the config's
    rope_scaling, in transformers' form (rope/rotary.py computes the tables from it)."""
    found = {_GGUF_ROPE_FACTORS[t.name]: t for t in reader.tensors if t.name in _GGUF_ROPE_FACTORS}
    if not found:
        return
    arch = meta["general.architecture"]
    scaling: dict[str, Any] = {"rope_type": "longrope"}
    for key, t in found.items():
        factors = gguf_tensor(reader, t)
        assert isinstance(factors, torch.Tensor)
        scaling[key] = factors.float().reshape(-1).tolist()
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    if orig:
        scaling["original_max_position_embeddings"] = int(orig)
    attn = meta.get(f"{arch}.rope.scaling.attn_factor")
    if attn:
        scaling["attention_factor"] = float(attn)
    cfg.rope_scaling = scaling


def read_hf_config(folder: str | Path, *, require_supported: bool = True) -> ModelConfig:
    """A model folder's config.json (and generation_config.json's EOS ids), nothing else: no
    weights are opened. `require_supported=False` accepts any architecture, for planning a
    hand-off to an external engine."""
    folder = Path(folder)
    cfg_file = folder / "config.json"
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{cfg_file} cannot be read: {e}",
                             hint="re-download the model (`kiln pull MODEL`)") from e
    cfg = ModelConfig.from_hf(raw, require_supported=require_supported)
    _merge_generation_config(folder, cfg)
    return cfg


def _merge_generation_config(folder: Path, cfg: ModelConfig) -> None:
    gen = folder / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids = [eos] if isinstance(eos, int) else list(eos or [])
        cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | set(ids))


# --------------------------------------------------------------------------- tensor streams


def iter_tensors(ckpt: Checkpoint, keep_4bit: bool = False, keep_blocks: bool = False,
                 expert_blocks: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor | GroupQuant | GGUFBlocks]]:
    """(HF-style name, fp32/fp16/bf16 CPU tensor) for every tensor of the checkpoint; with
    `keep_4bit`, GGUF Q4_0/Q4_1 matrices come as `GroupQuant` instead; with `keep_blocks`, the
    linear layers' Q8_0/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K matrices as `GGUFBlocks` (not the experts'),
    and their Q4_0/Q4_1 ones too (with `keep_4bit`): views of the file that `Int4Linear` packs
    into its tiles without unpacking a code; with `expert_blocks` (and `keep_4bit`), the
    experts' Q4_0/Q4_1 tensors as `GGUFBlocks`, which `Experts` packs the same way."""
    if ckpt.format == "gguf":
        yield from _iter_gguf(ckpt, keep_4bit, keep_blocks, expert_blocks)
        return
    for f in ckpt.files:
        with open_safetensors(f) as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open is not iterable
                yield name, sf.get_tensor(name)


@contextlib.contextmanager
def open_safetensors(path: Path) -> Iterator[Any]:
    """safetensors' safe_open, with a damaged file (a header that is not JSON, too long, or
    whose offsets lie outside the file) one ModelLoadError naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        sf = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(msg("load.bad_safetensors", path=path, error=e),
                             hint=msg("load.bad_weights.hint")) from None
    with sf:
        yield sf


def _iter_gguf(ckpt: Checkpoint, keep_4bit: bool = False, keep_blocks: bool = False,
               expert_blocks: bool = False
               ) -> Iterator[tuple[str, torch.Tensor | GroupQuant | GGUFBlocks]]:
    assert ckpt.gguf_meta is not None
    arch = ckpt.gguf_meta["general.architecture"]
    cfg = ckpt.config
    gf = ckpt.gguf_reader()
    kv_b_halves: dict[str, dict[str, torch.Tensor]] = {}  # layer -> "k"/"v" -> tensor
    for t in gf.tensors:
        if t.name in _GGUF_ROPE_FACTORS:  # in the config already (_gguf_longrope)
            continue
        split = _GGUF_KV_B_SPLIT.fullmatch(t.name)
        if split:
            halves = kv_b_halves.setdefault(split[1], {})
            half = gguf_tensor(gf, t)
            assert isinstance(half, torch.Tensor)
            halves[split[2]] = half
            if len(halves) == 2:
                yield (f"model.layers.{split[1]}.self_attn.kv_b_proj.weight",
                       _join_kv_b(halves["k"], halves["v"]))
                del kv_b_halves[split[1]]
            continue
        name = _gguf_to_hf(t.name, arch)
        if name is None:
            raise ModelLoadError(f"unknown GGUF tensor {t.name!r} in {ckpt.path}",
                                 hint="this GGUF has tensors kiln's Llama-family model lacks")
        linear = name.endswith("proj.weight") or name == "lm_head.weight"
        blocks: Collection[str] = ()
        if keep_4bit and expert_blocks and ".experts." in name:
            blocks = Q4_TYPES
        elif keep_blocks and linear and ".experts." not in name:
            # Q4_0/Q4_1 too: unpacking their codes in PyTorch and packing them again took ~8 s
            # of a 14 B-parameter MoE model's 17 s second start (0.7 GB of attention and shared
            # experts), where ops.pack_q4_blocks moves the file's bytes once
            blocks = (*KQUANT_TYPES, *Q4_TYPES) if keep_4bit else tuple(KQUANT_TYPES)
        elif keep_blocks and name.endswith("embed_tokens.weight"):
            # a tied embedding is the head too: kept as blocks only where kq_linear reads them
            # (SmolLM2's Q8_0; see kiln.layers.quant.apply._quantize_head)
            blocks = KQUANT_TYPES if cfg.tie_word_embeddings else EMBED_TYPES
        tensor = gguf_tensor(gf, t, keep_4bit=keep_4bit and linear, keep_blocks=blocks)
        if name == "rope_freqs":
            yield name, tensor
            continue
        if arch in _GGUF_NORM_SHIFT and name.endswith("norm.weight"):
            assert isinstance(tensor, torch.Tensor)
            tensor = tensor.float() - 1.0
        if arch in _GGUF_PERMUTED_QK:
            heads = (cfg.num_attention_heads if name.endswith("q_proj.weight")
                     else cfg.num_key_value_heads if name.endswith("k_proj.weight") else None)
            if heads is not None:
                if isinstance(tensor, GroupQuant | GGUFBlocks):
                    tensor = tensor.permute_rows(lambda x, h=heads: _unpermute(x, h))
                else:
                    tensor = _unpermute(tensor, heads)
        yield name, tensor


def _gguf_to_hf(name: str, arch: str = "llama") -> str | None:
    if name in _GGUF_TOP:
        return _GGUF_TOP[name]
    if name == "rope_freqs.weight":
        return "rope_freqs"
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m:
        layer = _GGUF_ARCH_LAYER.get(arch, {}).get(m.group(2)) or _GGUF_LAYER.get(m.group(2))
        if layer:
            return f"model.layers.{m.group(1)}.{layer}"
    return None


def _join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """llama.cpp's attn_k_b [H, r, nope] and attn_v_b [H, v, r] -> HF's kv_b_proj weight
    [H * (nope + v), r] (per head: the nope rows, then the v rows)."""
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1])


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's convert permute: rows (head, pair, half) -> (head, half, pair)."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


# --------------------------------------------------------------------------- building


def build_model(ckpt: Checkpoint, *, dtype: torch.dtype, device: torch.device | str,
                max_positions: int, progress: ProgressFn | None = None,
                quant: QuantConfig | None = None,
                experts_device: torch.device | str | None = None,
                tiles: Any = None) -> torch.nn.Module:
    """The model with its weights loaded, stored and run as `quant` decides (EngineConfig's
    quantization group, one object; None: unquantized, the table's kernel defaults). With
    `quant.method` ("int8" | "int4") its linear layers are swapped for quantized ones
    (`kiln.layers.quant.apply.quantize_model`); GGUF 4-bit blocks then go straight into them, never
    through a dense copy (`quant.dense_weights` adds one afterwards, made from the quantized weight,
    for large steps). On CPU, bf16 linear layers left dense are packed for oneDNN
    (`kiln.layers.linear.pack_linears`). With `quant.gguf_kernels` (and kiln's GGUF-block kernels
    built here), Q8_0/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K matrices are not re-quantized: they stay the file's
    blocks (`kiln.layers.quant.gguf_blocks.KQuantLinear`). `tiles`: a kiln.layers.tile_cache.TileCache
    whose stacks the MoE experts map instead of packing, where it has them."""
    from kiln.models.architectures import model_class

    cls = model_class(ckpt.config.architecture)
    with torch.device("meta"):
        model = cls(ckpt.config, max_positions).to(dtype)  # cast while it costs nothing
    _materialize(model, device, experts_device)
    for rotary in model.rotary_embeddings():
        rotary.build(device=device)
    quant = quant or QuantConfig()
    quantization, cpu_kernels = quant.method, quant.cpu_kernels
    keep_blocks = (quantization != "none" and quant.gguf_kernels and cpu_kernels
                   and ckpt.format == "gguf" and torch.device(device).type == "cpu")
    if keep_blocks:
        from kiln.layers.kernels.choose import choose_linear_kernel

        # the shape does not matter: kq_linear takes every GGUF matrix where it runs at all
        keep_blocks = choose_linear_kernel("gguf", torch.device(device), 0, 0,
                                           use_kernels=cpu_kernels).kiln
    load_weights(model, ckpt, progress=progress, keep_4bit=quantization != "none",
                 keep_blocks=keep_blocks, tiles=tiles,
                 quantize_experts=(quantization, cpu_kernels) if quantization != "none" else None)
    if quantization != "none":
        from kiln.layers.quant.apply import quantize_model

        quantize_model(model, quantization, keep_dense=quant.dense_weights,
                       use_kernels=cpu_kernels,
                       release_source=ckpt.release_pages if ckpt.format == "gguf" else None)
    if torch.device(device).type == "cpu":
        from kiln.layers.linear import pack_linears

        pack_linears(model)  # bf16 layers left dense: ~2x faster GEMMs at 4-16 rows
        if cpu_kernels:
            from kiln.layers.kernels import ops

            ops.use_elementwise_kernels(model, dtype)
    model.eval()
    return model


def _materialize(model: torch.nn.Module, device: torch.device | str,
                 experts_device: torch.device | str | None = None) -> None:
    """Meta parameters/buffers -> uninitialized ones on `device` (what `to_empty` does, without
    its trip through torch's reference ops, which imports sympy: ~2 s of startup); MoE experts
    on `experts_device` where given (split experts load into host memory)."""
    for module in model.modules():
        where = experts_device if experts_device is not None and \
            isinstance(module, Experts) else device
        for name, p in list(module._parameters.items()):
            if p is not None and p.device.type == "meta":
                module._parameters[name] = torch.nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device=where),
                    requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None and b.device.type == "meta":
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=where)


def load_weights(model: torch.nn.Module, ckpt: Checkpoint,
                 progress: ProgressFn | None = None, keep_4bit: bool = False,
                 quantize_experts: tuple[str, bool] | None = None,
                 keep_blocks: bool = False, tiles: Any = None) -> None:
    """Fills every parameter from the checkpoint. With `keep_4bit`, GGUF 4-bit matrices are
    handed to their module's `stash_quantized` (a quantization pass must follow: see
    `kiln.layers.linear.Linear`). With `quantize_experts` (mode, use CPU kernels), each layer's
    experts are quantized as soon as all their tensors are in: the experts are most of a MoE
    model, and holding every layer's stashed blocks (one byte per 4-bit code) or dense weights
    until the end would need several times the quantized model's memory. `tiles`: the tile
    cache the experts map their packed stacks from (build_model)."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    for module in modules.values():
        if isinstance(module, Experts):
            module.tile_cache = tiles
    packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules", {})
    expected: set[tuple[str, str | None]] = set()
    for pname in params:
        mod_name, _, leaf = pname.rpartition(".")
        shards = getattr(modules.get(mod_name), "shards", None)
        if shards:
            expected.update((pname, s) for s in shards)
        else:
            expected.add((pname, None))
    for mod_name, module in modules.items():
        if isinstance(module, Experts):  # completeness per expert and part
            expected -= {(f"{mod_name}.gate_up_proj", None), (f"{mod_name}.down_proj", None)}
            expected.update((mod_name, key) for key in module.expected_parts())
    loaded: set[tuple[str, str | None]] = set()
    experts_loaded: dict[str, set[str]] = {}  # Experts module -> its parts loaded so far
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    # checkpoint name fragment -> ours, for families whose HF names differ from our modules'
    renames: tuple[tuple[str, str], ...] = getattr(model, "checkpoint_renames", ())
    # name -> True for checkpoint tensors the family does not run (DeepSeek-V3's MTP layer)
    skip: Callable[[str], bool] | None = getattr(model, "skip_checkpoint_tensor", None)
    names_total = _count_tensors(ckpt) if progress is not None else 0
    # Experts that pack GGUF 4-bit blocks straight into their tiles get the file's blocks
    expert_blocks = quantize_experts is not None and bool(getattr(Experts, "takes_q4_blocks",
                                                                  False))
    for i, (name, tensor) in enumerate(iter_tensors(ckpt, keep_4bit=keep_4bit,
                                                    keep_blocks=keep_blocks,
                                                    expert_blocks=expert_blocks)):
        if progress is not None:
            progress(i + 1, names_total)
        if name == "rope_freqs":
            assert isinstance(tensor, torch.Tensor)
            for rotary in model.rotary_embeddings():
                rotary.build(freq_factors=tensor)
            continue
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight") or \
                (skip is not None and skip(name)):
            continue
        for old, new in renames:
            name = name.replace(old, new)
        m = _EXPERT.fullmatch(name)
        if m and isinstance(modules.get(m["module"]), Experts):
            experts: Experts = modules[m["module"]]
            part = _EXPERT_PART[m["proj"]]
            expert = int(m["expert"]) if m["expert"] is not None else None
            with torch.no_grad():
                if isinstance(tensor, GroupQuant | GGUFBlocks):
                    experts.stash_quantized(part, expert, tensor)
                else:
                    experts.load(part, expert, tensor)
            keys = experts.parts_loaded(part, expert)
            loaded.update((m["module"], key) for key in keys)
            done = experts_loaded.setdefault(m["module"], set())
            done.update(keys)
            if quantize_experts is not None and not experts.is_quantized and \
                    len(done) == len(experts.expected_parts()):
                experts.quantize(*quantize_experts)
                # The layer's file pages (its blocks, read while packing) go back now, not at
                # the end: a model's whole file would otherwise sit in RSS beside its packed
                # weights at the peak (7.3 of 17.2 GB for the full-size Qwen1.5-MoE-shaped
                # model). Pages still needed are read again from the page cache.
                ckpt.release_pages()
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
        if isinstance(tensor, GGUFBlocks) and isinstance(module, torch.nn.Embedding):
            # the embedding keeps the file's blocks and dequantizes the rows it looks up
            owner = modules[parent] if parent else model
            embedding = BlockEmbedding(tensor, param.dtype)
            setattr(owner, child, embedding)
            if tied:  # the head reads the same blocks (the quantization pass makes it a kernel)
                model.lm_head = TiedLMHead(embedding)
            loaded.add((pname, None))
            continue
        with torch.no_grad():
            if isinstance(tensor, GroupQuant | GGUFBlocks) and \
                    hasattr(module, "stash_quantized") and leaf == "weight":
                module.stash_quantized(shard, tensor)
            else:
                if isinstance(tensor, GroupQuant | GGUFBlocks):
                    tensor = tensor.dequantize()
                if shard is not None:
                    module.load_shard(param, shard, tensor.to(param.dtype))
                else:
                    if tuple(param.shape) != tuple(tensor.shape) and \
                            param.numel() == tensor.numel() and param.dim() <= 2:
                        tensor = tensor.reshape(param.shape)  # GGUF's [H] for HF's [1, H]
                    if tuple(param.shape) != tuple(tensor.shape):
                        raise ModelLoadError(
                            f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                            f"the model expects {tuple(param.shape)}")
                    param.data.copy_(tensor.to(param.dtype))
        shards = getattr(module, "shards", None)
        if shard is None and shards:
            # a checkpoint that stores the packed matrix itself (Phi-3's qkv_proj / gate_up_proj)
            loaded.update((pname, s) for s in shards)
        else:
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
    n = 0
    for f in ckpt.files:
        with open_safetensors(f) as sf:
            n += len(list(sf.keys()))
    return n
