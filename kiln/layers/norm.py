"""RMSNorm, computed in fp32 like Hugging Face's reference (the cast matters for bf16 parity)."""

from __future__ import annotations

import torch
from torch import nn

from kiln.layers import cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # Eager bf16 CPU steps run kiln's one-pass kernel (cpu_kernels.use_elementwise_kernels);
        # under torch.compile inductor fuses the ops below itself.
        self.elementwise_kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.elementwise_kernel and x.dim() == 2 and x.dtype == self.weight.dtype
                and x.shape[1] % 16 == 0 and not torch.compiler.is_compiling()):
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
