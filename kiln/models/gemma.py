"""Gemma 2 and Gemma 3 (text): the Llama decoder's attention and MLP in Gemma's layer.

What differs from Llama, and where it lives:
- four RMSNorms per layer, around attention and MLP both ("sandwich": each block's output is
  normalized before the residual add), all of Gemma's form x * (1 + weight) (`RMSNorm(offset)`);
- embeddings multiplied by sqrt(hidden), rounded to the activation dtype (LlamaModel);
- a GELU (tanh) gate, attention scaled by query_pre_attn_scalar ** -0.5;
- sliding-window layers mixed with global ones (ModelConfig.layer_types; Attention's window);
- Gemma 2: attention scores and final logits soft-capped (Attention's softcap, compute_logits);
- Gemma 3: per-head q/k norms, and the sliding layers' own RoPE table (base 10k, unscaled).

llama.cpp stores Gemma's norm weights with the 1 added; the loader takes it off again
(`_GGUF_NORM_SHIFT` in loader.py), so the modules hold what the HF checkpoint holds.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.layers.norm import RMSNorm
from kiln.layers.rotary import RotaryEmbedding
from kiln.models.config import ModelConfig
from kiln.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, layer: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, offset=True)
        self.self_attn = LlamaAttention(cfg, rotary, layer)
        self.post_attention_layernorm = RMSNorm(h, eps, offset=True)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, offset=True)
        self.mlp = LlamaMLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(h, eps, offset=True)

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(cos, sin, self.input_layernorm(x)))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaForCausalLM(LlamaForCausalLM):
    def make_layer(self, layer: int, rotary: RotaryEmbedding) -> nn.Module:  # type: ignore[override]
        return GemmaDecoderLayer(self.config, rotary, layer)
