"""The LoRA layer: what adds a step's adapters to a target linear's output, and the step's row
groups it reads (kiln/engine/lora.py keeps the adapters' registry and loads them into these
hooks; the runner sets each step's groups; the decoder layer's one-call kernel reads them with
`kernel_args`). Below the engine: the models read it, so it sits with the other layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LoRAStep:
    """The step's rows of each adapter: the runner lays a step out so that one adapter's rows
    are contiguous (decodes sorted by adapter, each prefill chunk one request), so a group is a
    row range. Computed once per step; every target linear reads it."""

    # (adapter slot, first row, end row) of each group; base rows are in none
    groups: list[tuple[int, int, int]]
    # the same as int64 [groups, 3], for the CPU kernel (on the CPU whatever the device)
    seg: torch.Tensor


_STEP: LoRAStep | None = None
_NONE = torch.empty(0)


def kernel_args(linears: list[nn.Module]) -> tuple[list[torch.Tensor], torch.Tensor] | None:
    """The step's adapters of these linears as the layer kernel takes them (5 tensors
    per linear: a, bt, pieces, ranks, local; an empty a where it has none) and the step's row
    groups; None when the step has no adapter rows. The kernel adds them after each linear with
    lora_add, as the hooks do in an eager forward."""
    step = _STEP
    if step is None:
        return None
    out: list[torch.Tensor] = []
    for lin in linears:
        hook = getattr(lin, "lora_hook", None)
        st = hook.stacked if hook is not None and hook.weights else None
        out += [st.a, st.bt, st.pieces, st.ranks, st.local] if st is not None else [_NONE] * 5
    return out, step.seg


def step_active() -> bool:
    """Whether this forward has adapter rows (set_step's groups)."""
    return _STEP is not None


def set_step(step: LoRAStep | None) -> None:
    """The groups the target linears read during this forward (None: no adapter rows)."""
    global _STEP
    _STEP = step


@dataclass
class Stacked:
    """A target linear's adapters laid out for lora_add (see kiln/layers/kernels/lora.cpp)."""

    a: torch.Tensor  # [L, R, in]
    bt: torch.Tensor  # [L, R, out]: B transposed
    pieces: torch.Tensor  # int32 [L, P, 4]: (first rank, end rank, first column, end column)
    ranks: torch.Tensor  # int32 [L]
    local: torch.Tensor  # int32 [slots]: adapter slot -> L index, -1: none here


class TargetHook:
    """A target linear's adapters (slot -> A [R, in], B [out, R] with the scaling in it, and
    the pieces of B that are not zero) and the forward hook that adds them to its output."""

    def __init__(self, module: nn.Module, slots: int, kernel: bool) -> None:
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int, int]]]] = {}
        self.slots = slots
        self.kernel = kernel
        self.stacked: Stacked | None = None
        self.handle = module.register_forward_hook(self)
        module.lora_hook = self  # the layer kernel reads the stacks from here (kernel_args)

    def set(self, slot: int, item: tuple[torch.Tensor, torch.Tensor,
                                         list[tuple[int, int, int, int]]] | None) -> None:
        """Adds (or, with None, drops) the adapter in `slot`; restacks the kernel's layout."""
        if item is None:
            self.weights.pop(slot, None)
        else:
            self.weights[slot] = item
        if not self.kernel or not self.weights:
            self.stacked = None
            return
        order = sorted(self.weights)
        r_max = max(self.weights[s][0].shape[0] for s in order)
        p_max = max(len(self.weights[s][2]) for s in order)
        a0, b0, _ = self.weights[order[0]]
        a = a0.new_zeros(len(order), r_max, a0.shape[1])
        bt = b0.new_zeros(len(order), r_max, b0.shape[0])
        pieces = torch.zeros(len(order), p_max, 4, dtype=torch.int32)
        local = torch.full((self.slots,), -1, dtype=torch.int32)
        for i, s in enumerate(order):
            wa, wb, ps = self.weights[s]
            a[i, :wa.shape[0]] = wa
            bt[i, :wa.shape[0]] = wb.t()
            pieces[i, :len(ps)] = torch.tensor(ps, dtype=torch.int32)
            local[s] = i
        ranks = torch.tensor([self.weights[s][0].shape[0] for s in order], dtype=torch.int32)
        self.stacked = Stacked(a.contiguous(), bt.contiguous(), pieces, ranks, local)

    def __call__(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        # Compiled decode graphs only run steps without adapter rows: trace the base alone.
        if torch.compiler.is_compiling():
            return None
        step = _STEP
        if step is None or not self.weights:
            return None
        x = args[0]
        st = self.stacked
        if (st is not None and x.dim() == 2 and out.dim() == 2
                and x.dtype == out.dtype == torch.float32
                and x.stride(1) == 1 and out.stride(1) == 1):
            # One call for all groups: shrink and expand per row block, added into out.
            from kiln.layers.kernels import ops

            ops.lora_add(out, x, st.a, st.bt, st.pieces, st.ranks, step.seg, st.local)
            return out
        for slot, first, end in step.groups:
            w = self.weights.get(slot)
            if w is None:
                continue
            a, b, _ = w
            rows = x[first:end]
            if rows.dtype == a.dtype == out.dtype:
                out[first:end].addmm_(rows @ a.t(), b.t())
            else:
                out[first:end] += ((rows.to(a.dtype) @ a.t()) @ b.t()).to(out.dtype)
        return out
