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

from kiln.layers.attention import Attention
from kiln.layers.linear import Linear, MergedLinear
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

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """cos, sin: [T, 1, head_dim] from `RotaryEmbedding.lookup` (sin signed)."""
        qkv = self.qkv_proj(x)
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
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        i = cfg.intermediate_size
        self.intermediate_size = i
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {"gate": i, "up": i}, bias=cfg.mlp_bias)
        self.down_proj = Linear(i, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        i = self.intermediate_size
        return self.down_proj(F.silu(gu[:, :i]) * gu[:, i:])


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(cos, sin, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        # `_weight` skips the random init: on the meta device that init alone imports
        # torch._dynamo (~2 s of startup).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.embed_tokens.weight.requires_grad_(False)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, max_positions, cfg.rope_scaling,
                                 cfg.max_position_embeddings)
        # Kept outside the layers' module tree: one table for all layers.
        self._rotary = [rotary]
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, rotary)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                layer_call: LayerCall | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self._rotary[0].lookup(positions, x.dtype)  # once per step, not per layer
        for layer in self.layers:
            x = layer(cos, sin, x) if layer_call is None else layer_call(layer, cos, sin, x)
        return self.norm(x)


class TiedLMHead(nn.Module):
    """logits = hidden @ embedding^T, reading the embedding's own weight (no copy)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self._embedding = [embedding]  # not a child: the weight is registered once

    @property
    def embedding(self) -> nn.Embedding:
        return self._embedding[0]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self._embedding[0].weight)


class LlamaForCausalLM(nn.Module):
    packed_modules = PACKED

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, max_positions)
        self.lm_head: nn.Module = (TiedLMHead(self.model.embed_tokens) if cfg.tie_word_embeddings
                                   else Linear(cfg.hidden_size, cfg.vocab_size))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                layer_call: LayerCall | None = None) -> torch.Tensor:
        """`layer_call(layer, cos, sin, x)` runs each decoder layer instead of calling it
        (the model runner passes a torch.compile'd one for decode steps)."""
        return self.model(input_ids, positions, layer_call)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def rotary_embeddings(self) -> list[RotaryEmbedding]:
        return self.model._rotary
