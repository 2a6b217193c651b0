"""Linear layers that know how checkpoint shards map onto them.

`MergedLinear` packs several checkpoint matrices (q/k/v, or gate/up) into one weight so a step does
one matmul instead of three; its `load_shard` copies one checkpoint tensor into its rows.
Quantized variants (see `kiln/layers/quant/linear.py`) are swapped in as modules after loading.

When the model is loaded for quantization, 4-bit checkpoint blocks skip the dense weight: the
loader hands them to `stash_quantized` and `kiln.layers.quant.apply.quantize_model` builds the quantized
module from the stash. Whatever is not quantized in the end is written back into the dense weight
(`materialize_stash`), so the module is always complete after `quantize_model`.

On CPU a weight can be kept in oneDNN's blocked GEMM layout (`pack_weight`, once at load) and
multiplied with `packed_linear`: the same products as F.linear, 1.1x faster at 512 rows and ~2x
at 4-16 rows (Zen 5, 2 threads: a SmolLM2 layer's four linears at M=16 0.43-0.52 vs 0.82-0.92 ms
for the int4 kernel; the 49152 x 576 head 3.4 vs 7-9 ms unpacked), because F.linear re-lays the
weight out on every call. `packed_linear` is a custom op (kiln::packed_linear) so that
torch.compile'd graphs call it as an opaque kernel: inductor's own lowering of oneDNN's linear
only accepts weights that are graph constants, and ours are graph inputs (one graph serves all
layers).
"""

from __future__ import annotations

import functools
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
        # shard name (None: the whole weight) -> kiln.layers.kernels.formats.GroupQuant, not yet
        # applied
        self.stash: dict[str | None, Any] = {}
        self.packed = False  # weight is in oneDNN's layout (`pack`): a buffer, multiply-only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        y = packed_linear(x.reshape(-1, self.in_features), self.weight, True)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def pack(self) -> bool:
        """Moves the (loaded, complete) weight into oneDNN's layout, where the build supports
        its dtype; the weight can then only be multiplied. Returns whether it did."""
        assert not self.stash, "materialize the stash first"
        w = pack_weight(self.weight.data)
        if not w.is_mkldnn:
            return False
        del self._parameters["weight"]
        self.register_buffer("weight", w)
        self.packed = True
        return True

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


class TiedLMHead(nn.Module):
    """logits = hidden @ embedding^T, reading the embedding's own weight (no copy). It lives with
    the linears so `kiln.layers.quant.linear` can swap it without importing a model family."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self._embedding = [embedding]  # not a child: the weight is registered once

    @property
    def embedding(self) -> nn.Embedding:
        return self._embedding[0]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self._embedding[0].weight)


# --------------------------------------------------------------------------- packed CPU GEMM

_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define("packed_linear(Tensor x, Tensor w) -> Tensor")


# oneDNN builds (and caches, with its scratch memory) one primitive per input shape: ~0.3-1.5 MB
# each for SmolLM2's layers, kept in two LRU caches of 1024 entries (oneDNN's and ideep's). The
# row counts of mixed prefill/decode steps take any value up to the token budget, so a server
# would grow by hundreds of MB; above `ROWS_EXACT`, rows are padded up to a multiple of
# `ROWS_QUANTUM`, which bounds the shapes to a few dozen per weight for a few % more compute.
ROWS_EXACT = 16
ROWS_QUANTUM = 32


def _packed_linear_cpu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    m = x.shape[0]
    if m > ROWS_EXACT and m % ROWS_QUANTUM:
        padded = x.new_empty((m + ROWS_QUANTUM - m % ROWS_QUANTUM, x.shape[1]))
        padded[:m] = x
        padded[m:] = 0  # (rows are independent: the pad only has to be finite)
        return torch.ops.mkldnn._linear_pointwise(padded, w, None, "none", [], "")[:m]
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


# The packed weight is an opaque oneDNN tensor (dispatch key MkldnnCPU), the input a plain one.
_LIB.impl("packed_linear", _packed_linear_cpu, "CPU")
_LIB.impl("packed_linear", _packed_linear_cpu, "MkldnnCPU")


@torch.library.register_fake("kiln::packed_linear")
def _packed_linear_fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


@functools.cache
def packing_works(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU pack `dtype` weights and multiply them right (a probe
    against F.linear; False where oneDNN is missing or lacks the dtype)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)  # not the global RNG: probing must not shift it
        w = torch.randn(48, 64, generator=g).to(dtype)
        x = torch.randn(3, 64, generator=g).to(dtype)
        got = torch.ops.kiln.packed_linear(x, torch.ops.mkldnn._reorder_linear_weight(w))
        return bool(torch.allclose(got.float(), F.linear(x, w).float(), rtol=2e-2, atol=5e-2))
    except Exception:  # noqa: BLE001 - any failure means: keep the weight unpacked
        return False


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] in oneDNN's blocked layout for `packed_linear`, where the CPU build supports it;
    otherwise w itself. A packed weight can only be multiplied (no indexing, no views)."""
    if w.device.type == "cpu" and w.dim() == 2 and packing_works(w.dtype):
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
    return w


def pack_linears(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """Packs every dense `Linear` of `dtype` on CPU (quantized layers pack their own dense
    copies); returns how many. Only bf16 by default: fp32 models stay on F.linear, whose
    numbers tests compare with transformers' exactly."""
    n = 0
    for m in model.modules():
        if isinstance(m, Linear) and not m.packed and m.weight.dtype == dtype:
            n += m.pack()  # (pack_weight leaves non-CPU weights as they are)
    return n


def packed_linear(x: torch.Tensor, w: torch.Tensor, packed: bool) -> torch.Tensor:
    """x [M, K] @ w^T for a weight from `pack_weight`; `packed` says whether it was (the caller
    keeps that flag: under torch.compile the traced stand-in of a packed weight does not say)."""
    if packed:
        return torch.ops.kiln.packed_linear(x.contiguous(), w)
    return F.linear(x, w)
