"""The model quantization pass: swaps a loaded model's linears for kiln/layers/quant/linear.py's
quantized modules (or gguf_blocks.py's, where a GGUF's blocks run as they are), picks the head's
form, and, under --batch-invariant, fixes each layer's kernel (`fix_kernel_choice`). See
kiln/layers/quant/linear.py's docstring for the modes and why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

import torch
from torch import nn

from kiln.layers.kernels.formats import KQUANT_TYPES, Q4_TYPES, GGUFBlocks, GroupQuant
from kiln.layers.linear import Linear, TiedLMHead
from kiln.layers.quant.linear import (
    INT4_GROUP,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    QuantizedLinear,
    quantize_int4_groups,
)

log = logging.getLogger("kiln.quant")
# quantize_model's release_source cadence: a madvise over the whole map per call
_RELEASE_EVERY = 64 << 20


def fix_kernel_choice(model: nn.Module) -> int:
    """--batch-invariant: every quantized linear runs one path whatever a step's row count:
    an int8 head kiln's q8_linear where kiln's kernels run (its dense copy dropped), else its
    dense copy where it keeps one, else its kernel (int4: q4_linear, the same at every size).
    Each of these computes a row
    alone, in an order that does not depend on the other rows (the size thresholds above
    switch between paths that round differently: a decode row's logits then depended on how
    many requests were decoding with it). Returns the number of layers fixed."""
    n = 0
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            m.fixed = True
            n += 1
    head = getattr(model, "lm_head", None)
    if isinstance(head, Int8Linear) and head.q8_ok:
        # The head sees one row per sequence (at most --max-num-seqs), where q8_linear is the
        # faster fixed choice (AVX2_INT8). Its dense copy (4x the int8 bytes in fp32) would
        # never run: dropped; an Int8Embedding sharing the weight reads the int8 rows instead.
        head.q8 = True
        head.dense = None
    return n


def _groups_of(lin: Linear) -> GroupQuant:
    """The whole weight as 4-bit groups: stashed GGUF blocks as they are, dense rows quantized."""
    parts = []
    covered = sorted((lin.shard_rows(s), s) for s in lin.stash)
    pos = 0
    for (start, size), shard in covered + [((lin.out_features, 0), None)]:
        if start > pos:
            parts.append(quantize_int4_groups(lin.weight.data[pos:start]))
        if size:
            part = lin.stash[shard]
            if isinstance(part, GGUFBlocks) and part.type_name in Q4_TYPES:
                part = part.groups()  # exactly: Q4_0 / Q4_1 blocks are 4-bit groups
            elif isinstance(part, GGUFBlocks):
                # blocks the kquant kernels read, in a layer that cannot run on them (a shard
                # beside Q4_0 / Q4_1 blocks): dequantized, then re-quantized
                part = quantize_int4_groups(part.dequantize(torch.float32))
            parts.append(part)
        pos = max(pos, start + size)
    return GroupQuant.cat(parts)


def _dense_fp32(lin: Linear) -> torch.Tensor:
    w = lin.weight.data.float()
    for shard, gq in lin.stash.items():
        start, size = lin.shard_rows(shard)
        w[start:start + size] = gq.dequantize(torch.float32)
    return w


def _int4_ok(lin: Linear) -> bool:
    return lin.in_features % INT4_GROUP == 0 and lin.in_features % 2 == 0


def _blocks_of(lin: Linear, types: Collection[str]) -> list[GGUFBlocks] | None:
    """The layer's GGUF blocks in row order when every row of it came as `GGUFBlocks` of one of
    `types` (the loader kept them), else None."""
    parts = sorted((lin.shard_rows(s)[0], s) for s in lin.stash)
    shards = getattr(lin, "shards", None)
    whole = None in lin.stash if not shards else set(lin.stash) == set(shards)
    if not whole or not all(isinstance(lin.stash[s], GGUFBlocks) and
                            lin.stash[s].type_name in types for _, s in parts):
        return None
    return [lin.stash[s] for _, s in parts]


def _native_blocks(lin: Linear) -> list[GGUFBlocks] | None:
    """Blocks kiln/layers/quant/gguf_blocks.py's kernels run as they are (Q8_0, K-quants)."""
    return _blocks_of(lin, KQUANT_TYPES)


