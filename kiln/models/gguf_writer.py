"""Hugging Face-named tensors -> one GGUF file with llama.cpp's tensor names and metadata keys.

The inverse of the loader's name tables (kiln/models/loader.py), so there is one list of names:
tests write the GGUF twins of their tiny transformers models with it, and benchmarks/moe_model.py
writes its benchmark model, which llama-server must load (the check that the names, shapes and
keys are llama.cpp's). Per-expert tensors are stacked into `ffn_*_exps` [E, rows, in]; Llama and
Mixtral's Q/K rows are permuted the way llama.cpp's converter does; matrices are stored as
`qtype` (F32, F16, Q8_0, Q4_0, Q4_1: the `gguf` package quantizes), norms, biases and routers
as F32, as llama-quantize leaves them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from kiln.models.config import GGUF_ARCH, ModelConfig
from kiln.models.loader import (
    _EXPERT,
    _EXPERT_PART,
    _GGUF_ARCH_LAYER,
    _GGUF_LAYER,
    _GGUF_NORM_SHIFT,
    _GGUF_PERMUTED_QK,
    _GGUF_TOP,
)

# HF architecture -> GGUF general.architecture
GGUF_ARCH_OF = {hf: name for name, hf in GGUF_ARCH.items()}
GGUF_ARCH_OF.update({"MixtralForCausalLM": "llama", "DeepseekV3ForCausalLM": "deepseek2"})
# Tensors llama-quantize keeps in F32 whatever the file type (routers, norms, biases).
_KEEP_F32 = ("ffn_gate_inp", "norm", "exp_probs_b")


def _file_types() -> dict[str, int]:
    import gguf

    t = gguf.LlamaFileType
    return {"F32": t.ALL_F32, "F16": t.MOSTLY_F16, "Q8_0": t.MOSTLY_Q8_0, "Q4_0": t.MOSTLY_Q4_0,
            "Q4_1": t.MOSTLY_Q4_1}


# The loader's tables, inverted: HF name -> llama.cpp name.
_TOP = {hf: name for name, hf in _GGUF_TOP.items()}
_LAYER = {hf: name for name, hf in _GGUF_LAYER.items()}
_ARCH_LAYER = {arch: {hf: name for name, hf in table.items()}
               for arch, table in _GGUF_ARCH_LAYER.items()}


def gguf_name(hf_name: str, arch: str = "llama") -> str | None:
    """The llama.cpp name of an HF tensor name in a GGUF of `arch` (None: not a tensor
    llama.cpp stores)."""
    if hf_name in _TOP:
        return _TOP[hf_name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    if not m:
        return None
    rest = m.group(2).replace("block_sparse_moe.", "mlp.").replace("shared_experts.",
                                                                    "shared_expert.")
    name = _ARCH_LAYER.get(arch, {}).get(rest) or _LAYER.get(rest)
    return f"blk.{m.group(1)}.{name}" if name else None


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert permute for Llama's Q/K rows: (head, half, pair) -> (head, pair, half)."""
    rows = w.shape[0]
    return (w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(path: str | Path, cfg: ModelConfig,
               tensors: Iterable[tuple[str, torch.Tensor | np.ndarray]], *, qtype: str = "F32",
               tokenizer_from: str | Path | None = None, name: str = "kiln-test",
               stream: bool = False) -> Path:
    """Writes `tensors` (HF names, or llama.cpp's own `blk.N...` names; torch layout) as a GGUF
    of `cfg`'s architecture. A uint8 numpy array is taken as blocks already in `qtype`.
    `tokenizer_from`: a GGUF whose `tokenizer.*` keys (vocabulary, merges, chat template) are
    copied, so the file can be served; without it the file has no tokenizer. `stream`: each
    tensor goes to a temporary file as it comes (the header, written first, needs every
    tensor's size), so a model larger than memory can be written from a generator."""
    import gguf

    path = Path(path)
    arch = GGUF_ARCH_OF[cfg.architecture]
    writer = gguf.GGUFWriter(str(path), arch, use_temp_file=stream)
    # The copied tokenizer brings its own special token ids.
    _write_metadata(writer, cfg, arch, name, special_ids=tokenizer_from is None)
    writer.add_file_type(_file_types()[qtype])
    if tokenizer_from is not None:
        _copy_tokenizer(writer, Path(tokenizer_from))
    qt = gguf.GGMLQuantizationType[qtype]
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}

    def add(gname: str, t: torch.Tensor | np.ndarray) -> None:
        if isinstance(t, np.ndarray) and t.dtype == np.uint8:
            writer.add_tensor(gname, t, raw_dtype=qt)
            return
        arr = torch.as_tensor(t).detach().float().contiguous().numpy()
        keep = gname.endswith(".bias") or any(k in gname for k in _KEEP_F32) or arr.ndim == 1
        if keep or qt == gguf.GGMLQuantizationType.F32 or arr.shape[-1] % 32:
            writer.add_tensor(gname, arr.astype(np.float32))
        elif qt == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gname, arr.astype(np.float16))
        else:
            writer.add_tensor(gname, gguf.quants.quantize(arr, qt), raw_dtype=qt)

    for hf, t in tensors:
        if hf.startswith("blk.") or hf in _GGUF_TOP:
            add(hf, t)  # already llama.cpp's name
            continue
        m = _EXPERT.fullmatch(hf)  # the loader's pattern: per-expert tensors are stacked below
        if m and m["expert"] is not None:
            layer = int(m["module"].split(".")[2])  # model.layers.N.<block>.experts
            experts.setdefault((layer, _EXPERT_PART[m["proj"]]), {})[int(m["expert"])] = t
            continue
        gname = gguf_name(hf, arch)
        if gname is None:
            if hf.endswith("rotary_emb.inv_freq"):
                continue
            raise ValueError(f"no GGUF name for {hf!r}")
        if arch in _GGUF_NORM_SHIFT and gname.endswith("norm.weight"):
            t = torch.as_tensor(t).float() + 1.0  # llama.cpp's Gemma norms hold 1 + w
        if arch in _GGUF_PERMUTED_QK and gname.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_attention_heads if "attn_q" in gname else cfg.num_key_value_heads
            t = _permute(t, heads)
        if gname == "output.weight" and cfg.tie_word_embeddings:
            continue
        if gname.endswith("ffn_gate_inp_shexp.weight"):
            t = t.reshape(-1)  # HF's [1, H] is llama.cpp's {n_embd}
        add(gname, t)
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "longrope":  # llama.cpp keeps the factors as tensors
        add("rope_factors_long.weight", torch.tensor(scaling["long_factor"]))
        add("rope_factors_short.weight", torch.tensor(scaling["short_factor"]))
    for (layer, part), per_expert in sorted(experts.items()):
        stacked = torch.stack([per_expert[e] for e in range(len(per_expert))])
        add(f"blk.{layer}.ffn_{part}_exps.weight", stacked)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_metadata(w: object, cfg: ModelConfig, arch: str, name: str,
                    special_ids: bool) -> None:
    import gguf

    assert isinstance(w, gguf.GGUFWriter)
    w.add_name(name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    # MLA is written in llama.cpp's MQA form: one KV head, the latent row [c | k_pe] as its key
    w.add_head_count_kv(1 if cfg.is_mla else cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    if not cfg.is_mla:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    else:  # what convert_hf_to_gguf.py writes for deepseek2 (the attn_k_b / attn_v_b form)
        if cfg.q_lora_rank:
            w.add_q_lora_rank(cfg.q_lora_rank)
        w.add_kv_lora_rank(cfg.kv_lora_rank)
        w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        w.add_value_length_mla(cfg.v_head_dim)
    w.add_rope_dimension_count(cfg.rotary_dim)
    _write_dense_metadata(w, cfg, arch)
    if cfg.is_moe:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if arch != "llama":  # Mixtral's experts are feed_forward_length wide
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if cfg.shared_expert_intermediate_size and arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
        if arch == "deepseek2":
            w.add_expert_weights_norm(cfg.norm_topk_prob)
            w.add_expert_weights_scale(cfg.routed_scaling_factor)
            w.add_leading_dense_block_count(next(
                i for i in range(cfg.num_hidden_layers + 1) if i not in cfg.dense_layers))
            w.add_expert_shared_count(cfg.shared_expert_intermediate_size
                                      // cfg.moe_intermediate_size)
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID
                                     if cfg.scoring_func == "sigmoid"
                                     else gguf.ExpertGatingFuncType.SOFTMAX)
            if cfg.n_group > 1:
                w.add_expert_group_count(cfg.n_group)
                w.add_expert_group_used_count(cfg.topk_group)
    if special_ids and cfg.bos_token_id is not None:
        w.add_bos_token_id(cfg.bos_token_id)
    if special_ids and cfg.eos_token_ids:
        w.add_eos_token_id(cfg.eos_token_ids[0])


def _write_dense_metadata(w: object, cfg: ModelConfig, arch: str) -> None:
    """The dense families' keys (config.py's `_dense_from_gguf` reads them back)."""
    import gguf

    assert isinstance(w, gguf.GGUFWriter)
    if cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
        if cfg.layer_types is not None:
            w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if cfg.rope_local_theta is not None:
        w.add_rope_freq_base_swa(cfg.rope_local_theta)
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "longrope":
        import math

        orig = int(scaling["original_max_position_embeddings"])
        w.add_rope_scaling_orig_ctx_len(orig)
        factor = float(scaling.get("factor") or cfg.max_position_embeddings / orig)
        w.add_rope_scaling_attn_factors(float(
            scaling.get("attention_factor") or
            (1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig)))))
    if cfg.attention_scale is not None and abs(cfg.attention_scale * cfg.head_dim ** 0.5 - 1) \
            > 1e-7:
        w.add_attention_scale(cfg.attention_scale)
    if cfg.attn_logit_softcapping:
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if cfg.embedding_multiplier != 1.0:
        w.add_embedding_scale(cfg.embedding_multiplier)
    if cfg.residual_multiplier != 1.0:
        w.add_residual_scale(cfg.residual_multiplier)
    if cfg.logits_scaling != 1.0:
        w.add_logit_scale(cfg.logits_scaling)


def _copy_tokenizer(w: object, source: Path) -> None:
    """Copies every `tokenizer.*` key of `source` (the `gguf` package's reader: this runs once
    per written file, and it keeps the arrays' element types)."""
    import gguf

    assert isinstance(w, gguf.GGUFWriter)
    reader = gguf.GGUFReader(str(source))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                vals = [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
            else:
                vals = [field.parts[i][0].item() for i in field.data]
            w.add_key_value(key, vals, vtype, sub_type=sub)
        elif vtype == gguf.GGUFValueType.STRING:
            w.add_key_value(key, bytes(field.parts[-1]).decode("utf-8", "replace"), vtype)
        else:
            w.add_key_value(key, field.parts[-1][0].item(), vtype)
