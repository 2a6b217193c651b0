"""Linear layers that know how checkpoint shards map onto them.

`MergedLinear` packs several checkpoint matrices (q/k/v, or gate/up) into one weight so a step does
one matmul instead of three; its `load_shard` copies one checkpoint tensor into its rows.
Quantized variants (see `kiln/layers/quant.py`) are swapped in as modules after loading.

When the model is loaded for quantization, 4-bit checkpoint blocks skip the dense weight: the
loader hands them to `stash_quantized` and `kiln.layers.quant.quantize_model` builds the quantized
module from the stash. Whatever is not quantized in the end is written back into the dense weight
(`materialize_stash`), so the module is always complete after `quantize_model`.
"""

from __future__ import annotations

from typing import Any

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
        # shard name (None: the whole weight) -> kiln.models.loader.GroupQuant, not yet applied
        self.stash: dict[str | None, Any] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def shard_rows(self, shard: str | None) -> tuple[int, int]:
        return 0, self.out_features

    def stash_quantized(self, shard: str | None, gq: Any) -> None:
        _, size = self.shard_rows(shard)
        if tuple(gq.shape) != (size, self.in_features):
            raise ValueError(f"shard {shard}: expected {(size, self.in_features)}, "
                             f"got {tuple(gq.shape)}")
        self.stash[shard] = gq

    def materialize_stash(self) -> None:
        """Writes stashed 4-bit blocks into the dense weight (dequantized)."""
        with torch.no_grad():
            for shard, gq in self.stash.items():
                start, size = self.shard_rows(shard)
                self.weight.data[start:start + size].copy_(gq.dequantize(self.weight.dtype))
        self.stash = {}


class MergedLinear(Linear):
    """Rows [offsets[i], offsets[i+1]) of the weight hold checkpoint shard `names[i]`."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shards: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.shards[name] = (start, size)
            start += size

    def shard_rows(self, shard: str | None) -> tuple[int, int]:
        return self.shards[shard] if shard is not None else (0, self.out_features)

    def load_shard(self, param: nn.Parameter, shard: str, tensor: torch.Tensor) -> None:
        start, size = self.shards[shard]
        if tensor.shape[0] != size:
            raise ValueError(f"shard {shard}: expected {size} rows, got {tuple(tensor.shape)}")
        param.data[start:start + size].copy_(tensor)
