"""GGUF blocks run as they are (kiln/layers/quant/gguf_blocks.py, kiln/layers/kernels/kquant.cpp), at every ISA level: the kernel against the
dequantized-weight matmul for every type, odd row counts, activation tails past a register
block and a 64-row chunk, layers mixing types; kiln's dequantizer against the `gguf` package's;
the 8-row tiles (gguf_blocks.pack) bit for bit back to the blocks, and their kernel against the
row kernel and the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.layers.kernels import ops, reference
from kiln.layers.kernels.choose import Choice
from kiln.layers.kernels.formats import EMBED_ROW_TYPES, GGML_TYPES, KQUANT_TYPES, GGUFBlocks
from kiln.layers.quant import gguf_blocks
from kiln.layers.quant.gguf_blocks import KQuantLinear

gguf = pytest.importorskip("gguf")

needs_kernel = pytest.mark.usefixtures("kernel_level")  # at every ISA level this CPU runs


def _blocks(rows: int, k: int, type_name: str, seed: int) -> GGUFBlocks:
    """Weights as GGUF stores them: the `gguf` package's quantizer where it has one (Q8_0,
    Q5_0, Q5_1), else random bytes with sane fp16 scales (any bit pattern of a K-quant's
    codes and 6-bit scales is a valid block)."""
    qt = gguf.GGMLQuantizationType[type_name]
    rng = np.random.default_rng(seed)
    try:
        w = rng.standard_normal((rows, k)).astype(np.float32) * 0.05
        raw = gguf.quants.quantize(w, qt)
        return GGUFBlocks(torch.from_numpy(np.ascontiguousarray(raw)), type_name, k)
    except NotImplementedError:
        return reference.random_blocks(rows, k, type_name, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("type_name", sorted(KQUANT_TYPES))
def test_dequantizer_matches_gguf_package(type_name: str) -> None:
    """The reference's weights (kiln/layers/kernels/formats.py) are what the `gguf` package
    decodes."""
    b = _blocks(7, 512, type_name, 1)
    ours = b.dequantize(torch.float32).numpy()
    theirs = gguf.quants.dequantize(b.raw.numpy(), gguf.GGMLQuantizationType[type_name])
    np.testing.assert_allclose(ours, theirs.reshape(ours.shape), rtol=1e-6, atol=1e-7)


@needs_kernel
@pytest.mark.parametrize("type_name", sorted(KQUANT_TYPES))
@pytest.mark.parametrize("m", [1, 3, 5, 70])
def test_kernel_matches_reference(type_name: str, m: int) -> None:
    rows, k = 13, 768  # odd rows: a partial tile of 8; 768 = 3 K-quant super-blocks
    b = _blocks(rows, k, type_name, 2)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = gguf_blocks.kq_linear(x, [b.raw], [b.type_id])
    want = reference.kq_reference(x, [b])
    assert got.shape == (m, rows)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
    # and close to the unrounded activation (the int8 rounding of x is all that differs)
    exact = x @ b.dequantize(torch.float32).t()
    rel = (got - exact).norm() / exact.norm()
    assert rel < 2e-2, rel


@needs_kernel
@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_round_the_activation_per_super_block(type_name: str) -> None:
    """The K-quants' kernels see the activation rounded per 256 values (llama.cpp's Q8_K: one
    scale per super-block, so the tiles sum a super-block in int32), the others per 32: one
    large value in a super-block coarsens its 255 neighbours' rounding, and the kernel follows
    the per-256 reference, not the per-32 one."""
    rows, k = 16, 512
    b = _blocks(rows, k, type_name, 21)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(5))
    x[:, 7] = 40.0  # sets the first super-block's scale
    got = gguf_blocks.kq_linear(x, [gguf_blocks.pack(b)], [b.type_id], [rows])
    w = b.dequantize(torch.float32)
    per256 = reference.quantize_act(x, type_name) @ w.t()
    per32 = reference.quantize_act(x, "Q8_0") @ w.t()
    tol = 2e-5 * per256.abs().max().item()
    torch.testing.assert_close(got, per256, rtol=2e-5, atol=tol)
    assert (got - per32).abs().max().item() > 100 * tol


TILED = sorted(KQUANT_TYPES)  # every type has tiles


@needs_kernel
@pytest.mark.parametrize("type_name", TILED)
@pytest.mark.parametrize("rows", [5, 16, 21])
def test_pack_round_trip(type_name: str, rows: int) -> None:
    """The tiles hold the blocks' bits, moved (no rounding): unpack gives the raw rows back
    exactly, including the scales' 6-bit packing (Q4_K, Q5_K), the mins (Q5_1) and the high
    bits (Q5_0, Q5_1, Q5_K, Q6_K). Pack moves the codes a group at a time (kquant.cpp's
    pack_codes), unpack bit by bit (map_block, the layout's definition): the round trip holds
    the two to one layout."""
    assert gguf_blocks.has_tiles(type_name)
    b = _blocks(rows, 512, type_name, rows)
    packed = gguf_blocks.pack(b)
    assert packed.shape[0] == (rows + 7) // 8 and packed.dtype == torch.uint8
    # about the blocks' size: K-quants' unpacked scales add 32 bytes per 8 blocks, others nothing
    assert packed.numel() <= 1.03 * b.raw.numel() * ((rows + 7) // 8 * 8) / rows
    back = gguf_blocks.unpack(packed, type_name, rows, 512)
    assert torch.equal(back.raw, b.raw)
    # random bytes too: every bit of a block has its place in the tile
    r = reference.random_blocks(rows, 512, type_name, torch.Generator().manual_seed(rows))
    r.raw.random_(0, 256, generator=torch.Generator().manual_seed(1))
    assert torch.equal(gguf_blocks.unpack(gguf_blocks.pack(r), type_name, rows, 512).raw, r.raw)


@needs_kernel
@pytest.mark.parametrize("type_name", TILED)
@pytest.mark.parametrize("m", [1, 4, 7, 70])
def test_tiles_match_rows_and_reference(type_name: str, m: int) -> None:
    """The tiled kernel's outputs are the row kernel's and the dequantized reference's up to
    fp32 summation order (the same integer products, the same activation rounding)."""
    rows, k = 21, 768  # a partial tile (21 = 8 + 8 + 5); 768 = 3 K-quant super-blocks
    b = _blocks(rows, k, type_name, 12)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + m))
    tiled = gguf_blocks.kq_linear(x, [gguf_blocks.pack(b)], [b.type_id], [rows])
    raw = gguf_blocks.kq_linear(x, [b.raw], [b.type_id], [rows])
    want = reference.kq_reference(x, [b])
    tol = {"rtol": 2e-5, "atol": 2e-5 * want.abs().max().item()}
    torch.testing.assert_close(tiled, raw, **tol)
    torch.testing.assert_close(tiled, want, **tol)
    # batch-invariant: a row alone is the same row inside the batch (with 70 rows: inside a
    # 16-row pass (Q8_0 on AVX-512), an 8-row one and the tail)
    for i in sorted({0, m // 2, m - 1}):
        assert torch.equal(gguf_blocks.kq_linear(x[i:i + 1], [gguf_blocks.pack(b)], [b.type_id], [rows]),
                           tiled[i:i + 1]), i


@needs_kernel
def test_mixed_parts_bf16_and_batch_invariance() -> None:
    """A merged layer of Q4_K + Q5_0 + Q6_K + Q8_0 rows (as a Q4_K_M qkv can be), bf16
    activations, a row alone equal to the same row inside a batch of 9."""
    parts = [_blocks(9, 512, "Q4_K", 3), _blocks(4, 512, "Q5_0", 4), _blocks(11, 512, "Q6_K", 5),
             _blocks(2, 512, "Q8_0", 6)]
    lin = KQuantLinear(parts, torch.randn(26), torch.float32)
    assert lin.kernel == "gguf" and lin.out_features == 26
    assert lin.tiled == [True, True, True, True]
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(0))
    y = lin(x)
    want = reference.kq_reference(x, parts) + lin.bias
    torch.testing.assert_close(y, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
    assert torch.equal(lin(x[4:5]), y[4:5])
    yb = KQuantLinear(parts, None, torch.bfloat16)(x.bfloat16())
    assert yb.dtype == torch.bfloat16
    wb = reference.kq_reference(x.bfloat16().float(), parts)
    torch.testing.assert_close(yb.float(), wb, rtol=1e-2, atol=1e-2 * wb.abs().max().item())


@needs_kernel
def test_tiles_beside_row_kernel_parts() -> None:
    """One call may mix raw-row parts and tiled parts, each part's rows in place; a layer of
    Q5_K + Q4_K + Q5_1 + Q6_K tiles them all; dequantize() unpacks the tiles."""
    parts = [_blocks(6, 512, "Q5_K", 13), _blocks(11, 512, "Q4_K", 14), _blocks(3, 512, "Q5_1", 15),
             _blocks(9, 512, "Q6_K", 16)]
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(3))
    want = reference.kq_reference(x, parts)
    tol = {"rtol": 2e-5, "atol": 2e-5 * want.abs().max().item()}
    mixed = gguf_blocks.kq_linear(x, [parts[0].raw, gguf_blocks.pack(parts[1]), gguf_blocks.pack(parts[2]),
                                 parts[3].raw], [q.type_id for q in parts],
                             [q.raw.shape[0] for q in parts])
    torch.testing.assert_close(mixed, want, **tol)
    lin = KQuantLinear(parts, None, torch.float32)
    assert lin.tiled == [True, True, True, True]
    torch.testing.assert_close(lin(x), want, **tol)
    torch.testing.assert_close(lin.dequantize(torch.float32),
                               torch.cat([p.dequantize() for p in parts]))


def test_reference_fallback_without_kernel() -> None:
    """The module's PyTorch path (no kernel): the dequantized weight's matmul."""
    parts = [_blocks(5, 256, "Q6_K", 7), _blocks(3, 256, "Q5_1", 8)]
    lin = KQuantLinear(parts, None, torch.float32)
    lin.kernel_choice = Choice("reference", ("test",))
    x = torch.randn(2, 256)
    w = torch.cat([p.dequantize() for p in parts])
    torch.testing.assert_close(lin(x), x @ w.t())


def test_type_table_matches_ggml() -> None:
    for name, tid in KQUANT_TYPES.items():
        assert GGML_TYPES[tid][0] == name


@needs_kernel
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q6_K"])
def test_block_embedding_rows(type_name: str) -> None:
    """An embedding kept as blocks returns the dequantized table's rows, bit for bit: the
    legacy types through kiln's embed_rows, the K-quants (and any type without the kernels)
    through formats.dequantize_blocks."""
    qt = gguf.GGMLQuantizationType[type_name]
    if type_name in KQUANT_TYPES and type_name not in EMBED_ROW_TYPES:
        b = _blocks(40, 256, type_name, 9)
    else:
        w = np.random.default_rng(9).standard_normal((40, 256)).astype(np.float32)
        w[5] *= 1e4  # large scales: a fused multiply-add would round differently
        b = GGUFBlocks(torch.from_numpy(gguf.quants.quantize(w, qt)), type_name, 256)
    emb = gguf_blocks.BlockEmbedding(b, torch.float32)
    assert emb.kernel_choice.kernel == ("gguf" if type_name in EMBED_ROW_TYPES else "reference")
    ids = torch.tensor([[3, 39, 0], [7, 7, 21], [5, 5, 38]])
    assert torch.equal(emb(ids), b.dequantize()[ids])
    emb.kernel_choice = Choice("reference", ("test",))
    assert torch.equal(emb(ids), b.dequantize()[ids])


@needs_kernel
def test_embed_rows_refuses_an_id_past_the_table() -> None:
    w = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    raw = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0))
    with pytest.raises(RuntimeError, match="out of range"):
        ops.embed_rows(raw, torch.tensor([1, 4]), EMBED_ROW_TYPES["Q8_0"], 64)


@needs_kernel
def test_quantize_linear_takes_blocks_as_they_are_or_falls_back() -> None:
    """A layer whose every shard came as GGUF blocks becomes a KQuantLinear holding them; one
    that mixes them with Q4_0/Q4_1 groups is re-quantized to int4 as before (all of it)."""
    from kiln.layers.linear import MergedLinear
    from kiln.layers.quant.apply import quantize_linear
    from kiln.layers.quant.linear import Int4Linear, quantize_int4_groups

    q, v = _blocks(64, 256, "Q4_K", 10), _blocks(32, 256, "Q8_0", 11)
    lin = MergedLinear(256, {"q": 64, "v": 32})
    lin.stash_quantized("v", v)
    lin.stash_quantized("q", q)
    native = quantize_linear(lin, "int4")
    assert isinstance(native, KQuantLinear) and native.type_names == ["Q4_K", "Q8_0"]
    got = native.blocks()
    assert torch.equal(got[0].raw, q.raw) and torch.equal(got[1].raw, v.raw)
    assert native.tiled == [True, True] and native.blocks0.dim() == 3  # gguf_blocks.pack's tiles

    mixed = MergedLinear(256, {"q": 64, "v": 32})
    mixed.stash_quantized("q", quantize_int4_groups(q.dequantize()))
    mixed.stash_quantized("v", v)
    out = quantize_linear(mixed, "int4")
    assert isinstance(out, Int4Linear)
    want = torch.cat([q.dequantize(), v.dequantize()])
    err = (out.dequantize(torch.float32) - want).abs().max() / want.abs().max()
    assert err < 0.1
