"""kiln's CPU kernels (the kernel sources, kiln/layers/kernels/) against PyTorch, at every ISA
level this CPU runs (the `kernel_level` fixture): the 4-bit packing, q4_linear (int8 activations
x 4-bit weights), moe_q4 (a whole MoE layer's routed experts in one call), attend_rows
(batch-invariant attention), the row kernels, the one-call layer, and the modules that use them."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from kiln.layers.kernels import ops as ck
from kiln.layers.kernels import reference
from kiln.layers.kernels.formats import GroupQuant
from kiln.layers.moe import Experts
from kiln.layers.quant.linear import Int4Linear, quantize_int4_groups
from kiln.layers.router import softmax_topk

pytestmark = pytest.mark.usefixtures("kernel_level")


def _groups(n: int, k: int, seed: int, q4_0: bool = False) -> GroupQuant:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    # fp16-exact scales/mins: the layout stores them in fp16 (as GGUF does)
    s = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.001).half().float()
    mn = -8 * s if q4_0 else (-8 * s + torch.randn(n, k // 32, generator=g) * 0.01).half().float()
    return GroupQuant(q, s, mn, 32)


@pytest.mark.parametrize("n", [8, 21, 768])
def test_pack_q4_round_trips(n):
    """unpack_q4(pack_q4(...)) gives the codes, scales and mins back, padding rows dropped."""
    gq = _groups(n, 96, 0)
    packed = reference.pack_q4(gq.q, gq.scale, gq.min)
    assert packed.shape == ((n + 7) // 8, 3, 160)
    q, s, mn = reference.unpack_q4(packed, n)
    assert torch.equal(q, gq.q)
    assert torch.equal(s, gq.scale) and torch.equal(mn, gq.min)


@pytest.mark.parametrize("m", [1, 3, 16, 40])
@pytest.mark.parametrize("n", [37, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q4_linear_matches_reference(m, n, dtype):
    """q4_linear computes exactly what its PyTorch model says (int8 activations per group of
    32, fp32 sums), and stays within the activations' rounding of the dense fp32 product."""
    k = 256
    gq = _groups(n, k, m + n)
    packed = reference.pack_q4(gq.q, gq.scale, gq.min)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    got = ck.q4_linear(x, packed, n)
    assert got.dtype == dtype and got.shape == (m, n)
    # a row alone (one tile at a time) gives the bits it has among 16 or 40 (pairs of tiles in
    # 512-bit vectors on AVX-512)
    assert torch.equal(ck.q4_linear(x[-1:], packed, n), got[-1:])
    want = reference.q4_reference(x.float(), packed, n)
    tol = 1e-4 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    dense = x.float() @ gq.dequantize().t()
    # int8 activations: per element error <= amax/254; random signs give ~1% of the norm
    err = (got.float() - dense).norm() / dense.norm()
    assert err < 2e-2, err


@pytest.mark.parametrize("t", [1, 5, 70])
def test_heads_q4_is_q4_linear_per_head(t):
    """heads_q4 (MLA's per-head up-projections) gives each head exactly q4_linear of that
    head's rows against that head's tiles (a cut-short last tile included), and a row's
    result alone equals its result in the batch."""
    heads, n, k = 3, 21, 64
    gqs = [_groups(n, k, 40 + h, q4_0=True) for h in range(heads)]
    w = torch.stack([reference.pack_q4(gq.q, gq.scale, gq.min) for gq in gqs])
    x = torch.randn(t, heads, k, generator=torch.Generator().manual_seed(t))
    got = ck.heads_q4(x, w, n)
    assert got.shape == (t, heads, n)
    for h in range(heads):
        assert torch.equal(got[:, h], ck.q4_linear(x[:, h].contiguous(), w[h], n))
    assert torch.equal(ck.heads_q4(x[-1:], w, n), got[-1:])


def test_int4_linear_runs_the_q4_kernel(kernel_level):
    """Int4Linear where kiln's kernels run picks q4_linear (the chooser says so, naming the
    level), keeps dequantize() exact, and agrees with the dense product; use_kernels=False keeps
    PyTorch's path, saying why."""
    w = torch.randn(48, 128) * 0.05
    gq = quantize_int4_groups(w)
    lin = Int4Linear(gq, None, torch.float32)
    assert lin.kernel == "q4" and "q4" in lin.extra_repr()
    assert f"at {kernel_level}" in lin.kernel_choice.why
    # scale and min are kept in fp16 (relative rounding 2^-11 of values up to ~0.1)
    torch.testing.assert_close(lin.dequantize(torch.float32), gq.dequantize(), rtol=0, atol=5e-4)
    x = torch.randn(5, 128)
    ref = x @ gq.dequantize().t()
    assert (lin(x) - ref).norm() / ref.norm() < 2e-2
    off = Int4Linear(gq, None, torch.float32, use_kernels=False)
    assert off.kernel != "q4" and "--no-cpu-kernels" in off.kernel_choice.why


