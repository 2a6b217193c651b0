"""Paged attention: write this step's K/V into the block pool, then attend over each sequence's
cached context through its block table.

The step's tokens are laid out decodes first (one token per sequence), then each prefill chunk:

    tokens : [d0 d1 d2 | p0 p0 p0 p0 p0 | p1 p1 p1]
              decodes    prefill chunk 0  prefill chunk 1

Decodes attend over their contexts gathered from the pool (padded to the longest, masked): fp32
SDPA for one or two rows, two batched matmuls for larger bf16 batches, a fused product-sum form
under torch.compile, and cascade attention when every row starts with the same cached blocks
(see `Attention._decode` and `_cascade`). Under --batch-invariant, where kiln's CPU kernels run,
every row (decode or prefill) instead goes through `attend_rows`, which reads the pool in place,
each row over its own context in one fixed order (kiln/layers/kernels/attention.cpp).

A prefill chunk that starts at position 0 attends to its own fresh K/V with a causal mask (no
pool read); a chunk that continues a sequence (chunked prefill, prefix-cache hit) gathers its
whole context from the pool. All index tensors are built once per step by the model
runner (`AttentionMetadata`) and shared by every layer through `get_context()`, so a model's
forward stays `(input_ids, positions)`.

KV storage is [num_slots, kv_heads, head_dim] per layer (each layer says its row shapes:
`Attention.kv_shapes`); with int8 storage each (slot, head) row
keeps an fp16 scale (absmax / 127), quantized on write and dequantized as it is gathered. The
scale is fp16, not fp32, so that int8 KV holds >= 1.9x the tokens of 16-bit KV even at
head_dim 64 (2*64 / (64 + 2) = 1.94; an fp32 scale would give 1.88); its rounding (2^-11
relative) is far below the int8 step, and values are quantized against the rounded scale.

Keys carry outlier channels (SmolLM2: absmax ~5x the row's RMS), which leave the other channels
only a few int8 levels. So int8 keys are stored rotated by a fixed orthonormal matrix R (a
normalized Hadamard matrix, which spreads every channel over all of them): the pool holds k R,
and queries that read the pool are rotated the same way, since (q R) . (k R) = q . k. A fresh
prefill chunk attends to its own unrotated k and q, untouched. On SmolLM2 this takes the greedy
agreement with fp32 KV over 5 x 64 tokens from 55% to 100%. Values are not rotated: their rows
are flatter, and rotating them changed nothing in that test.

    write : pool_k = int8(k @ R), pool_v = int8(v)
    read  : scores = (q @ R) . dequant(pool_k),  out = softmax(scores) @ dequant(pool_v)

Multi-head latent attention (DeepSeek-V2/V3, kiln/models/deepseek.py) is run as MQA over one
latent row per token, and its values are the row's first `v_head_dim` columns (`v_in_k`): the
pool keeps K only, and V is a view of it, never a copy.

    pool_k row : [ c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim) ]     one KV head
    V          : [ c_kv ]                                                the same memory
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kiln.layers.kernels import choose, ops

INT8_SCALE_DTYPE = torch.float16  # per (slot, head) scale of int8 KV
INT8_SCALE_BYTES = 2
# fp16 has subnormals down to 6e-8: smaller scales would round to 0 (and divide by it).
_MIN_SCALE = 1e-6
# Decode batches up to this many sequences attend with fp32 SDPA, larger bf16 ones with matmuls
# (see Attention._decode).
_SDPA_MAX_ROWS = 2


@dataclass
class PrefillChunk:
    start: int  # token range in the flattened step
    end: int
    context_start: int  # position of the chunk's first token = tokens already in the pool
    gather: torch.Tensor | None = None  # [context_start + q] slots, when context_start > 0
    mask: torch.Tensor | None = None  # [1, 1, q, kv] bool, when context_start > 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] slot of every token of the step
    num_decodes: int = 0
    decode_gather: torch.Tensor | None = None  # [num_decodes, max_kv] slots (padding: 0)
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_kv] bool
    # Cascade decode: slots of the leading blocks every decode row shares (a prefix-cache hit);
    # decode_gather/decode_mask then cover only what follows them. See Attention._cascade.
    decode_shared: torch.Tensor | None = None  # [P] slots
    # Context length of each decode row (what the batch-invariant kernel reads of its gather).
    decode_lens: torch.Tensor | None = None  # [num_decodes] int64
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Every row of the step as attend_rows reads it, (table [R, L], row_of [T], lens [T]), for
    # the AVX2 layer kernel that runs whole steps (model_runner._step_rows); None elsewhere.
    step_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


_CONTEXT: AttentionMetadata | None = None


def set_context(meta: AttentionMetadata | None) -> None:
    global _CONTEXT
    _CONTEXT = meta


def get_context() -> AttentionMetadata:
    assert _CONTEXT is not None, "attention called outside a model runner step"
    return _CONTEXT


@functools.lru_cache(maxsize=8)
def rotation_matrix(dim: int, device: torch.device) -> torch.Tensor:
    """An orthonormal [dim, dim] fp32 matrix: the Sylvester Hadamard matrix / sqrt(dim) when dim
    is a power of two, else a fixed (seeded) random rotation."""
    if dim & (dim - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        r = h / dim ** 0.5
    else:
        g = torch.Generator().manual_seed(dim)
        r, _ = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
        r = r.float()
    return r.to(device)


class KVStore:
    """One layer's slice of the KV pool. int8 keys are kept rotated (see the module notes):
    `gather` returns them in that basis, and `query` puts queries in the same one."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor | None,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 compute_dtype: torch.dtype = torch.float32, v_dim: int | None = None) -> None:
        """`v` None: values are the first `v_dim` columns of the keys (MLA's latent row), kept
        once; `self.v` is then a view of `k`."""
        self.v_in_k = v is None
        if self.v_in_k:
            if k_scale is not None:
                # The int8 keys are stored rotated (k R): their columns are no values any more.
                raise ValueError("int8 KV is not supported when values live in the keys (MLA)")
            assert v_dim is not None and v_dim <= k.shape[-1]
            v = k[..., :v_dim]
        assert v is not None
        self.k, self.v = k, v
        self.k_scale, self.v_scale = k_scale, v_scale
        self.compute_dtype = compute_dtype
        self.rotation = rotation_matrix(k.shape[-1], k.device) if k_scale is not None else None
        # Every row attends with kiln's batch-invariant kernel (ops.attend_rows; set by
        # Attention.attach from choose_attention_kernel).
        self.invariant = False
        self.kernel_choice: choose.Choice | None = None

    def query(self, q: torch.Tensor) -> torch.Tensor:
        """Queries that attend to keys read from this store: q [..., D] in the store's basis."""
        if self.rotation is None:
            return q
        return (q.float() @ self.rotation).to(q.dtype)

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Stores the step's keys and values at `slots` (`v` is ignored where it lives in k)."""
        if self.v_in_k:
            self.k.index_copy_(0, slots, k.to(self.k.dtype))
        elif self.quantized:
            assert self.k_scale is not None and self.v_scale is not None
            assert self.rotation is not None
            qk, sk = quantize_int8(k.float() @ self.rotation)
            qv, sv = quantize_int8(v)
            self.k.index_copy_(0, slots, qk)
            self.v.index_copy_(0, slots, qv)
            self.k_scale.index_copy_(0, slots, sk.to(self.k_scale.dtype))
            self.v_scale.index_copy_(0, slots, sv.to(self.v_scale.dtype))
        else:
            assert v is not None
            self.k.index_copy_(0, slots, k.to(self.k.dtype))
            self.v.index_copy_(0, slots, v.to(self.v.dtype))

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots: any shape S -> K, V of shape S + [kv_heads, head_dim] in the compute dtype
        (K in the store's basis: pair it with `query(q)`)."""
        # index_select over flat slots: 4-5x faster on CPU than advanced indexing (self.k[slots]).
        flat, shape = slots.reshape(-1), (*slots.shape, *self.k.shape[1:])
        k = self.k.index_select(0, flat).view(shape)
        if self.v_in_k:  # one gather; V is a view of the gathered rows
            k = k.to(self.compute_dtype)
            return k, k[..., :self.v.shape[-1]]
        v = self.v.index_select(0, flat).view(shape)
        if self.quantized:
            assert self.k_scale is not None and self.v_scale is not None
            dt = self.compute_dtype
            ks = self.k_scale.index_select(0, flat).view(shape[:-1]).unsqueeze(-1)
            vs = self.v_scale.index_select(0, flat).view(shape[:-1]).unsqueeze(-1)
            return k.to(dt) * ks.to(dt), v.to(dt) * vs.to(dt)
        return k.to(self.compute_dtype), v.to(self.compute_dtype)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per (token, head): x [T, H, D] -> int8 [T, H, D], scale [T, H] fp16."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / 127.0).clamp(min=_MIN_SCALE).to(INT8_SCALE_DTYPE)
    q = torch.round(xf / scale.float().unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q, scale


class Attention(nn.Module):
    """Paged attention of one layer. `head_dim` is the query/key width; values are
    `v_head_dim` wide (default: the same). With `v_in_k` the values are the first `v_head_dim`
    columns of the keys (MLA's latent row), so the pool stores keys only. `scale` defaults to
    head_dim ** -0.5."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 scale: float | None = None, v_head_dim: int | None = None,
                 v_in_k: bool = False, sliding_window: int | None = None,
                 softcap: float | None = None) -> None:
        """`sliding_window`: a query attends to the keys less than that many positions back
        (itself included), as transformers' sliding-window mask does; `softcap`: scores become
        softcap * tanh(scores / softcap) before the softmax (Gemma 2)."""
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.v_in_k = v_in_k
        self.scale = scale if scale is not None else head_dim ** -0.5
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.kv: KVStore | None = None  # attached by the model runner

    def kv_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """The per-token pool rows this layer keeps: (K row, V row or None when V is part of
        K). The model runner allocates the pool from these."""
        v = None if self.v_in_k else (self.num_kv_heads, self.v_head_dim)
        return (self.num_kv_heads, self.head_dim), v

    def attach(self, kv: KVStore, use_kernels: bool = True, invariant: bool = False) -> None:
        """Give the layer its slice of the KV pool. `invariant` (--batch-invariant): every row,
        decode or prefill, through attend_rows where choose_attention_kernel says it runs (a
        sliding window is a shorter gather per row, `_window_rows`); else PyTorch's paths."""
        kv.kernel_choice = choose.choose_attention_kernel(
            invariant=invariant, use_kernels=use_kernels, device=kv.k.device,
            k_dtype=kv.k.dtype, compute_dtype=kv.compute_dtype, quantized=kv.quantized,
            softcap=self.softcap, head_dim=self.head_dim, v_head_dim=self.v_head_dim)
        kv.invariant = kv.kernel_choice.kernel == "attend_rows"
        self.kv = kv

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
                ) -> torch.Tensor:
        """q: [T, Hq, D], k: [T, Hk, D], v: [T, Hk, Dv] -> [T, Hq * Dv]. k and v None: the
        step's keys and values are already in a kernel-read pool (`rope_write`). With `v_in_k`,
        v is None and the values are k[..., :Dv]."""
        meta = get_context()
        kv = self.kv
        assert kv is not None, "no KV cache attached"
        if self.v_in_k and k is not None:
            v = k[..., :self.v_head_dim]
        if k is None or v is None:
            assert kv.invariant, \
                "k/v already written: only the kernels' paths read the pool alone"
        else:
            kv.write(meta.slot_mapping, k, v)
        if kv.invariant:
            return self._invariant(q, kv, meta)
        out = q.new_empty((*q.shape[:-1], self.v_head_dim))
        nd = meta.num_decodes
        if nd:
            assert meta.decode_gather is not None
            ck, cv = kv.gather(meta.decode_gather)  # [nd, kv, Hk, D]
            mask = meta.decode_mask
            if self.sliding_window is not None and mask is not None:
                # The gather holds positions 0.. in order and the mask is each row's prefix
                # (cascade is off for such models: see decisions.py), so the row's position
                # is its mask's count - 1.
                length = mask.shape[-1]
                ctx = mask.sum(-1, keepdim=True)
                mask = mask & (torch.arange(length, device=mask.device)
                               >= ctx - self.sliding_window)
            if meta.decode_shared is not None:
                assert self.sliding_window is None and self.softcap is None
                sk, sv = kv.gather(meta.decode_shared)  # [P, Hk, D]
                out[:nd] = self._cascade(kv.query(q[:nd]), sk, sv, ck, cv, mask)
            elif self.softcap is not None:
                o = self._explicit(kv.query(q[:nd]).unsqueeze(2), ck.transpose(1, 2),
                                   cv.transpose(1, 2), mask)
                out[:nd] = o.squeeze(2)
            else:
                out[:nd] = self._decode(kv.query(q[:nd]), ck, cv, mask)
        for c in meta.prefills:
            qc = q[c.start:c.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q, D]
            if self.sliding_window is not None or self.softcap is not None:
                out[c.start:c.end] = self._chunk_explicit(qc, k, v, c, kv)
                continue
            if c.context_start == 0:
                kc = k[c.start:c.end].transpose(0, 1).unsqueeze(0)
                vc = v[c.start:c.end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qc, kc.to(qc.dtype), vc.to(qc.dtype),
                                                   is_causal=True, scale=self.scale,
                                                   enable_gqa=True)
            else:
                assert c.gather is not None
                ck, cv = kv.gather(c.gather)  # [kv, Hk, D]
                o = F.scaled_dot_product_attention(
                    kv.query(qc), ck.transpose(0, 1).unsqueeze(0), cv.transpose(0, 1).unsqueeze(0),
                    attn_mask=c.mask, scale=self.scale, enable_gqa=True)
            out[c.start:c.end] = o.squeeze(0).transpose(0, 1)
        return out.reshape(q.shape[0], self.num_heads * self.v_head_dim)

    def _chunk_explicit(self, qc: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                        c: PrefillChunk, kv: KVStore) -> torch.Tensor:
        """One prefill chunk (qc [1, Hq, q, D]) of a windowed or soft-capped layer: its causal
        mask narrowed to the window, through SDPA, or `_explicit` where scores are capped.
        Returns [q, Hq, Dv]."""
        n = c.end - c.start
        q_pos = torch.arange(c.context_start, c.context_start + n, device=qc.device)[:, None]
        if c.context_start == 0:
            assert k is not None and v is not None
            kc = k[c.start:c.end].transpose(0, 1).unsqueeze(0).to(qc.dtype)
            vc = v[c.start:c.end].transpose(0, 1).unsqueeze(0).to(qc.dtype)
        else:
            assert c.gather is not None
            ck, cv = kv.gather(c.gather)  # [kv, Hk, D]
            qc = kv.query(qc)
            kc, vc = ck.transpose(0, 1).unsqueeze(0), cv.transpose(0, 1).unsqueeze(0)
        k_pos = torch.arange(kc.shape[2], device=qc.device)[None, :]
        mask = k_pos <= q_pos
        if self.sliding_window is not None:
            mask = mask & (k_pos > q_pos - self.sliding_window)
        mask = mask[None, None]
        if self.softcap is not None:
            o = self._explicit(qc, kc, vc, mask)
        else:
            o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=self.scale,
                                               enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)

    def _explicit(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None) -> torch.Tensor:
        """Attention written out as transformers' eager path does it (Gemma 2 has no SDPA for
        its soft-capped scores): q [B, Hq, Q, D], k/v [B, Hk, K, D], mask [B|1, 1, Q, K] bool
        -> [B, Hq, Q, Dv]. Scores scaled and capped in the activation dtype, softmax in fp32.
        The G query heads of a KV head are stacked as G*Q rows against that head's keys, so K
        and V are read as they are, never repeated per query head."""
        b, hq, nq, _ = q.shape
        hk = k.shape[1]
        g = hq // hk
        scores = (q.reshape(b, hk, g * nq, -1) @ k.to(q.dtype).transpose(-1, -2)) * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.view(b, hk, g, nq, -1)
        if mask is not None:
            scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = probs.view(b, hk, g * nq, -1) @ v.to(q.dtype)
        return o.view(b, hq, nq, -1)

    def _window_rows(self, gather: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """attend_rows' (gather, rows, lens) narrowed to the sliding window: row i's context,
        gather[rows[i], :lens[i]] in position order, becomes its last `sliding_window` slots,
        one gather row per query row. The kernel's per-row arithmetic is unchanged, so rows
        stay batch-invariant."""
        w = self.sliding_window
        assert w is not None
        width = min(w, gather.shape[1])
        start = (lens - w).clamp(min=0)
        idx = (start[:, None] + torch.arange(width, device=lens.device)).clamp(
            max=gather.shape[1] - 1)
        # a prefill chunk's rows share one gather row: expanded, not copied per row
        src = (gather.expand(rows.shape[0], -1) if gather.shape[0] == 1
               else gather.index_select(0, rows))
        own = src.gather(1, idx)
        return own, torch.arange(rows.shape[0], device=rows.device), lens - start

    def _invariant(self, q: torch.Tensor, kv: KVStore, meta: AttentionMetadata) -> torch.Tensor:
        """Every row of the step through ops.attend_rows, reading the pool (this step's
        K/V are written already): a decode row over its gathered slots up to its length, a
        prefill row over its chunk's context up to its own position. A row's arithmetic depends
        only on its query and context, so it is the same alone or batched, in one prefill chunk
        or several, after a prefix-cache hit or not (see the kernel's notes)."""
        qf = q.float()
        out = q.new_empty((q.shape[0], self.num_heads, self.v_head_dim), dtype=torch.float32)
        nd = meta.num_decodes
        if nd:
            assert meta.decode_gather is not None and meta.decode_lens is not None
            gather, rows, lens = (meta.decode_gather, torch.arange(nd, device=q.device),
                                  meta.decode_lens)
            if self.sliding_window is not None:
                gather, rows, lens = self._window_rows(gather, rows, lens)
            out[:nd] = ops.attend_rows(qf[:nd], kv.k, kv.v, gather, rows, lens, self.scale)
        for c in meta.prefills:
            slots = meta.slot_mapping[c.start:c.end] if c.gather is None else c.gather
            n = c.end - c.start
            gather = slots.view(1, -1)
            lens = torch.arange(c.context_start + 1, c.context_start + n + 1, device=q.device)
            rows = torch.zeros(n, dtype=torch.long, device=q.device)
            if self.sliding_window is not None:
                gather, rows, lens = self._window_rows(gather, rows, lens)
            out[c.start:c.end] = ops.attend_rows(
                qf[c.start:c.end], kv.k, kv.v, gather, rows, lens, self.scale)
        return out.to(q.dtype).reshape(q.shape[0], self.num_heads * self.v_head_dim)

    def rope_write(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates q and k of a fused qkv [T, (Hq + 2 Hk) * D] and writes k and v to the pool in
        one kernel pass (ops.rope_write); returns q [T, Hq, D] for forward(q, None, None).
        Only for a pool attend_rows reads (`kv.invariant`: fp32 or fp16)."""
        kv = self.kv
        assert kv is not None and kv.invariant
        return ops.rope_write(qkv, cos, sin, kv.k, kv.v, get_context().slot_mapping,
                                      self.num_heads)

    def _shared_scores(self, q: torch.Tensor, sk: torch.Tensor) -> torch.Tensor:
        """Scaled fp32 scores of every row's queries q [B, Hq, D] against the P keys every row
        shares, sk [P, Hk, D]: one batched GEMM of B*G query rows per KV head -> [Hk, B*G, P]."""
        b, hq, d = q.shape
        hk = sk.shape[1]
        q_heads = q.view(b, hk, hq // hk, d).permute(1, 0, 2, 3).reshape(hk, -1, d)
        return torch.bmm(q_heads, sk.permute(1, 2, 0)).float() * self.scale

    def _decode(self, q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """One query token per sequence: q [B, Hq, D], ck/cv [B, L, Hk, D], mask [B, 1, 1, L].

        Measured on CPU (2 threads, SmolLM2 shapes): PyTorch's SDPA is fastest in fp32 and at
        small batches, where the step is a handful of ops; in bf16 its flash kernel is 2-4x
        slower than plain matmuls once B*L grows. So bf16 batches above `_SDPA_MAX_ROWS` use two
        batched matmuls over K/V viewed as [B, L, Hk*D] (no transposed copy of the context): the
        query heads are spread block-diagonally (row h of kv-head g holds q in block g, zeros
        elsewhere; 1/Hk of the product is useful, which is cheap next to a copy of K), and the
        output keeps each head's own block. Softmax in fp32 either way."""
        b, _, d = q.shape
        hk = ck.shape[2]
        if torch.compiler.is_compiling():
            return self._decode_fused(q, ck, cv, mask)
        if q.dtype == torch.float32 or b <= _SDPA_MAX_ROWS:
            f = torch.float32
            o = F.scaled_dot_product_attention(
                q.to(f).unsqueeze(2), ck.to(f).transpose(1, 2), cv.to(f).transpose(1, 2),
                attn_mask=mask, scale=self.scale, enable_gqa=True)
            return o.squeeze(2).to(q.dtype)
        length = ck.shape[1]
        q_wide = _spread_heads(q, hk)
        scores = (q_wide @ ck.view(b, length, hk * d).transpose(1, 2)).float() * self.scale
        if mask is not None:
            scores = scores.masked_fill(~mask.view(b, 1, length), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(cv.dtype)  # [B, Hq, L]
        # reshape, not view: an MLA value is a strided view of the gathered keys
        return _own_blocks(probs @ cv.reshape(b, length, hk * cv.shape[-1]), hk)

    def _decode_fused(self, q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor,
                      mask: torch.Tensor | None) -> torch.Tensor:
        """`_decode` for torch.compile: products and sums that inductor fuses, together with the
        pool gather (and int8 dequantization) that produced ck/cv, into loops reading the pool
        directly; no gathered copy of the context and no matmul call is made. Eager, this form
        would materialize [B, L, Hq, D]; compiled it measured 2-5x faster than the compiled
        matmul form (batch 1 x 160 tokens: 56 vs 304 us; 16 x 1152: 5.2 vs 11.8 ms)."""
        b, hq, d = q.shape
        length, hk = ck.shape[1], ck.shape[2]
        g = hq // hk
        qg = q.view(b, 1, hk, g, d).float()
        scores = (qg * ck.view(b, length, hk, 1, d).float()).sum(-1) * self.scale  # [B,L,Hk,G]
        if mask is not None:
            scores = scores.masked_fill(~mask.view(b, length, 1, 1), float("-inf"))
        probs = torch.softmax(scores, dim=1)
        dv = cv.shape[-1]
        o = (probs.unsqueeze(-1) * cv.reshape(b, length, hk, 1, dv).float()).sum(1)  # [B,Hk,G,Dv]
        return o.reshape(b, hq, dv).to(q.dtype)

    def _cascade(self, q: torch.Tensor, sk: torch.Tensor, sv: torch.Tensor, ck: torch.Tensor,
                 cv: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Decode where every row's context starts with the same P cached tokens (sk/sv
        [P, Hk, D]), then its own (ck/cv [B, L, Hk, D], masked). The shared part is read once
        for all rows, as one GEMM of B*Hq query rows, instead of B times (FlashInfer's cascade
        attention). Both parts' scores go through one softmax, so the result is exact. The
        matmuls use `_decode`'s block-diagonal query layout."""
        if torch.compiler.is_compiling():
            return self._cascade_fused(q, sk, sv, ck, cv, mask)
        b, hq, d = q.shape
        p, hk = sk.shape[0], sk.shape[1]
        length = ck.shape[1]
        q_wide = _spread_heads(q, hk)
        shared = (q_wide.view(b * hq, hk * d) @ sk.view(p, hk * d).t()).view(b, hq, p)
        own = q_wide @ ck.view(b, length, hk * d).transpose(1, 2)  # [B, Hq, L]
        if mask is not None:
            own = own.masked_fill(~mask.view(b, 1, length), float("-inf"))
        scores = torch.cat([shared, own], dim=-1).float() * self.scale
        probs = torch.softmax(scores, dim=-1).to(cv.dtype)
        dv = cv.shape[-1]
        o = ((probs[..., :p].reshape(b * hq, p) @ sv.reshape(p, hk * dv)).view(b, hq, hk * dv)
             + probs[..., p:] @ cv.reshape(b, length, hk * dv))
        return _own_blocks(o, hk)

    def _cascade_fused(self, q: torch.Tensor, sk: torch.Tensor, sv: torch.Tensor,
                       ck: torch.Tensor, cv: torch.Tensor,
                       mask: torch.Tensor | None) -> torch.Tensor:
        """`_cascade` for torch.compile. The shared part is two batched GEMMs per KV head
        (its B*G query rows against the P shared keys: no block-diagonal waste), which inductor
        hands to the BLAS; the rows' own, short, parts are `_decode_fused`'s loops. The two
        parts meet in one softmax (a common running max, one denominator), so the result is
        exact. Compiled, a 16-row step over a 900-token prefix measured ~0.6 vs ~0.9 ms per
        layer for `_cascade` run eager."""
        b, hq, d = q.shape
        hk = sk.shape[1]
        g, length = hq // hk, ck.shape[1]
        qg = q.view(b, hk, g, d)
        shared = self._shared_scores(q, sk)  # [Hk, B*G, P]
        own = (qg.unsqueeze(1).float() * ck.view(b, length, hk, 1, d).float()).sum(-1)
        own = own * self.scale  # [B, L, Hk, G]
        if mask is not None:
            own = own.masked_fill(~mask.view(b, length, 1, 1), float("-inf"))
        # Row maxima over both parts, in each part's layout: [B, Hk, G] and [Hk, B*G, 1].
        top = torch.maximum(shared.amax(-1).view(hk, b, g).permute(1, 0, 2), own.amax(1))
        e_shared = torch.exp(shared - top.permute(1, 0, 2).reshape(hk, b * g, 1))
        e_own = torch.exp(own - top.unsqueeze(1))
        denom = e_shared.sum(-1).view(hk, b, g).permute(1, 0, 2) + e_own.sum(1)  # [B, Hk, G]
        o_shared = torch.bmm(e_shared.to(sv.dtype), sv.permute(1, 0, 2))  # [Hk, B*G, D]
        dv = cv.shape[-1]
        o_own = (e_own.unsqueeze(-1) * cv.reshape(b, length, hk, 1, dv).float()).sum(1)
        o = (o_shared.float().view(hk, b, g, dv).permute(1, 0, 2, 3) + o_own) / denom[..., None]
        return o.reshape(b, hq, dv).to(q.dtype)


def _spread_heads(q: torch.Tensor, hk: int) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, Hk*D]: query head h of KV group g keeps its values in block g and
    zeros in the others, so one matmul with K viewed as [.., L, Hk*D] scores every head against
    its own KV head."""
    b, hq, d = q.shape
    eye = torch.eye(hk, dtype=q.dtype, device=q.device).view(1, hk, 1, hk, 1)
    return (q.view(b, hk, hq // hk, 1, d) * eye).view(b, hq, hk * d)


def _own_blocks(o: torch.Tensor, hk: int) -> torch.Tensor:
    """[B, Hq, Hk*D] (probs @ V viewed as [.., L, Hk*D]) -> [B, Hq, D]: each query head's block
    of its own KV group."""
    b, hq, wide = o.shape
    d = wide // hk
    o = o.view(b, hk, hq // hk, hk, d)
    return torch.diagonal(o, dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(b, hq, d)
