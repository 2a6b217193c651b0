"""One chooser per layer kind: which kernel runs it, and why (vLLM's choose_mp_linear_kernel:
an ordered list of candidates, each saying whether it can run this layer and, if not, why).
The modules call these at construction; `summary` gathers a model's choices for the decision
trace (RuntimeDecisions.cpu_kernels). Outside kiln/layers/kernels/ nothing else asks whether a
kernel library loaded (tests/kernels/test_kernel_layer.py holds the rest of kiln to that): the loader
(GGUF blocks kept or not), the LoRA registry and the KV-dtype rule's context ask here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from kiln.layers import kernels
from kiln.layers.kernels.formats import EMBED_ROW_TYPES

# The names of kiln's own kernels (at the selected ISA level); every other Choice.kernel is a
# fallback (PyTorch's ops, the reference form).
OWN_KERNEL_NAMES = ("q4", "gguf", "q8", "attend_rows", "lora_add", "kiln")


@dataclass(frozen=True)
class Choice:
    # "q4" | "gguf" | "q8" | "attend_rows" | "lora_add" | "kiln" (choose_cpu_kernels: the set as
    # a whole) | "torch-int4" | "torch-int8" | "torch" | "reference"
    kernel: str
    reasons: tuple[str, ...]  # why this one, after why not each better candidate

    @property
    def kiln(self) -> bool:
        return self.kernel in OWN_KERNEL_NAMES

    @property
    def why(self) -> str:
        return "; ".join(self.reasons)


def _kiln_why_not(device: torch.device, use_kernels: bool) -> str | None:
    if not use_kernels:
        return "--no-cpu-kernels"
    if device.type != "cpu":
        return f"kiln's kernels are CPU-only ({device.type})"
    if not kernels.available():
        return kernels.reason()
    return None


def _ran(name: str) -> str:
    return f"kiln {name} at {kernels.level()}"


def choose_linear_kernel(kind: str, device: torch.device, n: int, k: int, *,
                         group_size: int = 32, use_kernels: bool = True,
                         native: bool = False) -> Choice:
    """The kernel of a quantized linear of `kind` ("int4": GroupQuant groups, "int8": rows with
    one scale each, "gguf": GGUF blocks) with n outputs over k inputs. `native`: PyTorch's
    packed CPU op for the kind exists in this build (the next candidate after kiln's)."""
    why_not: list[str] = []
    kiln_no = _kiln_why_not(device, use_kernels)
    if kind == "int4":
        if kiln_no is None and group_size == 32 and k % 32 == 0:
            return Choice("q4", (_ran("q4_linear (int4 tiles x int8 activations)"),))
        why_not.append(f"q4_linear: {kiln_no or f'groups of {group_size} over K={k}'}")
        if native:
            return Choice("torch-int4", (*why_not, "PyTorch's int4 CPU op"))
    elif kind == "gguf":
        if kiln_no is None:
            return Choice("gguf", (_ran("kq_linear (GGUF-block tiles)"),))
        why_not.append(f"kq_linear: {kiln_no}")
    elif kind == "int8":
        # kiln's q8_linear runs the int8 head under --batch-invariant (fix_kernel_choice, which
        # reads `q8_ok`); other int8 layers take PyTorch's int8 op.
        if native:
            return Choice("torch-int8", ("PyTorch's int8 CPU op",))
    else:
        raise ValueError(f"unknown linear kind {kind!r}")
    return Choice("reference", (*why_not, "dequantized per call (slow, same numbers)"))


def choose_embedding_kernel(type_name: str, device: torch.device,
                            use_kernels: bool = True) -> Choice:
    """How an embedding kept as GGUF blocks looks up its rows: embed_rows (kiln's, the legacy
    block types) or formats.dequantize_blocks' PyTorch ops (the K-quants, or no kernels)."""
    kiln_no = _kiln_why_not(device, use_kernels)
    if kiln_no is None and type_name in EMBED_ROW_TYPES:
        return Choice("gguf", (_ran("embed_rows (GGUF blocks)"),))
    why = kiln_no or f"{type_name} blocks (legacy types only)"
    return Choice("reference", (f"embed_rows: {why}", "dequantized per lookup by PyTorch ops"))


def q8_ok(device: torch.device, k: int, use_kernels: bool = True) -> bool:
    """Whether kiln's q8_linear can run an int8 linear over k inputs here."""
    return _kiln_why_not(device, use_kernels) is None and k % 8 == 0


def choose_attention_kernel(*, invariant: bool, use_kernels: bool, device: torch.device,
                            k_dtype: torch.dtype, compute_dtype: torch.dtype, quantized: bool,
                            softcap: float | None, head_dim: int, v_head_dim: int) -> Choice:
    """attend_rows (kiln's batch-invariant attention, every row of a step) or PyTorch's
    paths. attend_rows runs under --batch-invariant for pools it reads in place: fp32/bf16 in
    the compute dtype or fp16 under fp32, K and V apart or V inside K (MLA's latent row), head
    dims multiples of 8 up to 576 (DeepSeek-V3's 512 + 64), no soft-capped scores."""
    if not invariant:
        return Choice("torch", ("not --batch-invariant: PyTorch's SDPA / matmuls",))
    kiln_no = _kiln_why_not(device, use_kernels)
    pool_ok = ((k_dtype == compute_dtype and k_dtype in (torch.float32, torch.bfloat16))
               or (k_dtype == torch.float16 and compute_dtype == torch.float32))
    checks = [
        (kiln_no is None, kiln_no or ""),
        (not quantized, "an int8 pool"),
        (softcap is None, "soft-capped scores"),
        (pool_ok, f"a {k_dtype} pool computed in {compute_dtype}"),
        (head_dim % 8 == 0 and v_head_dim % 8 == 0 and max(head_dim, v_head_dim) <= 576,
         f"head dims {head_dim}/{v_head_dim}"),
    ]
    for ok, why in checks:
        if not ok:
            return Choice("torch", (f"attend_rows: {why}",))
    return Choice("attend_rows", (_ran("attend_rows (batch-invariant)"),))


def choose_cpu_kernels(device: torch.device, use_kernels: bool = True) -> Choice:
    """Whether kiln's kernels run a model on `device` here at all ("kiln", naming the ISA level
    and why it was chosen) or PyTorch's paths do ("torch", saying why): the auto rules'
    `cpu_kernels` context (the KV dtype rule) reads this."""
    why = _kiln_why_not(device, use_kernels)
    if why is None:
        return Choice("kiln", (f"kiln's kernels at {kernels.level()}: {kernels.reason()}",))
    return Choice("torch", (why, "PyTorch's paths"))


def choose_lora_kernel(device: torch.device, dtype: torch.dtype) -> Choice:
    """How the LoRA target linears add their adapters: lora_add (kiln/layers/kernels/lora.cpp,
    one call per linear) for fp32 activations where kiln's kernels run, else PyTorch's matmuls,
    two per group of rows."""
    # the dtype first: asking whether the kernels run chooses (and may build) a level, which a
    # bf16 engine never needs (_kiln_why_not refuses a GPU before it asks)
    if device.type == "cpu" and dtype != torch.float32:
        why = f"{dtype} activations (it reads fp32)"
    else:
        why = _kiln_why_not(device, True)
    if why is None:
        return Choice("lora_add", (_ran("lora_add"),))
    return Choice("torch", (f"lora_add: {why}", "PyTorch's matmuls, two per group of rows"))


def summary(model: torch.nn.Module) -> tuple[str, str]:
    """(level or "none", "N linears on q4, M on gguf, ...; why for the others"): what the
    model's layers chose, for the decision trace."""
    counts: Counter[str] = Counter()
    others: dict[str, str] = {}
    for m in model.modules():
        choice = getattr(m, "kernel_choice", None)
        if isinstance(choice, Choice):
            counts[choice.kernel] += 1
            if not choice.kiln:
                others.setdefault(choice.kernel, choice.why)
    level = kernels.level() or "none"
    text = ", ".join(f"{n} on {k}" for k, n in counts.most_common()) or "no quantized layer"
    why = "; ".join(f"{k}: {w}" for k, w in others.items())
    return level, f"{kernels.reason()}; {text}" + (f" ({why})" if why else "")
