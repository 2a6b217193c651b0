"""A mixture-of-experts layer's router: fp32 logits (`Router`, on kiln's kernels where they run:
each row's logits one FMA chain, the same whatever else is in the step) and the schemes that turn
them into each token's experts and weights, one function each: `softmax_topk` (Mixtral, Qwen-MoE)
and `grouped_topk` (DeepSeek: groups, a correction bias, sigmoid or softmax scores).
kiln/layers/moe.py runs the experts they pick."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool, kernel: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2/3-MoE and Mixtral: softmax over all experts, keep the top k, optionally
    renormalised to sum to 1 (which equals Mixtral's softmax over the selected logits).
    Returns (weights fp32 [T, k], ids int64 [T, k]). `kernel` (Router.elementwise_kernel: an
    eager CPU step on kiln's kernels): the kernels' routing, which the one-call MoE layers run
    too, so both give the same bits."""
    if (kernel and logits.device.type == "cpu" and logits.dim() == 2
            and not torch.compiler.is_compiling()):
        from kiln.layers.kernels import ops

        return ops.softmax_topk(logits.float(), k, renormalize)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_topk(logits: torch.Tensor, k: int, *, n_group: int, topk_group: int,
                 scoring: str = "sigmoid", bias: torch.Tensor | None = None,
                 renormalize: bool = True, scale: float = 1.0, method: str = "noaux_tc"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routing. Experts are split into `n_group` groups; only the best `topk_group`
    groups may be chosen from, then the top k experts of those. V3 (`noaux_tc`): sigmoid scores,
    the selection (not the weights) shifted by `e_score_correction_bias`, a group scored by the
    sum of its two best. V2 (`group_limited_greedy`): softmax scores, a group scored by its best.
    `greedy` (V2-Lite): plain top k. The chosen weights are optionally renormalised, then scaled
    by `routed_scaling_factor`."""
    logits = logits.float()
    scores = torch.sigmoid(logits) if scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores if bias is None else scores + bias.float()
    t, e = choice.shape
    if method != "greedy" and n_group > 1:
        grouped = choice.view(t, n_group, e // n_group)
        if method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        keep = torch.topk(group_scores, topk_group, dim=-1, sorted=False).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = torch.topk(choice, k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


class Router(nn.Module):
    """The gate: `weight` [E, H]; logits in fp32 whatever the model's dtype (kept dense by the
    quantization pass, which only swaps kiln's `Linear` modules). DeepSeek-V3's selection bias,
    where present, is `e_score_correction_bias` [E]."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool = False,
                 keep_fp32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(num_experts), requires_grad=False) if correction_bias
            else None)
        # DeepSeek: the weight and bias stay fp32 in a bf16 model, as HF keeps them
        # (`_keep_in_fp32_modules`) and vLLM keeps the bias: the bias separates experts whose
        # sigmoid scores differ by less than bf16's step, and routing flips change a token's
        # whole MoE output.
        self.keep_fp32 = keep_fp32
        # Eager fp32 CPU steps run kiln's router_logits (row-invariant: see ops.router_logits),
        # set by ops.use_elementwise_kernels as for the norms.
        self.elementwise_kernel = False

    def _apply(self, fn: Any, recurse: bool = True) -> Router:
        super()._apply(fn, recurse)
        if self.keep_fp32:  # undo the model-wide dtype cast (.to(bf16)) for our parameters
            for name, p in self._parameters.items():
                if p is not None and p.is_floating_point() and p.dtype != torch.float32:
                    self._parameters[name] = nn.Parameter(p.data.float(), requires_grad=False)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.elementwise_kernel and x.dim() == 2 and x.dtype == torch.float32
                and self.weight.dtype == torch.float32 and x.shape[1] % 8 == 0
                and not torch.compiler.is_compiling()):
            from kiln.layers.kernels import ops

            return ops.router_logits(x, self.weight)
        return F.linear(x.float(), self.weight.float())
