"""DeepSeek-V2 and V3: multi-head latent attention (MLA) with the latent in the paged KV cache,
and a MoE block of routed plus shared experts after the first `first_k_dense_replace` layers.

Attention, per token (H heads; r = kv_lora_rank, n = qk_nope_head_dim, p = qk_rope_head_dim,
v = v_head_dim):

    q          = q_b_proj(q_a_layernorm(q_a_proj(x)))  (or q_proj(x))      [H, n + p]
    c, k_pe    = kv_a_proj_with_mqa(x) split [r | p];  c = kv_a_layernorm(c)
    q_pe, k_pe = RoPE(q_pe), RoPE(k_pe)         (interleaved pairs: `rope_interleave`)
    kv_b_proj  = [H, n + v, r] = per head [W_uk (n x r); W_uv (v x r)]

HF expands every cached c into per-head keys and values (k_nope = W_uk c, v = W_uv c). kiln
keeps the weights absorbed instead, as DeepSeek's paper and vLLM's MLA backend do:

    q_lat[h]   = q_nope[h] W_uk[h]                                          [H, r]
    score      = q_lat[h] . c + q_pe[h] . k_pe   = q_nope[h] . k_nope[h] + q_pe[h] . k_pe
    o_lat[h]   = sum_j softmax(score)_j c_j                                 [H, r]
    o[h]       = W_uv[h] o_lat[h]                                           [H, v]  -> o_proj

So attention is MQA with one KV head over the latent row [c | k_pe] (r + p wide), whose values are
its first r columns: the KV pool stores that one row per token and layer, and V is a view of it
(`Attention(v_in_k=True)`). The softmax scale is HF's: (n + p) ** -0.5, times yarn's
mscale(factor, mscale_all_dim) ** 2 under yarn scaling.

`kv_b_proj` is only ever used through its per-head blocks, so it is not a `Linear`: on kiln's
int4 kernels the quantization pass stores W_uk^T and W_uv as per-head 4-bit tiles (`heads_q4`,
lossless for a GGUF's Q4_0 attn_k_b / attn_v_b), elsewhere it stays dense for batched matmuls.
Everything else quantizes as in the Llama family.

Routing (`kiln.layers.router.grouped_topk`): V2 softmax scores with `greedy` or
`group_limited_greedy` top-k; V3 sigmoid scores with `e_score_correction_bias` shifting the
selection (`noaux_tc`), renormalised (`norm_topk_prob`); both scaled by `routed_scaling_factor`.
The shared experts (`mlp.shared_experts`, n_shared * moe_intermediate_size wide) are one SwiGLU
added to every token.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from kiln.layers import lora
from kiln.layers.attention import Attention, KVStore, get_context
from kiln.layers.kernels import ops
from kiln.layers.linear import Linear
from kiln.layers.moe import Experts
from kiln.layers.norm import RMSNorm
from kiln.layers.rotary import RotaryEmbedding, apply_rotary
from kiln.layers.router import Router, grouped_topk
from kiln.models.config import ModelConfig
from kiln.models.llama import (
    DECODE_KERNEL_ANY_ROWS,
    PACKED,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)

# grouped_topk's `method` as mla.cpp's MlaLayer takes it (any other: a group scored by its best)
_ROUTING = {"greedy": 0, "noaux_tc": 2}
# HF (and DeepSeek's reference) build q_a_layernorm and kv_a_layernorm with RMSNorm's default
# eps, not the config's rms_norm_eps.
_LATENT_NORM_EPS = 1e-6
_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def softmax_scale(cfg: ModelConfig) -> float:
    """HF's `yarn_apply_mscale`: qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2
    when the rope is scaled and mscale_all_dim is set."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type") or rs.get("type") or "default"
    m_all = float(rs.get("mscale_all_dim") or 0)
    factor = float(rs.get("factor") or 1.0)
    if kind != "default" and m_all and factor > 1:
        m = 0.1 * m_all * math.log(factor) + 1.0
        scale *= m * m
    return scale


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor,
                             sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE over adjacent pairs (x0, x1), (x2, x3), ... (DeepSeek's layout), with the tables of
    `RotaryEmbedding.lookup` (whose first half holds each pair's angle, sin negated). The result
    comes out de-interleaved ([rotated evens | rotated odds], as HF's
    apply_rotary_pos_emb_interleave returns it): q and k get the same permutation, so their dot
    products are those of the interleaved form."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], -sin_signed[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class LatentUpProj(nn.Module):
    """kv_b_proj's weight [H * (n + v), r], read per head as W_uk [H, n, r] and W_uv [H, v, r]
    (views, no copies); after `quantize_weights` on kiln's int4 kernels, W_uk^T and W_uv as
    per-head 4-bit tiles instead (`heads_q4`), the dense weight dropped."""

    def __init__(self, num_heads: int, nope_dim: int, v_dim: int, rank: int) -> None:
        super().__init__()
        self.num_heads, self.nope_dim, self.v_dim, self.rank = num_heads, nope_dim, v_dim, rank
        self.weight = nn.Parameter(torch.empty(num_heads * (nope_dim + v_dim), rank),
                                   requires_grad=False)
        # heads_q4's stacked tiles: W_uk^T [H, r, n] and W_uv [H, v, r] (None: dense)
        self.uk_q4: torch.Tensor | None = None
        self.uv_q4: torch.Tensor | None = None

    def parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.uk_q4 is not None:  # dequantized (tests, inspection)
            return self._dequantized()
        w = self.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def quantize_weights(self, mode: str, use_kernels: bool = True) -> None:
        """int4 where kiln's q4 kernel runs (else the weight stays dense for the batched
        matmuls): per head, W_uk^T [r, n] and W_uv [v, r] in Q4_0's form, packed for heads_q4,
        their groups along the dimension each product sums over, the dense fp32 weight dropped
        (a batched fp32 matmul read 8x the bytes). Q4_0's form because llama.cpp's GGUFs store
        exactly these two (attn_k_b, attn_v_b) as Q4_0 blocks along the same dimensions: the
        loader's dequantized, joined kv_b_proj comes back to the file's codes and scales."""
        from kiln.layers.kernels import reference
        from kiln.layers.kernels.choose import choose_linear_kernel
        from kiln.layers.quant.linear import quantize_q4_0_groups

        if mode != "int4" or self.uk_q4 is not None or self.nope_dim % 32 or self.rank % 32:
            return
        if choose_linear_kernel("int4", self.weight.device, self.rank, self.nope_dim,
                                use_kernels=use_kernels).kernel != "q4":
            return
        w_uk, w_uv = self.parts()

        def stacked(w: torch.Tensor) -> torch.Tensor:  # [H, rows, K] -> [H, rows/8, K/32, 160]
            tiles = []
            for h in range(self.num_heads):
                gq = quantize_q4_0_groups(w[h])
                tiles.append(reference.pack_q4(gq.q, gq.scale, gq.min))
            return torch.stack(tiles)

        with torch.no_grad():
            self.uk_q4 = stacked(w_uk.transpose(1, 2).float())
            self.uv_q4 = stacked(w_uv.float())
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def _dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        from kiln.layers.kernels import reference
        from kiln.layers.kernels.formats import GroupQuant

        assert self.uk_q4 is not None and self.uv_q4 is not None
        uk = torch.stack([GroupQuant(*reference.unpack_q4(t, self.rank)).dequantize()
                          for t in self.uk_q4])
        uv = torch.stack([GroupQuant(*reference.unpack_q4(t, self.v_dim)).dequantize()
                          for t in self.uv_q4])
        return uk.transpose(1, 2), uv

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, nope={self.nope_dim}, v={self.v_dim}, "
                f"rank={self.rank}{', int4 tiles' if self.uk_q4 is not None else ''}")


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        h = cfg.num_attention_heads
        self.num_heads = h
        self.nope_dim, self.rope_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_dim, self.rank = cfg.v_head_dim, cfg.kv_lora_rank
        qk = self.nope_dim + self.rope_dim
        self.q_lora = cfg.q_lora_rank > 0
        if self.q_lora:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = Linear(cfg.q_lora_rank, h * qk)
        else:
            self.q_proj = Linear(cfg.hidden_size, h * qk)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, self.rank + self.rope_dim,
                                         bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, _LATENT_NORM_EPS)
        self.kv_b_proj = LatentUpProj(h, self.nope_dim, self.v_dim, self.rank)
        self.o_proj = Linear(h * self.v_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.rotary = rotary  # shared by all layers; not a child module's parameter
        self.rope = apply_rotary_interleaved if cfg.rope_interleave else apply_rotary
        # MQA over the latent row [c | k_pe]; values are its first `rank` columns.
        self.attn = Attention(h, 1, self.rank + self.rope_dim, scale=softmax_scale(cfg),
                              v_head_dim=self.rank, v_in_k=True)

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """cos, sin: [T, 1, qk_rope_head_dim] from `RotaryEmbedding.lookup` (sin signed)."""
        t, h, n = x.shape[0], self.num_heads, self.nope_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(t, h, n + self.rope_dim)
        ckv = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(ckv[:, :self.rank])
        k_pe = self.rope(ckv[:, self.rank:].view(t, 1, self.rope_dim), cos, sin)
        q_pe = self.rope(q[..., n:], cos, sin)
        up = self.kv_b_proj
        tiles = up.uk_q4 is not None and q.dtype == torch.float32  # per-head int4 tiles
        if tiles:
            q_lat = ops.heads_q4(q[..., :n], up.uk_q4, self.rank)  # [T, H, r]
        else:
            w_uk, w_uv = up.parts()
            q_lat = torch.bmm(q[..., :n].transpose(0, 1), w_uk.to(q.dtype)).transpose(0, 1)
        q_full = torch.cat([q_lat, q_pe], dim=-1)  # [T, H, r + p]
        latent = torch.cat([c.unsqueeze(1), k_pe], dim=-1)  # [T, 1, r + p]
        o_lat = self.attn(q_full, latent, None).view(t, h, self.rank)
        if tiles:
            o = ops.heads_q4(o_lat.float(), up.uv_q4, self.v_dim)  # [T, H, v]
        else:
            o = torch.bmm(o_lat.transpose(0, 1), w_uv.to(o_lat.dtype).transpose(1, 2))
            o = o.transpose(0, 1)
        return self.o_proj(o.reshape(t, h * self.v_dim))


class DeepseekMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.cfg = cfg
        self.gate = Router(cfg.hidden_size, cfg.num_experts,
                           correction_bias=cfg.topk_method == "noaux_tc", keep_fp32=True)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                               layer)
        self.shared_experts = (LlamaMLP(cfg, cfg.shared_expert_intermediate_size)
                               if cfg.shared_expert_intermediate_size else None)
        if self.shared_experts is not None:
            self.experts.keep_slots_for_shared(cfg.shared_expert_intermediate_size)

    def fuse_shared_expert(self) -> bool:
        """The shared experts into the stacked experts (Experts.absorb_shared: one moe_q4 call
        runs routed and shared rows); where they cannot take them, nothing changes."""
        if self.shared_experts is None or type(self.experts) is not Experts or \
                not self.experts.absorb_shared(self.shared_experts.gate_up_proj,
                                               self.shared_experts.down_proj):
            return False
        self.shared_experts = None
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        weights, ids = grouped_topk(
            self.gate(x), self.top_k, n_group=c.n_group, topk_group=c.topk_group,
            scoring=c.scoring_func, bias=self.gate.e_score_correction_bias,
            renormalize=c.norm_topk_prob, scale=c.routed_scaling_factor, method=c.topk_method)
        y = self.experts(x, weights.to(x.dtype), ids)  # (+ the shared experts, once absorbed)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (DeepseekMoE(cfg, layer) if cfg.is_moe_layer(layer)
                               else LlamaMLP(cfg))
        # mla.cpp's MlaLayer of this layer (_mla_kernel), and what it was built on
        self._mla: tuple[tuple, object | None] | None = None

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(cos, sin, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode_kernel_rows(self) -> int:
        """Any row count where the whole layer runs as one call of mla.cpp's mla_layer (see
        `_mla_kernel`), else 0 (the runner's rule, as for LlamaDecoderLayer)."""
        return DECODE_KERNEL_ANY_ROWS if self._mla_kernel() is not None else 0

    def forward_decode_kernel(self, cos: torch.Tensor, sin: torch.Tensor,
                              x: torch.Tensor) -> torch.Tensor:
        """`forward` for a whole step (decode rows, prefill chunks) as one kernel call: each row
        from its own row alone (batch-invariant). A step with LoRA rows runs `forward`."""
        if lora.step_active():
            return self.forward(cos, sin, x)
        meta = get_context()
        layer = self._mla_kernel()
        assert layer is not None and meta.step_rows is not None
        return ops.mla_layer(x, cos, sin, layer, meta.slot_mapping, *meta.step_rows)

    def mla_watch(self) -> tuple[Attention, Experts | None]:
        """What `_mla_kernel`'s MlaLayer is built on that the runner may replace: the attention
        (its KV store, `.kv`) and the stacked experts (their `tokens_per_expert`)."""
        mlp = self.mlp
        return self.self_attn.attn, (mlp.experts if isinstance(mlp, DeepseekMoE) else None)

    def _mla_kernel(self) -> object | None:
        """This layer as mla.cpp's MlaLayer, gathered once (rebuilt when its KV store or routing
        counters are replaced: the runner swaps in scratch pools to profile), or None where the
        one call cannot run it: an fp32 model on kiln's CPU kernels whose linears are q4 tiles
        or GGUF blocks, kv_b_proj on per-head tiles, a latent pool attend_rows reads, and a
        SiLU MLP or a MoE block whose stacked experts took the shared ones."""
        attn, experts = self.mla_watch()
        kv = attn.kv
        key = (kv, None if experts is None else experts.tokens_per_expert)
        if self._mla is not None and all(a is b for a, b in zip(key, self._mla[0])):
            return self._mla[1]
        self._mla = (key, self._build_mla(kv, experts))
        return self._mla[1]

    def _build_mla(self, kv: KVStore | None, experts: Experts | None) -> object | None:
        attn, mlp, up = self.self_attn, self.mlp, self.self_attn.kv_b_proj
        norms = [self.input_layernorm, self.post_attention_layernorm, attn.kv_a_layernorm]
        linears = [attn.q_a_proj, attn.q_b_proj] if attn.q_lora else [attn.q_proj]
        linears += [attn.kv_a_proj_with_mqa, attn.o_proj]
        if attn.q_lora:
            norms.append(attn.q_a_layernorm)
        if isinstance(mlp, LlamaMLP):
            ok = mlp.act is torch.nn.functional.silu and mlp.intermediate_size % 16 == 0
            linears += [mlp.gate_up_proj, mlp.down_proj]
        else:
            ok = (experts is not None and type(experts) is Experts and mlp.shared_experts is None
                  and experts.w13_q4 is not None and experts.counts_routing
                  and mlp.gate.weight.dtype == torch.float32)
        ok = (ok and kv is not None and kv.invariant and kv.v_in_k
              and kv.k.dtype in (torch.float32, torch.float16) and up.uk_q4 is not None
              and attn.attn.sliding_window is None
              and all(n.weight.dtype == torch.float32 and n.weight.shape[0] % 8 == 0
                      for n in norms))
        parts = LlamaDecoderLayer._kernel_parts(tuple(linears)) if ok else None
        if parts is None:
            return None
        none = torch.empty(0)
        layer = ops.mla_layer_object()
        layer.attention(
            self.input_layernorm.weight, self.post_attention_layernorm.weight,
            self.input_layernorm.eps, attn.q_a_layernorm.weight if attn.q_lora else none,
            attn.kv_a_layernorm.weight, attn.kv_a_layernorm.eps, *parts,
            [lin.bias if lin.bias is not None else none for lin in linears], up.uk_q4, up.uv_q4,
            attn.num_heads, attn.nope_dim, attn.rope_dim, attn.v_dim,
            attn.rope is apply_rotary_interleaved, kv.k, kv.v, attn.attn.scale)
        if experts is not None:
            c, bias = mlp.cfg, mlp.gate.e_score_correction_bias
            groups = max(1, c.n_group or 1)
            layer.moe(mlp.gate.weight, none if bias is None else bias.float(), mlp.top_k,
                      groups, min(groups, max(1, c.topk_group or 1)),
                      _ROUTING.get(c.topk_method, 1),
                      c.scoring_func == "sigmoid", c.norm_topk_prob,
                      float(c.routed_scaling_factor), experts.w13_q4, experts.w2_q4,
                      experts.num_shared, experts.tokens_per_expert)
        return layer


# Only gate/up are packed: q_proj (V2-Lite) is MLA's own, not part of a qkv_proj.
_PACKED = {k: v for k, v in PACKED.items() if k in ("gate_proj", "up_proj")}


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    packed_modules = _PACKED
    # GGUF's ffn_*_shexp map to Qwen2-MoE's singular name; DeepSeek's is plural.
    checkpoint_renames = ((".mlp.shared_expert.", ".mlp.shared_experts."),)

    def make_layer(self, layer: int, rotary: RotaryEmbedding) -> nn.Module:  # type: ignore[override]
        return DeepseekDecoderLayer(self.config, rotary, layer)

    def skip_checkpoint_tensor(self, name: str) -> bool:
        """V3 checkpoints carry the multi-token-prediction module as layers past
        num_hidden_layers (`model.layers.61.*`); kiln does not draft with it."""
        m = _LAYER_INDEX.match(name)
        return m is not None and int(m[1]) >= self.config.num_hidden_layers


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V3 differs in config only (sigmoid scores, correction bias, noaux_tc), which ModelConfig
    carries."""
