"""Mixtral: Mistral's decoder with 8 SwiGLU experts per layer, top-2, the two selected logits
softmaxed (= the full softmax's top 2, renormalised: `norm_topk_prob`). No shared expert.

The block is Qwen-MoE's (kiln/models/qwen_moe.py); only the checkpoint names differ: HF calls the
block `block_sparse_moe` and the expert projections `w1` (gate), `w3` (up), `w2` (down), which the
loader maps onto the stacked experts.
"""

from __future__ import annotations

from kiln.models.qwen_moe import QwenMoeForCausalLM


class MixtralForCausalLM(QwenMoeForCausalLM):
    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),)