def _int4_weight(lin: Linear) -> GroupQuant | list[GGUFBlocks]:
    """What an Int4Linear is made from: the file's Q4_0/Q4_1 blocks where they are the whole
    layer (packed into its tiles as they are), else the weight as 4-bit groups."""
    return _blocks_of(lin, Q4_TYPES) or _groups_of(lin)


def quantize_linear(lin: Linear, mode: str, use_kernels: bool = True) -> nn.Module:
    dtype = lin.weight.dtype
    bias = lin.bias.data if lin.bias is not None else None
    blocks = _native_blocks(lin)
    if blocks is not None:  # GGUF Q8_0 / Q5_x / Q4_K / Q5_K / Q6_K: the file's blocks, as they are
        from kiln.layers.quant.gguf_blocks import KQuantLinear

        lin.stash = {}
        return KQuantLinear(blocks, bias, dtype)
    with torch.no_grad():
        if mode == "int4" and _int4_ok(lin):
            return Int4Linear(_int4_weight(lin), bias, dtype, use_kernels)
        return Int8Linear.from_float(_dense_fp32(lin), bias, dtype, use_kernels)


def quantize_model(model: nn.Module, mode: str, keep_dense: bool = False,
                   use_kernels: bool = True,
                   release_source: Callable[[], None] | None = None) -> nn.Module:
    """Swaps the model's linear layers for quantized modules, in place; returns the model.
    `mode`: "int8" | "int4" (see the module docstring); "none" does nothing. `keep_dense`: each
    quantized layer also keeps its (dequantized) weight in the activation dtype for large steps.
    `use_kernels`: layers use kiln's own CPU kernels where this machine can (--cpu-kernels).
    `release_source`: called after every ~64 MiB of layers made, to give back the pages of the
    mapped file they were read from (a GGUF's blocks are read once, to be repacked): without
    it, the file's pages and their copies would both be resident by the end of the pass."""
    if mode == "none":
        return model
    if mode not in ("int8", "int4"):
        raise ValueError(f"unknown quantization {mode!r}: choose none, int8 or int4")
    from kiln.layers.moe import Experts

    n = made = 0
    for parent in list(model.modules()):
        if isinstance(parent, Experts):  # each expert becomes two quantized linears
            if not parent.is_quantized:  # (the loader may have done it, layer by layer)
                parent.quantize(mode, use_kernels)
            n += 2 * parent.num_experts
            continue
        if hasattr(parent, "quantize_weights"):  # a weight holder that packs itself (MLA's
            parent.quantize_weights(mode, use_kernels)  # per-head up-projections)
            continue
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear) and name != "lm_head":
                q = quantize_linear(child, mode, use_kernels)
                # where a packed layer's checkpoint shards lie (LoRA adds per shard)
                q.shards = dict(getattr(child, "shards", {}))
                setattr(parent, name, q)
                n += 1
                made += sum(b.nbytes for b in q.buffers())
                if release_source is not None and made >= _RELEASE_EVERY:
                    release_source()
                    made = 0
    _quantize_head(model, mode, use_kernels)
    if release_source is not None:
        release_source()  # the head: the largest single matrix
    for m in model.modules():  # anything left dense gets its stashed blocks back
        if isinstance(m, Linear) and m.stash:
            m.materialize_stash()
    if keep_dense:
        # Experts keep no dense copy: all of a layer's experts in bf16 would cost more memory
        # than the quantization saves, and an expert's rows per step are few.
        expert_layers = {id(q) for m in model.modules() if isinstance(m, Experts)
                         and m.quantized is not None for q in m.quantized}
        for m in model.modules():
            if isinstance(m, QuantizedLinear) and id(m) not in expert_layers:
                m.keep_dense()
    native = sum(type(m).__name__ == "KQuantLinear" for m in model.modules())
    log.info("quantized %d linear layers to %s (%d of them, lm_head included, keep the GGUF's "
             "blocks: kiln.layers.quant.gguf_blocks), lm_head to %s%s", n, mode, native,
             "int4 (the GGUF's blocks)" if isinstance(getattr(model, "lm_head", None), Int4Linear)
             else type(getattr(model, "lm_head", None)).__name__,
             " (dense copies kept for large steps)" if keep_dense else "")
    return model


