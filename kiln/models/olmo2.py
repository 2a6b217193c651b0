"""OLMo 2: the Llama decoder's attention (q/k RMSNorm over the whole projection) and MLP, with
the norms after each block instead of before it: x + norm(attn(x)), then x + norm(mlp(x))."""

from __future__ import annotations

import torch
from torch import nn

from kiln.layers.norm import RMSNorm
from kiln.layers.rotary import RotaryEmbedding
from kiln.models.config import ModelConfig
from kiln.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, layer: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = LlamaAttention(cfg, rotary, layer)
        # OLMo 2's norm multiplies by its weight in fp32, before the cast back
        self.post_attention_layernorm = RMSNorm(h, eps, weight_in_float=True)
        self.mlp = LlamaMLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(h, eps, weight_in_float=True)

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(cos, sin, x))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2ForCausalLM(LlamaForCausalLM):
    def make_layer(self, layer: int, rotary: RotaryEmbedding) -> nn.Module:  # type: ignore[override]
        return Olmo2DecoderLayer(self.config, rotary, layer)
