"""Llama-family decoder: Llama, SmolLM, Mistral, Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm).

Attribute names mirror the Hugging Face checkpoint (`model.layers.N.self_attn...`), except that
q/k/v and gate/up are packed (`PACKED` tells the loader where each checkpoint tensor goes).
`forward(input_ids, positions)` takes the whole step flattened to one dimension; paged attention
reads its metadata from the per-step context. Logits are computed only for the rows asked for,
by `lm_head`, which is always a module (`TiedLMHead` over the embedding when the checkpoint ties
them), so quantization can swap it like any other linear layer.

Numerics follow transformers: RMSNorm in fp32 then cast back, residual adds and RoPE in the
activation dtype with cos/sin cast to it. In fp32 that is transformers' arithmetic; in bf16 the
same casts happen in the same places.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kiln.layers import cpu_kernels
from kiln.layers.attention import Attention, get_context
from kiln.layers.linear import Linear, MergedLinear, TiedLMHead
from kiln.layers.norm import RMSNorm
from kiln.layers.rotary import RotaryEmbedding, apply_rotary
from kiln.models.config import ModelConfig

# checkpoint module name -> (our packed module, shard name)
PACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}

# How the runner may call a decoder layer: (layer, cos, sin, x) -> x.
LayerCall = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# Decode steps of up to this many rows may run a layer as one kernel call (decode_kernel_rows).
DECODE_KERNEL_MAX_ROWS = 64


_NO_SCALE = torch.empty(0)  # decode_layer's scale for a w4 weight


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(
            cfg.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
            bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.rotary = rotary  # shared by all layers; not a child module's parameter
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim)
        self.elementwise_kernel = False  # see RMSNorm.elementwise_kernel

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """cos, sin: [T, 1, head_dim] from `RotaryEmbedding.lookup` (sin signed)."""
        qkv = self.qkv_proj(x)
        kv = self.attn.kv
        if (self.elementwise_kernel and not self.qk_norm and kv is not None and kv.kernel
                and qkv.dtype == torch.bfloat16 and not torch.compiler.is_compiling()):
            return self.o_proj(self.attn(self.attn.rope_write(qkv, cos, sin), None, None))
        t = qkv.shape[0]
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        v = qkv[:, self.q_size + self.kv_size:].view(t, hk, d)
        if self.qk_norm:
            q = self.q_norm(qkv[:, :self.q_size].view(t, hq, d))
            k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size].view(t, hk, d))
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        else:
            # q and k rotated in one pass: the rotation is per head.
            qk = apply_rotary(qkv[:, :self.q_size + self.kv_size].view(t, hq + hk, d), cos, sin)
            q, k = qk[:, :hq], qk[:, hq:]
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        i = intermediate_size or cfg.intermediate_size
        self.intermediate_size = i
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {"gate": i, "up": i}, bias=cfg.mlp_bias)
        self.down_proj = Linear(i, cfg.hidden_size, bias=cfg.mlp_bias)
        self.elementwise_kernel = False  # see RMSNorm.elementwise_kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        if (self.elementwise_kernel and gu.dtype == torch.bfloat16 and gu.shape[1] % 32 == 0
                and not torch.compiler.is_compiling()):
            return self.down_proj(cpu_kernels.silu_mul(gu))
        i = self.intermediate_size
        return self.down_proj(F.silu(gu[:, :i]) * gu[:, i:])


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp if mlp is not None else LlamaMLP(cfg)  # a MoE block in MoE families
        # (weights, w8 scales) for forward_decode_kernel, gathered on its first call.
        self._kernel_weights: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(cos, sin, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode_kernel_rows(self) -> int:
        """Up to how many rows a decode step may run this layer as one call of kiln's CPU
        kernel (`forward_decode_kernel`); 0 where it cannot: q/k norms, biases, a linear not
        in kiln's int4/int8 layouts, a pool the attention kernels do not read. Above a
        linear's dense-copy threshold its dense GEMM is faster, so the kernel stops there."""
        attn, mlp = self.self_attn, self.mlp
        kv = attn.attn.kv
        if attn.qk_norm or kv is None or not kv.kernel or not isinstance(mlp, LlamaMLP):
            return 0
        if self.input_layernorm.weight.dtype != torch.bfloat16:
            return 0
        rows = DECODE_KERNEL_MAX_ROWS
        for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if not getattr(lin, "kiln", False) or lin.bias is not None:
                return 0
            if lin.dense is not None:
                rows = min(rows, lin.dense_min_m - 1)
        return rows

    def forward_decode_kernel(self, cos: torch.Tensor, sin: torch.Tensor,
                              x: torch.Tensor) -> torch.Tensor:
        """`forward` for a decode step (one token per row), as one kernel call: the same math,
        without the ~15 separate ops and their dispatch (see decode_layer in cpu_kernels.cpp)."""
        meta = get_context()
        attn = self.self_attn
        kv = attn.attn.kv
        assert kv is not None and meta.decode_gather is not None and meta.decode_mask is not None
        if self._kernel_weights is None:
            # Int4Linear holds `packed`; Int8Linear its w8 `weight` and row `scales`.
            pairs = [(lin.packed, _NO_SCALE) if hasattr(lin, "packed") else (lin.weight, lin.scales)
                     for lin in (attn.qkv_proj, attn.o_proj, self.mlp.gate_up_proj,
                                 self.mlp.down_proj)]
            self._kernel_weights = ([w for w, _ in pairs], [s for _, s in pairs])
        weights, scales = self._kernel_weights
        return cpu_kernels.decode_layer(
            x, cos, sin, self.input_layernorm.weight, self.post_attention_layernorm.weight,
            self.input_layernorm.eps, weights, scales, kv.k, kv.v, meta.slot_mapping,
            meta.decode_gather, meta.decode_mask.view(x.shape[0], -1), meta.decode_shared,
            attn.num_heads, attn.attn.scale)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int,
                 make_mlp: Callable[[int], nn.Module | None] | None = None,
                 make_layer: Callable[[int, RotaryEmbedding], nn.Module] | None = None) -> None:
        """`make_mlp(i)`: layer i's MLP (None: dense); `make_layer(i, rotary)`: the whole
        decoder layer, for families whose attention differs (DeepSeek's MLA)."""
        super().__init__()
        # `_weight` skips the random init: on the meta device that init alone imports
        # torch._dynamo (~2 s of startup).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.embed_tokens.weight.requires_grad_(False)
        rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, max_positions,
                                 cfg.rope_scaling, cfg.max_position_embeddings)
        # Kept outside the layers' module tree: one table for all layers.
        self._rotary = [rotary]
        self.layers = nn.ModuleList(
            make_layer(i, rotary) if make_layer is not None else
            LlamaDecoderLayer(cfg, rotary, make_mlp(i) if make_mlp else None)
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                layer_call: LayerCall | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self._rotary[0].lookup(positions, x.dtype)  # once per step, not per layer
        for layer in self.layers:
            x = layer(cos, sin, x) if layer_call is None else layer_call(layer, cos, sin, x)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    packed_modules = PACKED

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, max_positions, self.make_mlp, self.make_layer)
        self.lm_head: nn.Module = (TiedLMHead(self.model.embed_tokens) if cfg.tie_word_embeddings
                                   else Linear(cfg.hidden_size, cfg.vocab_size))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                layer_call: LayerCall | None = None) -> torch.Tensor:
        """`layer_call(layer, cos, sin, x)` runs each decoder layer instead of calling it
        (the model runner passes a torch.compile'd one for decode steps)."""
        return self.model(input_ids, positions, layer_call)

    def make_mlp(self, layer: int) -> nn.Module | None:
        """Layer `layer`'s MLP; None: the dense LlamaMLP (MoE families return their block)."""
        return None

    # A family with its own decoder layer sets this to a method (layer, rotary) -> module.
    make_layer: Callable[[int, RotaryEmbedding], nn.Module] | None = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def rotary_embeddings(self) -> list[RotaryEmbedding]:
        return self.model._rotary
