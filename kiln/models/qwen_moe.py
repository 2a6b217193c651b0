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

from kiln.layers.moe import Experts
from kiln.layers.router import Router, softmax_topk
from kiln.models.config import ModelConfig
from kiln.models.llama import LlamaForCausalLM, LlamaMLP


class SparseMoeBlock(nn.Module):
    # Its forward is what layers.cpp's moe_layer chains after the attention (Router's fp32
    # logits, softmax_topk, the stacked experts, the shared expert once absorbed into them):
    # the layer kernels ask for this mark (LlamaDecoderLayer._moe_args), not for the class,
    # which sits above models/llama.py. A subclass whose forward differs sets it False.
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
            self.experts.keep_slots_for_shared(cfg.shared_expert_intermediate_size)
            if cfg.shared_expert_gate:
                self.shared_expert_gate = Router(cfg.hidden_size, 1)
        # After fuse_shared_expert with a gate: the gate's row is the router's last (one
        # logits call gives both; moe_layer reads it the same way).
        self.shared_gate_in_router = False

    def fuse_shared_expert(self) -> bool:
        """The shared expert into the stacked experts (Experts.absorb_shared), its sigmoid
        gate into the router as row E: then one moe_q4 call (or the one-call moe_layer) runs
        the whole block. Where the experts cannot take it, nothing changes."""
        if self.shared_expert is None or type(self.experts) is not Experts or \
                not self.experts.absorb_shared(self.shared_expert.gate_up_proj,
                                               self.shared_expert.down_proj):
            return False
        self.shared_expert = None
        if self.shared_expert_gate is not None:
            w = torch.cat([self.gate.weight.data, self.shared_expert_gate.weight.data.to(
                self.gate.weight.dtype)])
            self.gate.weight = nn.Parameter(w, requires_grad=False)
            self.shared_expert_gate = None
            self.shared_gate_in_router = True
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        if getattr(self.experts, "num_shared", 0):  # the shared expert absorbed
            e = self.experts.num_experts
            weights, ids = softmax_topk(logits[:, :e], self.top_k, self.renormalize,
                                        self.gate.elementwise_kernel)
            gate = torch.sigmoid(logits[:, e:]) if self.shared_gate_in_router else None
            return self.experts(x, weights.to(x.dtype), ids, shared_weight=gate)
        weights, ids = softmax_topk(logits, self.top_k, self.renormalize,
                                    self.gate.elementwise_kernel)
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
