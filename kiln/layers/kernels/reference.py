"""kiln's CPU kernels written in PyTorch: the layouts they read (`pack_q4`'s int4 tiles), what
they compute (`q4_reference`, `kq_reference`, the activations' int8 rounding), the output
shapes torch.compile traces them with (`register_fakes`) and the check a library passes before
it is used (`self_check`).

None of it calls a library through the selected level (kiln.layers.kernels' `lib()`): the
builder (build.py) checks each level's library with these before any level is chosen, and the
ops (ops.py, kiln/layers/quant/gguf_blocks.py) call the chosen one; so this module sits below both.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F

from kiln.layers.kernels.formats import GGML_TYPES, KQUANT_TYPES, GGUFBlocks

Q4_TILE = 8  # output rows per tile of pack_q4's layout
Q4_BLOCK = 160  # bytes per (tile, group of 32): 128 of codes, 8 fp16 scales, 8 fp16 mins
# The same block without its mins, for GGUF Q4_0's symmetric blocks (min = -8 scale, which the
# kernels compute in fp32: the same value the fp16 min held): 10% fewer bytes to stream.
Q4_SYM_BLOCK = 144


def pack_q4(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor | None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """4-bit groups of 32 (codes q [..., N, K] in 0..15, scale and min [..., N, K/32]; w = scale
    * q + min) -> the kernels' layout, uint8 [..., ceil(N/8), K/32, 160] (see q4_tiles.cpp):
    per tile of 8 rows and group, 4 vectors of 32 bytes, vector k holding bytes 4k..4k+3 of
    each row r at 4r (byte j of a row = q[j] | q[j+16] << 4), then the 8 rows' fp16 scales,
    then their fp16 mins. Rows
    past N are zeros. Leading dimensions (a layer's stacked experts) are packed in the same
    call; `out` (that shape, any strides with contiguous 160-byte blocks: a slice of a larger
    buffer) is written in place and returned. mn None: symmetric groups (min = -8 scale), packed
    without mins into Q4_SYM_BLOCK-byte blocks."""
    *lead, n, k = q.shape
    g = k // 32
    if out is None:
        block = Q4_BLOCK if mn is not None else Q4_SYM_BLOCK
        out = torch.empty(*lead, -(-n // Q4_TILE), g, block, dtype=torch.uint8)
    if lead:  # one matrix at a time: the joined codes below stay one matrix's size
        for idx in itertools.product(*map(range, lead)):
            pack_q4(q[idx], scale[idx], None if mn is None else mn[idx], out[idx])
        return out
    c = q.to(torch.uint8).reshape(n, g, 2, 16)
    byte = c[..., 0, :] | (c[..., 1, :] << 4)  # [N, G, 16]
    return _tiles(byte, scale.reshape(n, g), None if mn is None else mn.reshape(n, g), out)


# GGUF block bytes (d [, m], 16 bytes of codes) of the 4-bit types pack_q4_blocks takes
_Q4_BLOCKS = {"Q4_0": 18, "Q4_1": 20}


def pack_q4_blocks(raw: torch.Tensor, type_name: str, k: int,
                   out: torch.Tensor | None = None, block: int = Q4_BLOCK) -> torch.Tensor:
    """GGUF Q4_0 / Q4_1 rows (raw uint8 [..., N, K/32 * block bytes], e.g. a view of the file's
    memory map) -> pack_q4's tiles, equal byte for byte to pack_q4 of the blocks' codes, scales
    and mins. A block's 16 code bytes are already pack_q4's (byte j = q[j] | q[j+16] << 4) and
    its fp16 scale (and Q4_1's min) are stored as they are, so nothing is unpacked: the bytes are
    moved once (a 14 B-parameter model's experts in seconds, where unpacking every code to a byte
    and packing it again touched twice the model's size in fresh memory). Q4_0's min, -8 d, is
    exact in fp16 (a power of two times an fp16). `block` Q4_SYM_BLOCK (Q4_0 only; or `out`'s
    last dimension): the tiles without their mins."""
    block = out.shape[-1] if out is not None else block
    if block == Q4_SYM_BLOCK and type_name != "Q4_0":
        raise ValueError(f"pack_q4_blocks: {type_name} has mins; only Q4_0 packs without them")
    bb = _Q4_BLOCKS[type_name]
    *lead, n, _ = raw.shape
    g = k // 32
    b = raw.reshape(*lead, n, g, bb)
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1)  # [..., N, G]
    if type_name == "Q4_1":
        mn, codes = b[..., 2:4].contiguous().view(torch.float16).squeeze(-1), b[..., 4:20]
    else:
        mn, codes = (None if block == Q4_SYM_BLOCK else d * -8.0), b[..., 2:18]
    return _tiles(codes, d, mn, out)


def _tiles(byte: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor | None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """byte [..., N, G, 16] (a row's group of 32 codes, byte j = q[j] | q[j+16] << 4) and
    scale, mn [..., N, G] (stored as fp16) -> tiles [..., ceil(N/8), G, 160], written by strided
    copies straight into `out` (no concatenated temporaries). mn None: the 144-byte blocks
    without mins (Q4_SYM_BLOCK)."""
    *lead, n, g, _ = byte.shape
    nt = -(-n // Q4_TILE)
    full = n // Q4_TILE
    if out is None:
        out = torch.empty(*lead, nt, g, Q4_BLOCK if mn is not None else Q4_SYM_BLOCK,
                          dtype=torch.uint8)
    # One strided copy for all the leading matrices (a layer's experts) at once: on a busy
    # machine each parallel region waits for its threads to be scheduled, and a loop over
    # experts made 60 times as many (60 x [2816, 2048] Q4_0 gate_up at load average 3.5 on 2
    # cores: 0.49 s at once, 0.86 s one expert at a time).
    if full:
        f = full * Q4_TILE
        # Vector k of a group holds each row's bytes 4k..4k+3, row r in lane r: a permutation of
        # views, not a gather.
        dst = out[..., :full, :, :128].unflatten(-1, (4, Q4_TILE, 4))  # [..., T, G, k, r, 4]
        src = byte[..., :f, :, :].unflatten(-3, (full, Q4_TILE)).unflatten(-1, (4, 4))
        nd = src.dim()  # src [..., T, r, G, k, 4]
        dst.copy_(src.permute(*range(nd - 5), nd - 5, nd - 3, nd - 2, nd - 4, nd - 1))
        for off, v in ((128, scale), (144, mn))[:2 if mn is not None else 1]:
            half = out[..., :full, :, off:off + 16].view(torch.float16)  # [..., T, G, 8 rows]
            half.copy_(v[..., :f, :].unflatten(-2, (full, Q4_TILE)).transpose(-1, -2))
    if nt > full:  # the last, partial tile: rows past N are zeros
        f, r = full * Q4_TILE, n - full * Q4_TILE
        pb = byte.new_zeros(*lead, Q4_TILE, g, 16)
        pb[..., :r, :, :] = byte[..., f:, :, :]
        ps = scale.new_zeros(*lead, Q4_TILE, g)
        ps[..., :r, :] = scale[..., f:, :]
        pm = None
        if mn is not None:
            pm = mn.new_zeros(*lead, Q4_TILE, g)
            pm[..., :r, :] = mn[..., f:, :]
        _tiles(pb, ps, pm, out[..., full:, :, :])
    return out


def symmetric(scale: torch.Tensor, mn: torch.Tensor) -> bool:
    """Whether int4 groups are symmetric, min = -8 scale in every group (GGUF Q4_0's), so that
    pack_q4 can drop their mins (mn None)."""
    return torch.equal(mn, scale * -8.0)


def as_block(packed: torch.Tensor, n: int, block: int) -> torch.Tensor | None:
    """pack_q4's tiles of an [n, K] weight in `block`-byte blocks (Q4_BLOCK or Q4_SYM_BLOCK):
    as they are, or unpacked and packed again; None where mins would be dropped that are not
    -8 scale."""
    if packed.shape[-1] == block:
        return packed
    q, s, mn = unpack_q4(packed, n)
    if block == Q4_SYM_BLOCK and not symmetric(s, mn):
        return None
    return pack_q4(q, s, None if block == Q4_SYM_BLOCK else mn)


def unpack_q4(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack_q4's inverse: (codes uint8 [n, K], scale fp32 [n, K/32], min fp32 [n, K/32]); the
    144-byte blocks' min is -8 scale."""
    nt, g, _ = packed.shape
    b = packed[..., :128].reshape(nt, g, 4, Q4_TILE, 4)  # [NT, G, k, r, 4]
    b = b.permute(0, 1, 3, 2, 4).reshape(nt, g, Q4_TILE, 16)  # a row's 16 bytes in order
    q = torch.stack([b & 0x0F, b >> 4], dim=-2)  # [NT, G, 8, 2 halves, 16]
    q = q.permute(0, 2, 1, 3, 4).reshape(nt * Q4_TILE, g * 32)[:n]

    def f32(off: int) -> torch.Tensor:
        return packed[..., off:off + 16].contiguous().view(torch.float16).transpose(1, 2) \
            .reshape(nt * Q4_TILE, g)[:n].float()

    scale = f32(128)
    return q, scale, (f32(144) if packed.shape[-1] == Q4_BLOCK else scale * -8.0)


def quantize_act_q8(x: torch.Tensor, span: int = 32) -> torch.Tensor:
    """What the kernels see of an activation x [M, K]: int8 per span of 32 values (256
    for the GGUF K-quants' kernels; scale amax/127, round half to even), returned dequantized
    in fp32 (tests, self-check)."""
    m, k = x.shape
    g = x.float().reshape(m, k // span, span)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(g * inv) * (amax / 127.0)).reshape(m, k)


def q4_reference(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """q4_linear in fp32 PyTorch: scale * (q . xq) with x's int8 rounding, plus min * sum(x)
    with x unrounded (what the kernel computes)."""
    q, s, mn = unpack_q4(packed, n)
    m, k = x.shape
    g = k // 32
    xq = quantize_act_q8(x).reshape(m, g, 32)
    dots = torch.einsum("mgi,ngi->mng", xq.double(), q.reshape(n, g, 32).double())
    sums = x.double().reshape(m, g, 32).sum(-1)  # [M, G]
    return ((dots * s.double()).sum(-1) + sums @ mn.double().t()).float()


def quantize_act(x: torch.Tensor, type_name: str = "Q8_0") -> torch.Tensor:
    """The activation as the kernel sees it for weights of `type_name`: int8 per span of the
    type's block (32 values, or a K-quant's super-block of 256: llama.cpp's Q8_0 and Q8_K
    forms), returned dequantized; the kernels' rounding, one definition for all."""
    return quantize_act_q8(x, GGML_TYPES[KQUANT_TYPES[type_name]][1])


def kq_reference(x: torch.Tensor, parts: list[GGUFBlocks]) -> torch.Tensor:
    """What kq_linear computes, in fp32 PyTorch (tests, self-check)."""
    return torch.cat([F.linear(quantize_act(x.float(), p.type_name), p.dequantize(torch.float32))
                      for p in parts], dim=-1)


def random_blocks(rows: int, k: int, type_name: str, g: torch.Generator) -> GGUFBlocks:
    """Random bytes with sane fp16 scales (self-check; the tests use gguf's quantizers)."""
    _, be, bb = next(v for v in GGML_TYPES.values() if v[0] == type_name)
    nb = rows * k // be
    raw = torch.randint(0, 256, (nb, bb), dtype=torch.uint8, generator=g)
    offs = {"Q8_0": [0], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
            "Q6_K": [208]}[type_name]
    for off in offs:
        d = (torch.rand(nb, generator=g) * 0.01 + 1e-3).to(torch.float16)
        raw[:, off:off + 2] = d.view(torch.uint8).reshape(nb, 2)
    return GGUFBlocks(raw.reshape(rows, -1), type_name, k)


def register_fakes(ns: str) -> None:
    """Output shapes for torch.compile's tracing of library `ns` (the kernels run as one opaque
    call each): ops.cpp's and layers.cpp's ops, then kquant.cpp's kq_linear."""
    @torch.library.register_fake(f"{ns}::q4_linear")
    def _(x, packed, n):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake(f"{ns}::attend_rows")
    def _(q, k, v, table, row_of, lens, scale):
        return q.new_empty((*q.shape[:2], v.shape[-1]), dtype=torch.float32)

    @torch.library.register_fake(f"{ns}::rope_write")
    def _(qkv, cos, sin, k, v, slots, num_heads):
        return qkv.new_empty((qkv.shape[0], num_heads, k.shape[2]))

    @torch.library.register_fake(f"{ns}::rms_norm")
    def _(x, w, eps):
        return torch.empty_like(x)

    @torch.library.register_fake(f"{ns}::silu_mul")
    def _(gu):
        return gu.new_empty((gu.shape[0], gu.shape[1] // 2))

    @torch.library.register_fake(f"{ns}::decode_layer")
    def _(x, cos, sin, ln1, ln2, eps, weights, kinds, rows, counts, biases, k, v, slots,
          table, row_of, lens, num_heads, scale, lora=(), lora_seg=None, q_norm=None,
          k_norm=None, qk_eps=0.0):
        return torch.empty_like(x)

    @torch.library.register_fake(f"{ns}::moe_layer")
    def _(x, cos, sin, ln1, ln2, eps, weights, kinds, rows, counts, biases, q_norm, k_norm,
          qk_eps, k, v, slots, table, row_of, lens, num_heads, scale, router, top_k,
          renormalize, w13, w2, shared=0, shared_gate=False):
        return torch.empty_like(x), x.new_empty((x.shape[0], top_k), dtype=torch.long)

    @torch.library.register_fake(f"{ns}::router_logits")
    def _(x, w):
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake(f"{ns}::q8_linear")
    def _(x, w, scale):
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake(f"{ns}::heads_q4")
    def _(x, w, n):
        return x.new_empty((*x.shape[:2], n))

    @torch.library.register_fake(f"{ns}::moe_q4")
    def _(x, ids, weights, w13, w2, threads=0):
        return torch.empty_like(x)

    @torch.library.register_fake(f"{ns}::kq_linear")
    def _(x, weights, types, rows):
        return x.new_empty((x.shape[0], sum(rows)))


def q4_self_check(ns: Any) -> bool:
    """q4_linear of library `ns` against q4_reference, on odd sizes (a padded tile)."""
    g = torch.Generator().manual_seed(0)
    n, k = 21, 96
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    s = torch.rand(n, k // 32, generator=g) * 0.1
    mn = -8 * s + torch.rand(n, k // 32, generator=g) * 0.05
    x = torch.randn(5, k, generator=g)
    packed = pack_q4(q, s, mn)
    q2, s2, mn2 = unpack_q4(packed, n)
    if not (torch.equal(q2, q) and torch.allclose(s2, s, rtol=1e-3)
            and torch.allclose(mn2, mn, rtol=1e-3, atol=1e-5)):
        return False
    got, want = ns.q4_linear(x, packed, n), q4_reference(x, packed, n)
    return torch.allclose(got, want, rtol=1e-4, atol=1e-4)


def kq_self_check(ns: Any) -> bool:
    """kq_linear of library `ns` (the ops of one ISA level) on raw rows and on tiles against
    `kq_reference`, for every type at once."""
    g = torch.Generator().manual_seed(0)
    parts = [random_blocks(5, 512, "Q4_K", g), random_blocks(3, 512, "Q6_K", g),
             random_blocks(4, 512, "Q8_0", g), random_blocks(9, 512, "Q5_0", g),
             random_blocks(2, 512, "Q5_K", g)]
    x = torch.randn(5, 512, generator=g)
    want = kq_reference(x, parts)
    types = [p.type_id for p in parts]
    rows = [p.raw.shape[0] for p in parts]
    raw = ns.kq_linear(x, [p.raw for p in parts], types, rows)
    tiled = ns.kq_linear(x, [ns.kq_pack(p.raw.contiguous(), p.type_id)
                             if ns.has_tiles(p.type_id) else p.raw for p in parts], types, rows)
    tol = {"rtol": 1e-4, "atol": 1e-4 * want.abs().max().item()}
    return bool(torch.allclose(raw, want, **tol) and torch.allclose(tiled, want, **tol))


def self_check(ns: Any) -> bool:
    """Library `ns` (the ops of one ISA level) against the references: q4_linear, then
    kq_linear."""
    return q4_self_check(ns) and kq_self_check(ns)