def _moe_weights(e: int, h: int, i: int, seed: int) -> tuple[list[GroupQuant], list[GroupQuant]]:
    return ([_groups(2 * i, h, seed + 2 * j, q4_0=j % 2 == 0) for j in range(e)],
            [_groups(h, i, seed + 2 * j + 1) for j in range(e)])


def _moe_reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   w13: list[GroupQuant], w2: list[GroupQuant], emulate: bool) -> torch.Tensor:
    """The per-expert loop in fp32. `emulate`: activations rounded to int8 per group as the
    kernel does (x before gate/up, h before down), else exact."""
    i = w2[0].shape[1]
    y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for e in ids.unique().tolist():
        tok, j = (ids == e).nonzero(as_tuple=True)
        xe = x[tok].float()
        gate_up = w13[e].dequantize()
        if emulate:
            gu = reference.q4_reference(
                xe, reference.pack_q4(w13[e].q, w13[e].scale, w13[e].min), 2 * i)
        else:
            gu = xe @ gate_up.t()
        h = F.silu(gu[:, :i]) * gu[:, i:]
        if emulate:
            out = reference.q4_reference(
                h, reference.pack_q4(w2[e].q, w2[e].scale, w2[e].min), x.shape[1])
        else:
            out = h @ w2[e].dequantize().t()
        y.index_add_(0, tok, (out * weights[tok, j].unsqueeze(1)).double())
    return y.float()


def _stack(w: list[GroupQuant]) -> torch.Tensor:
    return torch.stack([reference.pack_q4(g.q, g.scale, g.min) for g in w])


def _q4_0_raw(shape: tuple[int, ...], k: int, seed: int) -> torch.Tensor:
    """Random GGUF Q4_0 rows [..., K/32 * 18] with sane fp16 scales."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (*shape, k // 32 * 18), generator=g, dtype=torch.uint8)
    d = (torch.rand(*shape, k // 32, generator=g) * 0.02 + 1e-3).half().view(torch.uint8)
    raw.view(*shape, k // 32, 18)[..., :2] = d.view(*shape, k // 32, 2)
    return raw


@pytest.mark.parametrize("t", [1, 40])
def test_q4_0_tiles_without_mins_compute_the_same_bits(t):
    """A Q4_0 weight packed without its mins (144-byte blocks: the kernels take min = -8
    scale in fp32) gives q4_linear's and moe_q4's bits of the 160-byte tiles, at one row and
    at 40 (AVX-512's pairs of tiles, its register blocks of 8 rows)."""
    sym = reference.Q4_SYM_BLOCK
    x = torch.randn(t, 64, generator=torch.Generator().manual_seed(t))
    raw = _q4_0_raw((40,), 64, 1)
    want = ck.q4_linear(x, ck.pack_q4_blocks(raw, "Q4_0", 64), 40)
    assert torch.equal(ck.q4_linear(x, ck.pack_q4_blocks(raw, "Q4_0", 64, block=sym), 40), want)
    # an Int4Linear of symmetric groups (GGUF Q4_0's) packs them so, and computes those bits
    q, s, _ = reference.unpack_q4(ck.pack_q4_blocks(raw, "Q4_0", 64), 40)
    lin = Int4Linear(GroupQuant(q, s, s * -8.0, 32), None, torch.float32)
    assert lin.kernel == "q4" and lin.packed.shape[-1] == sym and torch.equal(lin(x), want)
    e, i, k = 6, 96, 3
    r13, r2 = _q4_0_raw((e, 2 * i), 64, 2), _q4_0_raw((e, 64), i, 3)
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(t + 1))
    weights, ids = softmax_topk(logits, k, renormalize=True)
    full = ck.moe_q4(x, ids, weights, ck.pack_q4_blocks(r13, "Q4_0", 64),
                     ck.pack_q4_blocks(r2, "Q4_0", i))
    got = ck.moe_q4(x, ids, weights, ck.pack_q4_blocks(r13, "Q4_0", 64, block=sym),
                    ck.pack_q4_blocks(r2, "Q4_0", i, block=sym))
    assert torch.equal(got, full)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("sym", [False, True], ids=["mins", "q4_0"])
