"""Linear layers that know how checkpoint shards map onto them.

`MergedLinear` packs several checkpoint matrices (q/k/v, or gate/up) into one weight so a step does
one matmul instead of three; its `load_shard` copies one checkpoint tensor into its rows.
Quantized variants (see `kiln/layers/quant.py`) are swapped in as modules after loading.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Rows [offsets[i], offsets[i+1]) of the weight hold checkpoint shard `names[i]`."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shards: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.shards[name] = (start, size)
            start += size

    def load_shard(self, param: nn.Parameter, shard: str, tensor: torch.Tensor) -> None:
        start, size = self.shards[shard]
        if tensor.shape[0] != size:
            raise ValueError(f"shard {shard}: expected {size} rows, got {tuple(tensor.shape)}")
        param.data[start:start + size].copy_(tensor)