def _quantize_head(model: nn.Module, mode: str, use_kernels: bool) -> None:
    """lm_head -> Int8Linear in both modes: 4-bit logits cost accuracy (teacher-forced greedy
    agreement with the fp32 model fell from 0.97 to 0.89 on SmolLM2 with an int4 head). A tied
    embedding then looks its rows up in the same int8 storage. Except a head that arrives as
    GGUF blocks: those kq_linear reads (tied or not) run as they are, and 4-bit ones (an
    untied `output.weight` in Q4_0/Q4_1) stay int4, as the file has them (an int8 copy of
    4-bit values holds nothing more than they do, at twice the bytes per decode step)."""
    head = getattr(model, "lm_head", None)
    if head is None:
        return
    from kiln.layers.quant.gguf_blocks import BlockEmbedding, KQuantLinear

    with torch.no_grad():
        if isinstance(head, TiedLMHead) and isinstance(head.embedding, BlockEmbedding):
            # a tied embedding the loader kept as the file's blocks, of a type kq_linear reads
            # (SmolLM2's Q8_0): the head runs on them as they are (its tiles are a copy; the
            # lookups go on reading the file's rows). Re-rounding Q8_0 to int8 rows cost
            # accuracy (relative logit error 1.6% vs 0.7%) and speed (q8_linear's fp32 chains
            # are compute-bound at one row: 2.0 vs 1.3 ms for SmolLM2's head, 2 threads).
            emb = head.embedding
            model.lm_head = KQuantLinear([emb.as_blocks()], None, emb.dtype)
        elif isinstance(head, TiedLMHead):
            emb = head.embedding
            q8 = Int8Linear.from_float(emb.weight.data, None, emb.weight.dtype, use_kernels)
            model.lm_head = q8
            model.model.embed_tokens = Int8Embedding(q8, emb.weight.dtype)
        elif isinstance(head, Linear) and _native_blocks(head) is not None:
            model.lm_head = quantize_linear(head, mode, use_kernels)  # the GGUF's blocks
        elif isinstance(head, Linear) and mode == "int4" and None in head.stash \
                and _int4_ok(head):
            model.lm_head = Int4Linear(_int4_weight(head), None, head.weight.dtype, use_kernels)
        elif isinstance(head, Linear):
            model.lm_head = quantize_linear(head, "int8", use_kernels)


def head_rows(head: nn.Module, n: int) -> nn.Module | None:
    """The first `n` output rows of a head as a layer of their own, on the same storage (no
    copy, nothing re-rounded): a draft model's head over the most frequent token ids
    (kiln/engine/draft.py). None where the head's layout cannot be cut at `n` (an int4 or int8
    tile boundary, a dense copy, a merged or packed weight): the caller keeps the whole head."""
    import copy

    from kiln.layers.quant.gguf_blocks import KQuantLinear

    rows = head.embedding.num_embeddings if isinstance(head, TiedLMHead) else head.out_features
    if n >= rows:
        return None
    per: dict[str, int] = {}  # buffer -> output rows per entry of its first dimension
    if isinstance(head, KQuantLinear) and len(head.rows) == 1:
        per = {"blocks0": 8 if head.tiled[0] else 1}
    elif isinstance(head, Int8Linear) and head.dense is None:
        per = {"weight": 1, "scales": 1}
    elif isinstance(head, Int4Linear) and head.kernel == "q4" and head.dense is None:
        per = {"packed": 8}  # reference.pack_q4: tiles of 8 rows
    elif isinstance(head, (Linear, TiedLMHead)):
        linear = isinstance(head, Linear)
        if linear and (head.packed or head.stash):
            return None
        weight = head.weight if linear else head.embedding.weight
        bias = head.bias if linear else None
        cut = Linear(weight.shape[1], n, bias is not None)
        cut.weight = nn.Parameter(weight[:n], requires_grad=False)
        if bias is not None:
            cut.bias = nn.Parameter(bias[:n], requires_grad=False)
        return cut
    if not per or any(n % r for r in per.values()):
        return None
    cut = copy.copy(head)
    cut._buffers = dict(head._buffers)
    for name, r in per.items():
        setattr(cut, name, getattr(head, name)[:n // r])
    if getattr(head, "bias", None) is not None:
        cut.bias = head.bias[:n]
    cut.out_features = n
    if isinstance(head, KQuantLinear):
        cut.rows = [n]
    return cut