def test_one_row_runs_two_weight_streams_with_the_bits_of_a_batch(threads, sym):
    """At one row q4_linear runs each thread's tiles as two halves in lockstep and moe_q4 an
    expert's gate and up tiles, and its down tiles two experts at a time (tile_pair: two
    weight streams a thread): every tile count (an odd half leaves one tile alone), both
    blocks, one thread or two, the bits the same row gets among 5 rows (tile_dot's blocks).
    A token's experts split by whole experts or inside one, with and without the barrier
    between moe_q4's phases, give the same bits."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(threads))
        block = reference.Q4_SYM_BLOCK if sym else reference.Q4_BLOCK
        for n in (8, 16, 24, 37, 72):
            raw = _q4_0_raw((n,), 64, n)
            packed = ck.pack_q4_blocks(raw, "Q4_0", 64, block=block)
            assert torch.equal(ck.q4_linear(x[2:3], packed, n), ck.q4_linear(x, packed, n)[2:3])
        e, i = 7, 96
        r13, r2 = _q4_0_raw((e, 2 * i), 64, 5), _q4_0_raw((e, 64), i, 6)
        w13 = ck.pack_q4_blocks(r13, "Q4_0", 64, block=block)
        w2 = ck.pack_q4_blocks(r2, "Q4_0", i, block=block)
        logits = torch.randn(5, e, generator=torch.Generator().manual_seed(7))
        # k = 3: a token's experts split between 2 threads inside an expert (the barrier
        # between the phases); k = 4: by whole experts, each thread's down tiles reading only
        # the rows its gate and up tiles wrote (no barrier: moe_q4_omp's same_experts)
        for k in (3, 4):
            weights, ids = softmax_topk(logits, k, renormalize=True)
            many = ck.moe_q4(x, ids, weights, w13, w2)
            for t in range(5):
                alone = ck.moe_q4(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], w13, w2)
                assert torch.equal(alone, many[t:t + 1])
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("t", [1, 5, 40])
def test_moe_q4_matches_the_per_expert_loop(t):
    """moe_q4 equals running each active expert over its rows and summing the weighted outputs
    per token: random top-3 routing over 6 experts, so some experts get no rows and the same
    expert serves many tokens."""
    e, h, i, k = 6, 64, 96, 3
    w13, w2 = _moe_weights(e, h, i, t)
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=g)
    logits = torch.randn(t, e, generator=g)
    logits[:, 5] = -1e9  # expert 5 never chosen
    weights, ids = softmax_topk(logits, k, renormalize=True)
    got = ck.moe_q4(x, ids, weights, _stack(w13), _stack(w2))
    want = _moe_reference(x, weights, ids, w13, w2, emulate=True)
    # a token alone (single tiles) gives the bits it has among 40 (experts with 8 rows or more
    # run pairs of tiles on AVX-512)
    assert torch.equal(ck.moe_q4(x[-1:], ids[-1:], weights[-1:], _stack(w13), _stack(w2)),
                       got[-1:])
    # h = silu(gate) * up differs from the reference's in the last bits (fp32 sums, the
    # kernel's exp), enough to move an h element at a rounding boundary by one int8 step
    # (amax/127 of its group): allow a few such steps times the weights' size.
    torch.testing.assert_close(got, want, rtol=1e-3, atol=2e-3 * want.abs().max().item())
    exact = _moe_reference(x, weights, ids, w13, w2, emulate=False)
    assert (got - exact).norm() / exact.norm() < 3e-2
    # bf16 in, bf16 out
    got16 = ck.moe_q4(x.bfloat16(), ids, weights, _stack(w13), _stack(w2))
    assert got16.dtype == torch.bfloat16
    want16 = _moe_reference(x.bfloat16().float(), weights, ids, w13, w2, emulate=True)
    torch.testing.assert_close(got16.float(), want16, rtol=1e-2,
                               atol=2e-3 * want16.abs().max().item())


def test_moe_q4_repeated_expert_and_empty_experts():
    """All tokens on the same two experts (every other expert empty), with the order of a
    token's experts varying: each pair is summed into its own token."""
    e, h, i = 4, 32, 32
    w13, w2 = _moe_weights(e, h, i, 7)
    x = torch.randn(3, h)
    ids = torch.tensor([[2, 0], [0, 2], [2, 0]])
    weights = torch.tensor([[0.7, 0.3], [0.5, 0.5], [1.0, 0.0]])
    got = ck.moe_q4(x, ids, weights, _stack(w13), _stack(w2))
    want = _moe_reference(x, weights, ids, w13, w2, emulate=True)
    # a token alone (single tiles) gives the bits it has among 40 (experts with 8 rows or more
    # run pairs of tiles on AVX-512)
    assert torch.equal(ck.moe_q4(x[-1:], ids[-1:], weights[-1:], _stack(w13), _stack(w2)),
                       got[-1:])
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("renormalize", [True, False])
def test_kernel_routing_is_softmax_topk(renormalize):
    """The kernels' routing (moe.cpp route_row, the one-call MoE layers' and, through
    softmax_topk(kernel=True), the eager layers'): PyTorch's experts, best first, with its
    weights to float rounding; ties go to the lower expert (PyTorch's order there is its own);
    a row routes alike alone."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(33, 64, generator=g) * 3
    logits[0, [7, 40]] = 20.0  # a tie for first place
    want_w, want_ids = softmax_topk(logits, 8, renormalize)
    got_w, got_ids = softmax_topk(logits, 8, renormalize, kernel=True)
    assert torch.equal(got_ids[1:], want_ids[1:]) and got_ids[0, :2].tolist() == [7, 40]
    assert sorted(got_ids[0].tolist()) == sorted(want_ids[0].tolist())
    assert got_w.dtype == torch.float32 and got_ids.dtype == torch.int64
    torch.testing.assert_close(got_w, want_w, rtol=2e-6, atol=1e-7)
    assert torch.equal(ck.softmax_topk(logits[5:6], 8, renormalize)[0], got_w[5:6])


def test_experts_module_runs_stacked_q4():
    """Experts.quantize("int4") keeps the experts stacked for moe_q4 here; forward matches the
    dense module on the dequantized weights, counts its routing, and expert_weights() returns
    the weights it runs."""
    torch.manual_seed(0)
    ex = Experts(8, 64, 32)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, 0.2)
        ex.down_proj.normal_(0, 0.2)
    dense = Experts(8, 64, 32)
    ex.quantize("int4")
    assert ex.w13_q4 is not None  # kiln's kernels run at this level: experts stacked for moe_q4
    assert ex.quantized is None and ex.is_quantized
    with torch.no_grad():
        for j in range(8):
            gu, dn = ex.expert_weights(j)
            dense.gate_up_proj[j] = gu
            dense.down_proj[j] = dn
    x = torch.randn(10, 64)
    weights, ids = softmax_topk(torch.randn(10, 8), 2, renormalize=True)
    got, want = ex(x, weights, ids), dense(x, weights, ids)
    # two int8 roundings (x, then the heavy-tailed h = silu(gate) * up) of ~1.5% each
    assert (got - want).norm() / want.norm() < 5e-2
    assert ex.tokens_per_expert.tolist() == torch.bincount(ids.flatten(), minlength=8).tolist()
    off = Experts(8, 64, 32)
    off.quantize("int4", use_kernels=False)
    assert off.w13_q4 is None and off.quantized is not None


def _attend_inputs(dtype: torch.dtype, hq: int, hk: int, d: int, dv: int, seed: int
                   ) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    s = 200
    k = torch.randn(s, hk, d, generator=g).to(dtype)
    v = torch.randn(s, hk, dv, generator=g).to(dtype)
    slots = torch.randperm(s, generator=g)[:150]
    q = torch.randn(70, hq, d, generator=g)
    return q, k, v, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hk,d,dv", [(9, 3, 64, 64), (16, 1, 128, 128), (8, 2, 32, 40),
                                        (5, 5, 8, 24)])
def test_attend_rows_matches_reference_and_is_batch_invariant(dtype, hq, hk, d, dv):
    """attend_rows against the PyTorch reference, and bit-exact per row whatever shares the
    call: a 70-row prefill chunk (context from 31) equals each row alone, the chunk cut at odd
    points, and the rows as decode rows of a batch (one table row each, mixed lengths, among
    other rows); and with 1 thread or 2 (the work split must not reach a row's arithmetic)."""
    q, k, v, slots = _attend_inputs(dtype, hq, hk, d, dv, hq * d + dv)
    t = q.shape[0]
    lens = torch.arange(31, 31 + t)
    zeros = torch.zeros(t, dtype=torch.long)
    table = slots.view(1, -1)
    whole = ck.attend_rows(q, k, v, table, zeros, lens, 0.3)
    want = ck.attend_rows_reference(q, k, v, table, zeros, lens, 0.3)
    torch.testing.assert_close(whole, want, rtol=1e-5, atol=1e-5)
    alone = torch.cat([ck.attend_rows(q[i:i + 1], k, v, table, zeros[:1], lens[i:i + 1], 0.3)
                       for i in range(t)])
    assert torch.equal(whole, alone)
    cuts = [0, 1, 6, 19, 33, 50, t]
    chunked = torch.cat([ck.attend_rows(q[a:b], k, v, table, zeros[: b - a], lens[a:b], 0.3)
                         for a, b in itertools.pairwise(cuts)])
    assert torch.equal(whole, chunked)
    # decode rows: row i reads table row i; a shuffled batch with a few unrelated rows
    order = torch.randperm(t, generator=torch.Generator().manual_seed(1))
    extra = torch.randperm(150, generator=torch.Generator().manual_seed(2))
    dtable = torch.cat([table.expand(t, -1), extra.view(1, -1)])
    rows = torch.cat([order, torch.tensor([t, t])])
    dlens = torch.cat([lens[order], torch.tensor([7, 150])])
    dq = torch.cat([q[order], q[:2]])
    dec = ck.attend_rows(dq, k, v, dtable, rows, dlens, 0.3)
    assert torch.equal(dec[:t][torch.argsort(order)], whole)
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            assert torch.equal(ck.attend_rows(q, k, v, table, zeros, lens, 0.3), whole)
            assert torch.equal(ck.attend_rows(dq[:1], k, v, dtable, rows[:1], dlens[:1], 0.3),
                               dec[:1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_q8_linear_matches_reference_and_is_row_invariant(scale_dtype):
    """q8_linear (an int8 weight, one scale per row, fp32 activations) against float64, and
    each row the same bits alone as among 9 rows, with 1 or 3 threads; N not a multiple of 4."""
    g = torch.Generator().manual_seed(3)
    n, k = 203, 96
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s = (torch.rand(n, generator=g) * 0.01).to(scale_dtype)
    x = torch.randn(9, k, generator=g)
    got = ck.q8_linear(x, q, s)
    want = x.double() @ (q.double() * s.double().unsqueeze(1)).t()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, torch.cat([ck.q8_linear(x[i:i + 1], q, s) for i in range(9)]))
    threads = torch.get_num_threads()
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            assert torch.equal(ck.q8_linear(x, q, s), got)
    finally:
        torch.set_num_threads(threads)


def test_fixed_int8_head_runs_q8_at_every_row_count():
    """fix_kernel_choice (--batch-invariant) puts an int8 head with a dense copy on q8_linear
    and drops the copy (other int8 layers keep theirs): a row's logits are the same alone as in
    a batch of 16."""
    from torch import nn

    from kiln.layers.quant.apply import fix_kernel_choice
    from kiln.layers.quant.linear import Int8Linear

    head = Int8Linear.from_float(torch.randn(72, 64), None, torch.float32)
    body = Int8Linear.from_float(torch.randn(64, 64), None, torch.float32)
    assert head.q8_ok
    head.keep_dense()
    body.keep_dense()
    model = nn.Module()
    model.body, model.lm_head = body, head
    assert fix_kernel_choice(model) == 2
    assert head.q8 and head.dense is None and not body.q8 and body.dense is not None
    x = torch.randn(16, 64)
    y = head(x)
    assert torch.equal(y, torch.cat([head(x[i:i + 1]) for i in range(16)]))
    torch.testing.assert_close(y, x @ head.dequantize(torch.float32).t(), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- a decoder layer


def _packed_q4(n: int, k: int, seed: int) -> torch.Tensor:
    gq = _groups(n, k, seed)
    return reference.pack_q4(gq.q, gq.scale, gq.min)


def test_elementwise_kernels_match_pytorch_and_keep_rows_apart():
    """rms_norm and silu_mul (the fp32 kernels of the eager steps) against kiln.layers.norm /
    F.silu; every row the same bits alone or among 37."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 96, generator=g)
    w = torch.randn(96, generator=g)
    want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    got = ck.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(ck.rms_norm(x[5:6], w, 1e-5), got[5:6])

    gu = torch.randn(37, 2 * 48, generator=g) * 4
    got = ck.silu_mul(gu)
    torch.testing.assert_close(got, F.silu(gu[:, :48]) * gu[:, 48:], rtol=1e-5, atol=1e-6)
    assert torch.equal(ck.silu_mul(gu[7:8]), got[7:8])


@pytest.mark.parametrize("hq,hk,d", [(9, 3, 64), (4, 4, 128), (6, 2, 96)])
def test_rope_write_equals_rotary_and_the_pool_write(hq, hk, d):
    """rope_write (fp32): q and k rotated as apply_rotary does, k and v stored at their slots,
    other slots left."""
    from kiln.layers.rotary import RotaryEmbedding, apply_rotary

    dtype = torch.float32
    tol = {"rtol": 1e-6, "atol": 1e-6}
    g = torch.Generator().manual_seed(8)
    t, pool = 21, 50
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(dtype)
    cos, sin = RotaryEmbedding(d, 10000.0, 4096).lookup(torch.arange(100, 100 + t), dtype)
    slots = torch.randperm(pool, generator=g)[:t]
    k = torch.randn(pool, hk, d, generator=g).to(dtype)
    v = torch.randn(pool, hk, d, generator=g).to(dtype)
    k0, v0 = k.clone(), v.clone()
    q = ck.rope_write(qkv, cos, sin, k, v, slots, hq)
    x = qkv.view(t, hq + 2 * hk, d)
    torch.testing.assert_close(q, apply_rotary(x[:, :hq], cos, sin), **tol)
    torch.testing.assert_close(k[slots], apply_rotary(x[:, hq:hq + hk], cos, sin), **tol)
    assert torch.equal(v[slots], x[:, hq + hk:])
    rest = torch.ones(pool, dtype=torch.bool)
    rest[slots] = False
    assert torch.equal(k[rest], k0[rest]) and torch.equal(v[rest], v0[rest])
    with pytest.raises(RuntimeError, match="outside the pool"):
        ck.rope_write(qkv, cos, sin, k, v, slots + pool, hq)


def test_rope_write_into_an_fp16_pool_rounds_the_fp32_write():
    """fp32 rows into an fp16 pool (kiln's CPU default with quantized weights): the same q, and
    the keys and values the fp32 pool gets, each rounded to nearest fp16 (as Tensor.half())."""
    from kiln.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(9)
    t, pool, hq, hk, d = 13, 40, 6, 2, 64
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g) * 3
    cos, sin = RotaryEmbedding(d, 10000.0, 4096).lookup(torch.arange(50, 50 + t), torch.float32)
    slots = torch.randperm(pool, generator=g)[:t]
    k32, v32 = torch.zeros(pool, hk, d), torch.zeros(pool, hk, d)
    k16, v16 = k32.half(), v32.half()
    q32 = ck.rope_write(qkv, cos, sin, k32, v32, slots, hq)
    q16 = ck.rope_write(qkv, cos, sin, k16, v16, slots, hq)
    assert torch.equal(q16, q32)
    assert torch.equal(k16, k32.half()) and torch.equal(v16, v32.half())


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("down_kind", ["Q8_0", "q4"])
@pytest.mark.parametrize("chunk", [False, True], ids=["decodes", "decode+chunk"])
def test_decode_layer_is_the_eager_kernels_chained_bit_for_bit(chunk, down_kind, pool_dtype):
    """ops.decode_layer (one call per layer for a whole step) against the same kernels called
    one by one as LlamaDecoderLayer's eager forward calls them: the output and the K/V written
    are the same bits (the batch-invariance argument for kernel steps vs eager steps). The down
    projection is GGUF Q8_0 tiles (gguf_blocks' kernel, called through the dispatcher) or, with
    every linear q4, the one-region layer (decode_layer_q4, residuals and biases folded into
    the tile stores); the o projection has a bias. `chunk`: rows 1 and 2 are two tokens of one
    prefill chunk (one table row, consecutive positions: row 2 attends to the key row 1 writes
    in this call). `pool_dtype`: the K/V pool's (fp16: written rounded, read converted)."""
    from kiln.layers import kernels
    from kiln.layers.quant import gguf_blocks

    if not kernels.available():
        pytest.skip("no GGUF-block kernels here")
    g = torch.Generator().manual_seed(1)
    b, h, hq, hk, d, inter, s, ctx = 3, 128, 4, 2, 32, 96, 64, 20
    qkv_n = (hq + 2 * hk) * d

    w_qkv, w_o, w_gu = (_packed_q4(qkv_n, h, 2), _packed_q4(h, hq * d, 3),
                        _packed_q4(2 * inter, h, 4))
    down = reference.random_blocks(h, inter, "Q8_0", g)
    if down_kind == "q4":
        w_down, down_id = _packed_q4(h, inter, 5), ck.Q4_KIND
    else:
        w_down = gguf_blocks.pack(down) if gguf_blocks.has_tiles("Q8_0") else down.raw
        down_id = down.type_id

    def down_linear(a: torch.Tensor) -> torch.Tensor:
        if down_kind == "q4":
            return ck.q4_linear(a, w_down, h)
        return gguf_blocks.kq_linear(a, [w_down], [down_id], [h])
    b_o = torch.randn(h, generator=g) * 0.1
    x = torch.randn(b, h, generator=g)
    ln1, ln2 = torch.rand(h, generator=g) + 0.5, torch.rand(h, generator=g) + 0.5
    cos, sin = torch.randn(b, 1, d, generator=g), torch.randn(b, 1, d, generator=g)
    k0 = torch.randn(s, hk, d, generator=g).to(pool_dtype)
    v0 = torch.randn(s, hk, d, generator=g).to(pool_dtype)
    gather = torch.stack([torch.randperm(s, generator=g)[:ctx] for _ in range(b)])
    row_of = torch.tensor([0, 1, 1]) if chunk else torch.arange(b)
    lens = torch.tensor([ctx, 7, 8] if chunk else [ctx, 7, 13])
    slots = gather[row_of, lens - 1]  # each row's new token is its last context slot
    scale, eps = d ** -0.5, 1e-5

    k, v = k0.clone(), v0.clone()
    hidden = ck.rms_norm(x, ln1, eps)
    q = ck.rope_write(ck.q4_linear(hidden, w_qkv, qkv_n), cos, sin, k, v, slots, hq)
    att = ck.attend_rows(q, k, v, gather, row_of, lens, scale)
    x1 = x + (ck.q4_linear(att.view(b, -1), w_o, h) + b_o)
    gu = ck.q4_linear(ck.rms_norm(x1, ln2, eps), w_gu, 2 * inter)
    want = x1 + down_linear(ck.silu_mul(gu))

    k2, v2 = k0.clone(), v0.clone()
    got = ck.decode_layer(
        x, cos, sin, ln1, ln2, eps, [w_qkv, w_o, w_gu, w_down],
        [ck.Q4_KIND, ck.Q4_KIND, ck.Q4_KIND, down_id], [qkv_n, h, 2 * inter, h],
        [1, 1, 1, 1], [None, b_o, None, None], k2, v2, slots, gather, row_of, lens, hq, scale)
    assert torch.equal(got, want)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    assert not torch.equal(k, k0)  # the step's keys were written


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_decode_layer_of_gguf_blocks_is_the_chained_kernels_bit_for_bit(rows, pool_dtype,
                                                                        kernel_level):
    """A layer whose linears are all GGUF blocks (Qwen2.5's Q4_K_M mix: Q5_0 q/k/v in two
    parts, Q8_0 o, Q5_0 gate_up, Q4_K and raw Q6_K rows in down; biases on qkv and o) runs in one
    parallel region (layers_kq.cpp): the output and the K/V written are the bits of the same
    kernels called one by one, at 1 row, a few and past a 16-row pass. Rows 1.. are one prefill
    chunk's consecutive tokens."""
    from kiln.layers.quant import gguf_blocks

    g = torch.Generator().manual_seed(2)
    h, hq, hk, d, inter, s = 256, 4, 2, 32, 256, 64
    qkv_n, ctx = (hq + 2 * hk) * d, 24

    def blocks(n: int, k: int, t: str, tiled: bool = True) -> tuple[torch.Tensor, int]:
        b = reference.random_blocks(n, k, t, g)
        return (gguf_blocks.pack(b) if tiled else b.raw), b.type_id

    parts = [blocks(hq * d, h, "Q5_0"), blocks(2 * hk * d, h, "Q5_0"), blocks(h, hq * d, "Q8_0"),
             blocks(2 * inter, h, "Q5_0"), blocks(h - 16, inter, "Q4_K"),
             blocks(16, inter, "Q6_K", tiled=False)]
    weights, kinds = [p[0] for p in parts], [p[1] for p in parts]
    n_rows = [hq * d, 2 * hk * d, h, 2 * inter, h - 16, 16]
    counts = [2, 1, 1, 2]
    b_qkv, b_o = torch.randn(qkv_n, generator=g) * 0.1, torch.randn(h, generator=g) * 0.1

    def lin(i: int, a: torch.Tensor) -> torch.Tensor:
        lo = sum(counts[:i])
        return gguf_blocks.kq_linear(a, weights[lo:lo + counts[i]], kinds[lo:lo + counts[i]],
                                     n_rows[lo:lo + counts[i]])

    x = torch.randn(rows, h, generator=g)
    ln1, ln2 = torch.rand(h, generator=g) + 0.5, torch.rand(h, generator=g) + 0.5
    cos, sin = torch.randn(rows, 1, d, generator=g), torch.randn(rows, 1, d, generator=g)
    k0 = torch.randn(s, hk, d, generator=g).to(pool_dtype)
    v0 = torch.randn(s, hk, d, generator=g).to(pool_dtype)
    gather = torch.randperm(s, generator=g)[:ctx + rows].view(1, -1)
    row_of = torch.zeros(rows, dtype=torch.long)
    lens = torch.arange(ctx + 1, ctx + rows + 1)
    slots = gather[0, lens - 1]
    scale, eps = d ** -0.5, 1e-5

    k, v = k0.clone(), v0.clone()
    q = ck.rope_write(lin(0, ck.rms_norm(x, ln1, eps)) + b_qkv, cos, sin, k, v, slots, hq)
    att = ck.attend_rows(q, k, v, gather, row_of, lens, scale)
    x1 = x + (lin(1, att.view(rows, -1)) + b_o)
    want = x1 + lin(3, ck.silu_mul(lin(2, ck.rms_norm(x1, ln2, eps))))

    k2, v2 = k0.clone(), v0.clone()
    got = ck.decode_layer(x, cos, sin, ln1, ln2, eps, weights, kinds, n_rows, counts,
                          [b_qkv, b_o, None, None], k2, v2, slots, gather, row_of, lens, hq,
                          scale)
    assert torch.equal(got, want)
    assert torch.equal(k2, k) and torch.equal(v2, v)


def test_decode_stack_is_decode_layer_layer_after_layer():
    """decode_stack (a whole step's layers in one call, LlamaModel's kernel steps) against
    decode_layer called once per layer: the same output and pools, bit for bit. Layer 0 is all
    q4 with a qkv bias (the one-region path), layer 1 has a GGUF Q8_0 down projection (the
    general path); each layer writes its own pools."""
    from kiln.layers import kernels
    from kiln.layers.quant import gguf_blocks

    if not kernels.available():
        pytest.skip("no GGUF-block kernels here")
    g = torch.Generator().manual_seed(3)
    b, h, hq, hk, d, inter, s, ctx = 2, 128, 4, 2, 32, 96, 48, 11
    qkv_n = (hq + 2 * hk) * d

    down = reference.random_blocks(h, inter, "Q8_0", g)
    w_down = gguf_blocks.pack(down) if gguf_blocks.has_tiles("Q8_0") else down.raw
    layers = []
    for i, (kind, wd) in enumerate([(ck.Q4_KIND, _packed_q4(h, inter, 9)),
                                    (down.type_id, w_down)]):
        layers.append({
            "ln1": torch.rand(h, generator=g) + 0.5, "ln2": torch.rand(h, generator=g) + 0.5,
            "weights": [_packed_q4(qkv_n, h, 10 + i), _packed_q4(h, hq * d, 20 + i),
                        _packed_q4(2 * inter, h, 30 + i), wd],
            "kinds": [ck.Q4_KIND] * 3 + [kind],
            "biases": [torch.randn(qkv_n, generator=g), None, None, None],
            "k": torch.randn(s, hk, d, generator=g), "v": torch.randn(s, hk, d, generator=g)})
    x = torch.randn(b, h, generator=g)
    cos, sin = torch.randn(b, 1, d, generator=g), torch.randn(b, 1, d, generator=g)
    table = torch.stack([torch.randperm(s, generator=g)[:ctx] for _ in range(b)])
    row_of, lens = torch.arange(b), torch.tensor([ctx, 5])
    slots = table[row_of, lens - 1]
    rows, scale, eps = [qkv_n, h, 2 * inter, h], d ** -0.5, 1e-5

    want, pools = x, []
    for ly in layers:
        k, v = ly["k"].clone(), ly["v"].clone()
        want = ck.decode_layer(want, cos, sin, ly["ln1"], ly["ln2"], eps, ly["weights"],
                               ly["kinds"], rows, [1, 1, 1, 1], ly["biases"], k, v, slots,
                               table, row_of, lens, hq, scale)
        pools.append((k, v))
    stack = ck.layer_stack()
    for ly in layers:
        stack.add(ly["ln1"], ly["ln2"], eps, ly["weights"], ly["kinds"], rows, [1, 1, 1, 1],
                  [bb if bb is not None else torch.empty(0) for bb in ly["biases"]], ly["k"],
                  ly["v"], hq, scale, torch.empty(0), torch.empty(0), 0.0)
    assert stack.size() == 2
    got = ck.decode_stack(x, cos, sin, stack, slots, table, row_of, lens)
    assert torch.equal(got, want)
    for ly, (k, v) in zip(layers, pools):
        assert torch.equal(ly["k"], k) and torch.equal(ly["v"], v)
