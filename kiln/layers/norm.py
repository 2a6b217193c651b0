"""RMSNorm, computed in fp32 like Hugging Face's reference (the cast matters for bf16 parity)."""

from __future__ import annotations

import torch
from torch import nn

from kiln.layers.kernels import ops


class RMSNorm(nn.Module):
    """`offset`: Gemma's form, x * (1 + weight) with the weight stored as the checkpoint has it
    (zero-centred) and the sum taken in fp32. `weight_in_float`: the weight multiplies the fp32
    normalized x before the cast back (OLMo 2, Gemma), not after it (Llama)."""

    def __init__(self, dim: int, eps: float = 1e-6, *, offset: bool = False,
                 weight_in_float: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset
        self.weight_in_float = weight_in_float or offset
        # Eager fp32 CPU steps run kiln's one-pass kernel
        # (kernels.ops.use_elementwise_kernels); under torch.compile inductor fuses the ops
        # below itself. Llama's form only.
        self.elementwise_kernel = False if not self.weight_in_float else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.elementwise_kernel and x.dim() == 2 and x.dtype == self.weight.dtype
                and x.shape[1] % 16 == 0 and not torch.compiler.is_compiling()):
            return ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x * (1.0 + self.weight.float())).to(dtype)
        if self.weight_in_float:
            return (self.weight * x).to(dtype)
        return self.weight * x.to(dtype)
