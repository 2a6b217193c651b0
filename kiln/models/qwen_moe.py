"""Qwen2-MoE and Qwen3-MoE: the Llama-family decoder (kiln/models/llama.py) with a sparse MoE
block as the MLP of every layer not listed in `mlp_only_layers` / skipped by
`decoder_sparse_step`.

    Qwen3-MoE: q/k RMSNorm, top-k of a softmax over the experts, renormalised (norm_topk_prob).
    Qwen2-MoE: q/k/v bias, top-k not renormalised, plus a shared expert (a plain SwiGLU MLP)
               scaled by sigmoid(shared_expert_gate(x)) and added to every token's output.

Names follow the HF checkpoints: `mlp.gate` (the router), `mlp.experts.N.{gate,up,down}_proj`,
`mlp.shared_expert`, `mlp.shared_expert_gate`.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.layers.moe import Experts, Router, softmax_topk
from kiln.models.config import ModelConfig
from kiln.models.llama import LlamaForCausalLM, LlamaMLP


class SparseMoeBlock(nn.Module):
    # Its forward is what kernels.cpp's moe_layer chains after the attention (Router's fp32
    # logits, softmax_topk, the stacked experts; a shared expert it does not run): the layer
    # kernels ask for this mark (LlamaDecoderLayer._moe_args), not for the class, which sits
    # above models/llama.py. A subclass whose forward differs sets it False.
    moe_layer_kernel = True

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.gate = Router(cfg.hidden_size, cfg.num_experts)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                               layer)
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: Router | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(cfg, cfg.shared_expert_intermediate_size)
            if cfg.shared_expert_gate:
                self.shared_expert_gate = Router(cfg.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = softmax_topk(self.gate(x), self.top_k, self.renormalize)
        # transformers casts the weights to the activation dtype before scaling
        y = self.experts(x, weights.to(x.dtype), ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)).to(x.dtype) * shared
            y = y + shared
        return y


class QwenMoeForCausalLM(LlamaForCausalLM):
    def make_mlp(self, layer: int) -> nn.Module | None:
        return SparseMoeBlock(self.config, layer) if self.config.is_moe_layer(layer) else None
