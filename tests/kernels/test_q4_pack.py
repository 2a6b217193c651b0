"""The int4 tiles' packing (kiln/layers/kernels/reference.py): pack_q4 over stacked experts in one
call, into slices of a larger buffer, and pack_q4_blocks straight from GGUF Q4_0/Q4_1 blocks,
each byte for byte what packing one matrix at a time from unpacked codes gave; and the loader
handing a GGUF's expert tensors over as those blocks. No kernels run here: the layout is data."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kiln.layers.kernels import reference
from kiln.layers.kernels.formats import GGUFBlocks, q4_groups


def _pack_one_matrix(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """pack_q4 as it was written before it took stacked matrices (one [N, K] matrix: padding
    rows concatenated, the row order gathered, the three parts concatenated): the reference
    whose bytes the faster forms must keep."""
    n, k = q.shape
    g = k // 32
    nt = (n + 7) // 8
    pad = nt * 8 - n
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        scale = torch.cat([scale, scale.new_zeros(pad, g)])
        mn = torch.cat([mn, mn.new_zeros(pad, g)])
    c = q.to(torch.uint8).reshape(nt, 8, g, 2, 16)
    codes = c[..., 0, :] | (c[..., 1, :] << 4)
    # [tile, row, group, 16 bytes] -> per tile and group, vector k = every row's bytes 4k..4k+3
    codes = torch.stack([codes[:, :, :, 4 * k:4 * k + 4] for k in range(4)], dim=2)
    codes = codes.permute(0, 3, 2, 1, 4).reshape(nt, g, 128)  # [tile, group, k, row, 4]

    def f16(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float16).reshape(nt, 8, g).transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat([codes, f16(scale), f16(mn)], dim=-1).contiguous()


def _random_groups(shape: tuple[int, ...], k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (*shape, k), generator=g, dtype=torch.uint8)
    s = torch.rand(*shape, k // 32, generator=g) * 0.02 + 1e-3
    mn = -8 * s + torch.randn(*shape, k // 32, generator=g) * 0.01
    return q, s, mn


@pytest.mark.parametrize("n", [1, 8, 21, 40])
def test_pack_q4_of_stacked_experts_equals_one_expert_at_a_time(n):
    """Three experts packed in one call (n rows each: a partial last tile where n % 8 != 0)
    give the bytes of packing each alone the way it was done before."""
    q, s, mn = _random_groups((3, n), 96, n)
    got = reference.pack_q4(q, s, mn)
    want = torch.stack([_pack_one_matrix(q[e], s[e], mn[e]) for e in range(3)])
    assert got.shape == want.shape == (3, (n + 7) // 8, 3, 160)
    assert torch.equal(got, want)
    assert torch.equal(reference.pack_q4(q[1], s[1], mn[1]), want[1])


def test_pack_q4_writes_gate_and_up_into_slices_of_one_buffer():
    """Gate rows then up rows, packed separately into the two halves of the experts' w13 buffer
    (`out`, a strided slice), equal the pack of the joined rows."""
    i = 16  # rows per part: whole tiles
    gate, up = _random_groups((2, i), 64, 1), _random_groups((2, i), 64, 2)
    w13 = torch.full((2, 2 * i // 8, 2, 160), 0xAA, dtype=torch.uint8)
    reference.pack_q4(*gate, out=w13[:, :i // 8])
    reference.pack_q4(*up, out=w13[:, i // 8:])
    for e in range(2):
        joined = [torch.cat([a[e], b[e]]) for a, b in zip(gate, up, strict=True)]
        assert torch.equal(w13[e], _pack_one_matrix(*joined))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("n", [8, 13])
def test_pack_q4_blocks_equals_pack_q4_of_the_unpacked_codes(type_name, n):
    """gguf-py's Q4_0 / Q4_1 blocks of two experts' weights, packed from their bytes, equal
    pack_q4 of the codes, scales and mins q4_groups unpacks from them (GGUF's code bytes are
    the tiles', and the fp16 scales and mins are kept bit for bit)."""
    k, e = 128, 2
    w = torch.randn(e * n, k, generator=torch.Generator().manual_seed(n)).numpy()
    raw = torch.from_numpy(np.ascontiguousarray(
        gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])))
    got = reference.pack_q4_blocks(raw.view(e, n, -1), type_name, k)
    gq = q4_groups(raw.reshape(-1, raw.shape[1] * 32 // k), type_name)
    want = torch.stack([_pack_one_matrix(gq.q.reshape(e, n, k)[x],
                                         gq.scale.reshape(e, n, k // 32)[x],
                                         gq.min.reshape(e, n, k // 32)[x]) for x in range(e)])
    assert torch.equal(got, want)
    q, s, mn = reference.unpack_q4(got[1], n)  # and they read back as the file's values
    dq = (q.float().view(n, k // 32, 32) * s.unsqueeze(-1) + mn.unsqueeze(-1)).view(n, k)
    file_values = gguf.quants.dequantize(raw[n:].numpy(), gguf.GGMLQuantizationType[type_name])
    torch.testing.assert_close(dq, torch.from_numpy(file_values), rtol=0, atol=1e-6)


def test_gguf_experts_come_as_their_blocks(tmp_path):
    """With `expert_blocks`, a Q4_0 GGUF's stacked expert tensors come from the loader as views
    of the file's blocks (E * rows), whose tiles equal those of the unpacked GroupQuant the
    loader gives otherwise; other tensors are unchanged."""
    from conftest import make_tiny_model

    from kiln.models.gguf_writer import write_gguf
    from kiln.models.loader import iter_tensors, open_checkpoint

    folder = make_tiny_model("qwen3_moe", tmp_path / "st")
    ck = open_checkpoint(folder)
    path = write_gguf(tmp_path / "q4.gguf", ck.config, iter_tensors(ck), qtype="Q4_0")
    gg = open_checkpoint(path)
    plain = dict(iter_tensors(gg, keep_4bit=True))
    blocks = dict(iter_tensors(gg, keep_4bit=True, expert_blocks=True))
    assert plain.keys() == blocks.keys()
    experts = [name for name in blocks if ".experts." in name]
    assert experts and all(isinstance(blocks[n], GGUFBlocks) for n in experts)
    for name in experts:
        b, gq = blocks[name], plain[name]
        assert b.type_name == "Q4_0" and tuple(b.shape) == tuple(gq.shape)
        assert torch.equal(reference.pack_q4_blocks(b.raw, "Q4_0", b.in_features),
                           reference.pack_q4(gq.q, gq.scale, gq.min))
    others = [name for name in blocks if ".experts." not in name]
    assert all(type(blocks[n]) is type(plain[n]) for n in others)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_the_kernels_pack_of_gguf_blocks_equals_the_reference(kernel_level, type_name):
    """ops.cpp's pack_q4_blocks (what a load runs) gives reference.pack_q4_blocks' bytes
    at every ISA level: three experts of 21 rows (a partial tile), packed into a strided slice
    of a larger stack whose other bytes stay as they were, with fp16 scales at the edges (a
    subnormal, one whose Q4_0 min -8 d overflows to -inf, a negative zero)."""
    from kiln.layers.kernels import ops

    bb = {"Q4_0": 18, "Q4_1": 20}[type_name]
    e, n, k = 3, 21, 96
    g = torch.Generator().manual_seed(bb)
    raw = torch.randint(0, 256, (e, n, k // 32 * bb), generator=g, dtype=torch.uint8)
    edge = torch.tensor([1e-7, 9000.0, -0.0, 0.01], dtype=torch.float16).view(torch.uint8)
    for j in range(3):  # the scales of row 0's three groups, and of one in the partial tile
        raw[0, 0, j * bb:j * bb + 2] = edge[2 * j:2 * j + 2]
    raw[2, 20, 0:2] = edge[6:8]
    stack = torch.full((e, 6, k // 32, 160), 0x5A, dtype=torch.uint8)
    out = stack[:, 1:4]  # ceil(21 / 8) = 3 tiles, between untouched ones
    got = ops.pack_q4_blocks(raw, type_name, k, out=out)
    want = reference.pack_q4_blocks(raw, type_name, k)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(stack[:, 1:4], want)
    assert bool((stack[:, 0] == 0x5A).all()) and bool((stack[:, 4:] == 0x5A).all())
    assert torch.equal(ops.pack_q4_blocks(raw[1], type_name, k), want[1])  # one matrix, no out


@pytest.mark.parametrize("n", [8, 21])
def test_q4_0_packs_without_mins(kernel_level, n):
    """Q4_0 blocks packed without their mins (reference.Q4_SYM_BLOCK: 144 bytes a block) are
    the 160-byte tiles less bytes 144..159 of each block, from the kernels' packer and the
    reference alike (a scale whose -8 d overflows fp16 among them); they read back as the same
    codes and scales, the min -8 scale. Q4_1, which has mins, refuses."""
    from kiln.layers.kernels import ops

    e, k = 2, 96
    g = torch.Generator().manual_seed(n)
    raw = torch.randint(0, 256, (e, n, k // 32 * 18), generator=g, dtype=torch.uint8)
    d = (torch.rand(e, n, k // 32, generator=g) * 0.02 + 1e-3).half().view(torch.uint8)
    raw.view(e, n, k // 32, 18)[..., :2] = d.view(e, n, k // 32, 2)
    raw[0, 0, 0:2] = torch.tensor([9000.0], dtype=torch.float16).view(torch.uint8)
    full = reference.pack_q4_blocks(raw, "Q4_0", k)
    sym = reference.pack_q4_blocks(raw, "Q4_0", k, block=reference.Q4_SYM_BLOCK)
    assert sym.shape[-1] == reference.Q4_SYM_BLOCK and torch.equal(sym, full[..., :144])
    assert torch.equal(ops.pack_q4_blocks(raw, "Q4_0", k, block=reference.Q4_SYM_BLOCK), sym)
    q, s, mn = reference.unpack_q4(full[1], n)
    q2, s2, mn2 = reference.unpack_q4(sym[1], n)
    assert torch.equal(q, q2) and torch.equal(s, s2) and torch.equal(mn2, s * -8.0)
    assert torch.equal(mn, mn2)  # (row 0 of expert 0 holds the overflowing scale)
    with pytest.raises(ValueError, match="Q4_1"):
        reference.pack_q4_blocks(raw, "Q4_1", k, block=reference.Q4_SYM_BLOCK)


def test_as_block_moves_tiles_between_the_two_blocks():
    """reference.as_block: symmetric groups go from 160-byte blocks to 144 and back with the
    same codes and scales; asymmetric ones are not stripped of their mins (None)."""
    q, s, _ = _random_groups((21,), 64, 5)
    s = s.half().float()
    full = reference.pack_q4(q, s, s * -8.0)
    sym = reference.pack_q4(q, s, None)
    assert sym.shape[-1] == reference.Q4_SYM_BLOCK and torch.equal(sym, full[..., :144])
    assert torch.equal(reference.as_block(full, 21, reference.Q4_SYM_BLOCK), sym)
    assert torch.equal(reference.as_block(sym, 21, reference.Q4_BLOCK), full)
    assert reference.as_block(full, 21, reference.Q4_BLOCK) is full
    asym = reference.pack_q4(*_random_groups((21,), 64, 6))
    assert reference.as_block(asym, 21, reference.Q4_SYM_BLOCK) is None


def _q4_blocks(rows: int, k: int, type_name: str, seed: int) -> GGUFBlocks:
    """gguf-py's blocks of a random [rows, k] weight."""
    w = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).numpy()
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    return GGUFBlocks(torch.from_numpy(np.ascontiguousarray(raw)), type_name, k)


@pytest.mark.parametrize(("shards", "block"), [
    ((("Q4_0", 32), ("Q4_0", 16), ("Q4_0", 16)), 144),  # a fused qkv: no mins, as Q4_0 has none
    ((("Q4_1", 24), ("Q4_1", 21)), 160),  # the last shard ends inside a tile
    ((("Q4_0", 16), ("Q4_1", 16)), 160),  # mixed: Q4_0's min -8 d written out
    ((("Q4_0", 13), ("Q4_0", 16)), 144),  # a shard ends inside a tile: packed from its groups
])
def test_int4_linear_packs_gguf_blocks_as_their_groups_would(kernel_level, shards, block):
    """An Int4Linear made from a layer's GGUF Q4_0 / Q4_1 shards (views of the file, what the
    loader hands over where kiln's kernels run) holds the bytes of one made from the same
    weight unpacked to 4-bit groups, and computes the same bits."""
    from kiln.layers.kernels.formats import GroupQuant
    from kiln.layers.quant.linear import Int4Linear

    k = 64
    parts = [_q4_blocks(rows, k, t, seed) for seed, (t, rows) in enumerate(shards)]
    from_blocks = Int4Linear(parts, None, torch.float32)
    from_groups = Int4Linear(GroupQuant.cat([b.groups() for b in parts]), None, torch.float32)
    assert from_blocks.kernel == from_groups.kernel
    assert torch.equal(from_blocks.packed, from_groups.packed)
    if from_blocks.kernel == "q4":
        assert from_blocks.packed.shape[-1] == block
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(7))
    assert torch.equal(from_blocks(x), from_groups(x))
    want = x @ torch.cat([b.dequantize() for b in parts]).T  # the file's values, x in int8
    assert float((from_blocks(x) - want).norm() / want.norm()) < 0.02


def test_gguf_q4_linears_come_as_their_blocks_where_the_kernels_run(tmp_path):
    """With `keep_blocks` (kiln's kernels run) a Q4_0 GGUF's linear layers come from the loader
    as views of the file's blocks, not unpacked: the same codes and scales as the groups it
    hands over otherwise; a model built from them has the int4 tiles of one built from the
    groups (--no-gguf-kernels, under which the loader unpacks them)."""
    from conftest import make_tiny_model

    from kiln.layers.kernels.formats import GroupQuant
    from kiln.models.gguf_writer import write_gguf
    from kiln.models.loader import build_model, iter_tensors, open_checkpoint

    folder = make_tiny_model("llama", tmp_path / "st")
    ck = open_checkpoint(folder)
    path = write_gguf(tmp_path / "q4.gguf", ck.config, iter_tensors(ck), qtype="Q4_0")
    gg = open_checkpoint(path)
    blocks = dict(iter_tensors(gg, keep_4bit=True, keep_blocks=True))
    plain = dict(iter_tensors(gg, keep_4bit=True))
    linears = [n for n, t in plain.items() if isinstance(t, GroupQuant)]
    assert linears and all(isinstance(blocks[n], GGUFBlocks) for n in linears)
    assert all(blocks[n].type_name == "Q4_0" for n in linears)
    for n in linears:
        assert torch.equal(blocks[n].groups().q, plain[n].q)
        assert torch.equal(blocks[n].groups().scale, plain[n].scale)

    from kiln.layers.quant.linear import Int4Linear
    from kiln.settings.engine_config import QuantConfig

    def tiles(gguf_kernels: bool) -> dict[str, torch.Tensor]:
        quant = QuantConfig(method="int4", cpu_kernels=True, cpu_isa="auto",
                            gguf_kernels=gguf_kernels, batch_invariant=False, tile_cache=False)
        model = build_model(gg, dtype=torch.float32, device="cpu", max_positions=64, quant=quant)
        return {n: m.packed for n, m in model.named_modules() if isinstance(m, Int4Linear)}

    on, off = tiles(True), tiles(False)
    assert on and on.keys() == off.keys()
    assert all(torch.equal(on[n], off[n]) for n in on)
