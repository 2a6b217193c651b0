"""kiln's C++ CPU kernels (kiln/layers/cpu_kernels.cpp). Decode attention: its numbers against
PyTorch, its bounds check, the cascade merge, and compiled decode steps that call it. The flash
kernels (prefill chunks, a cascade's shared prefix): their numbers against PyTorch for causal
chunks at any start, tails of the query and key blocks, GQA and MHA, their checks, and a layer's
mixed step with and without them. The decode-layer kernel against the layer's modules. The int4
and int8 weight-only linears: their numbers against the dequantized weight for every row-tile
and block tail, their packed layouts, their shape checks, and a compiled quantized engine that
calls them. Skipped where the kernels cannot run (no AVX512-BF16, no compiler)."""

from __future__ import annotations

import pytest
import torch

from kiln.layers import cpu_kernels
from kiln.layers.attention import (
    Attention,
    AttentionMetadata,
    KVStore,
    PrefillChunk,
    set_context,
)

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason="kiln's CPU kernels do not run here")


def _case(b, hq, hk, d, length, seed=0, pool=97):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(pool, hk, d, generator=g).bfloat16()
    v = torch.randn(pool, hk, d, generator=g).bfloat16()
    q = torch.randn(b, hq, d, generator=g).bfloat16()
    slots = torch.randint(0, pool, (b, length), generator=g)
    lens = torch.randint(1, length + 1, (b,), generator=g)
    lens[0] = length  # one full row, and (where there are two) one of a single position
    if b > 1:
        lens[1] = 1
    mask = torch.arange(length)[None, :] < lens[:, None]
    return q, k, v, slots, mask


@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (16, 2)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("b,length", [(1, 5), (5, 37), (3, 64)])
def test_decode_attention_matches_pytorch(heads, d, b, length):
    """Outputs and log-sum-exps equal fp32 PyTorch over the gathered context, for GQA and MHA,
    head dims 64/128, ragged lengths and lengths that are not a multiple of 16."""
    hq, hk = heads
    q, k, v, slots, mask = _case(b, hq, hk, d, length)
    out, lse = cpu_kernels.decode_attention(q, k, v, slots, mask, d ** -0.5)
    want_out, want_lse = cpu_kernels.reference(q, k, v, slots, mask, d ** -0.5)
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == (b, hq, d) and lse.shape == (b, hq)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=1e-4)


def test_masked_positions_are_never_read_and_an_empty_row_gives_zeros():
    q, k, v, slots, mask = _case(3, 9, 3, 64, 20)
    slots[:, 10:] = 10**9  # far outside the pool, but masked
    mask[:, 10:] = False
    mask[2] = False  # a row with no context at all
    out, lse = cpu_kernels.decode_attention(q, k, v, slots, mask, 0.125)
    want_out, _ = cpu_kernels.reference(q, k, v, slots.clamp(max=k.shape[0] - 1), mask, 0.125)
    torch.testing.assert_close(out[:2], want_out[:2], rtol=1e-4, atol=1e-4)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert torch.isneginf(lse[2]).all()


def test_a_slot_outside_the_pool_is_an_error_not_a_read():
    q, k, v, slots, mask = _case(2, 9, 3, 64, 8)
    slots[0, 3] = k.shape[0]  # row 0 spans its whole length
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_kernels.decode_attention(q, k, v, slots, mask, 0.125)
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_kernels.decode_attention(q.float(), k.float(), v.float(), slots, mask, 0.125)


def _attention_over_pool(shared: int):
    """A layer with a bf16 pool attached the way the model runner does it, and a decode step
    of 5 rows whose contexts start with `shared` common slots."""
    att = Attention(9, 3, 64)
    q, k, v, own, mask = _case(5, 9, 3, 64, 23, seed=1, pool=160)
    att.attach(KVStore(k, v, compute_dtype=torch.bfloat16))
    assert att.kv is not None and att.kv.kernel
    shared_slots = torch.arange(100, 100 + shared)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), num_decodes=5,
                             decode_gather=own, decode_mask=mask.view(5, 1, 1, -1),
                             decode_shared=shared_slots if shared else None)
    whole = torch.cat([shared_slots.expand(5, shared), own], dim=1)
    whole_mask = torch.cat([torch.ones(5, shared, dtype=torch.bool), mask], dim=1)
    want, _ = cpu_kernels.reference(q, k, v, whole, whole_mask, att.scale)
    return att, q, meta, want


@pytest.mark.parametrize("shared", [0, 48])
def test_kernel_decode_and_its_cascade_merge_equal_whole_context_attention(shared):
    """With a shared prefix the decode kernel attends to the rows' own parts, the flash kernel
    to the shared part, and the two softmaxes merge through their log-sum-exps: equal to attending to the
    whole context at once."""
    att, q, meta, want = _attention_over_pool(shared)
    assert att.kv is not None
    got = att._decode_kernel(q, att.kv, meta)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # shared GEMMs: bf16 probs


def _flash_case(t, start, hq, hk, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    pool = start + t + 40
    k = torch.randn(pool, hk, d, generator=g).bfloat16()
    v = torch.randn(pool, hk, d, generator=g).bfloat16()
    q = torch.randn(t, hq, d, generator=g).bfloat16()
    slots = torch.randperm(pool, generator=g)[:start + t]  # scattered over the pool
    return q, k, v, slots


@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (16, 2)])
@pytest.mark.parametrize("d", [64, 128, 96])
@pytest.mark.parametrize("t,start", [(1, 0), (7, 0), (50, 0), (33, 31), (16, 100), (1, 63)])
def test_prefill_attention_matches_pytorch(heads, d, t, start):
    """A chunk of t queries starting at position `start` attends causally to the slots of its
    whole context: equal to fp32 PyTorch over the gathered context (bf16 probabilities and
    output: ~1e-2), for query and key blocks cut anywhere."""
    hq, hk = heads
    q, k, v, slots = _flash_case(t, start, hq, hk, d)
    got = cpu_kernels.prefill_attention(q, k, v, slots, start, d ** -0.5)
    assert got.dtype == torch.bfloat16 and got.shape == (t, hq, d)
    want = cpu_kernels.prefill_reference(q, k, v, slots, start, d ** -0.5)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    if start == 0:  # and equal to PyTorch's own causal SDPA
        def ctx(x: torch.Tensor) -> torch.Tensor:
            return x.index_select(0, slots).float().transpose(0, 1).unsqueeze(0)

        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q.float().transpose(0, 1).unsqueeze(0), ctx(k), ctx(v), is_causal=True,
            scale=d ** -0.5, enable_gqa=True)
        torch.testing.assert_close(got.float(), sdpa.squeeze(0).transpose(0, 1), rtol=2e-2,
                                   atol=2e-2)


@pytest.mark.parametrize("b,p", [(1, 5), (16, 100), (5, 64)])
def test_shared_attention_matches_pytorch(b, p):
    """Every row's queries against all P shared keys: outputs and log-sum-exps equal fp32
    PyTorch (what the cascade merge needs)."""
    q, k, v, slots = _flash_case(b, p - b, 9, 3, 64, seed=2)
    slots = slots[:p]
    out, lse = cpu_kernels.shared_attention(q, k, v, slots, 0.125)
    assert out.dtype == lse.dtype == torch.float32
    want_out, want_lse = cpu_kernels.reference(q, k, v, slots.expand(b, p),
                                               torch.ones(b, p, dtype=torch.bool), 0.125)
    torch.testing.assert_close(out, want_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=1e-4)


def test_flash_kernels_check_their_inputs():
    q, k, v, slots = _flash_case(4, 3, 9, 3, 64)
    bad = slots.clone()
    bad[2] = k.shape[0]
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_kernels.prefill_attention(q, k, v, bad, 3, 0.125)
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_kernels.shared_attention(q, k, v, bad, 0.125)
    with pytest.raises(RuntimeError, match="start"):
        cpu_kernels.prefill_attention(q, k, v, slots, 2, 0.125)  # slots are not start + T
    with pytest.raises(RuntimeError, match="no shared keys"):
        cpu_kernels.shared_attention(q, k, v, slots[:0], 0.125)
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_kernels.prefill_attention(q.float(), k, v, slots, 3, 0.125)


def test_a_mixed_step_with_the_kernels_equals_pytorchs_paths():
    """One layer's step of 2 decode rows, a chunk from position 0 and a chunk continuing a
    sequence (its context gathered from the pool, as after a prefix-cache hit): the kernels
    (prefill chunks by the flash kernel) and PyTorch's SDPA paths give the same output."""
    g = torch.Generator().manual_seed(4)
    pool = 200
    k0 = torch.randn(pool, 3, 64, generator=g).bfloat16()
    v0 = torch.randn(pool, 3, 64, generator=g).bfloat16()
    n_a, start_b, n_b = 21, 40, 13  # chunk A: 21 fresh tokens; chunk B: 13 after 40 cached
    t = 2 + n_a + n_b
    q = torch.randn(t, 9, 64, generator=g).bfloat16()
    k = torch.randn(t, 3, 64, generator=g).bfloat16()
    v = torch.randn(t, 3, 64, generator=g).bfloat16()
    ctx_b = torch.arange(100, 100 + start_b + n_b)  # B's context slots, its own tokens last
    slot_mapping = torch.cat([torch.tensor([195, 196]), torch.arange(0, n_a),
                              ctx_b[start_b:]])
    gather_b = ctx_b
    mask_b = (torch.arange(start_b + n_b)[None, :]
              <= start_b + torch.arange(n_b)[:, None])[None, None]
    decode_gather = torch.stack([torch.arange(50, 80), torch.arange(160, 190)])
    decode_gather[:, -1] = torch.tensor([195, 196])  # each row ends at its own new token
    outs = []
    for kernel in (True, False):
        att = Attention(9, 3, 64)
        att.attach(KVStore(k0.clone(), v0.clone(), compute_dtype=torch.bfloat16))
        assert att.kv is not None and att.kv.kernel
        att.kv.kernel = kernel
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, num_decodes=2, decode_gather=decode_gather,
            decode_mask=torch.ones(2, 1, 1, 30, dtype=torch.bool),
            prefills=[PrefillChunk(2, 2 + n_a, 0),
                      PrefillChunk(2 + n_a, t, start_b, gather=gather_b, mask=mask_b)])
        set_context(meta)
        try:
            outs.append(att(q, k, v).float())
        finally:
            set_context(None)
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)


def test_a_quantized_or_fp32_pool_keeps_the_pytorch_paths():
    att = Attention(9, 3, 64)
    att.attach(KVStore(torch.zeros(16, 3, 64), torch.zeros(16, 3, 64)))
    assert att.kv is not None and not att.kv.kernel
    att.attach(KVStore(torch.zeros(16, 3, 64, dtype=torch.int8),
                       torch.zeros(16, 3, 64, dtype=torch.int8),
                       torch.ones(16, 3, dtype=torch.float16),
                       torch.ones(16, 3, dtype=torch.float16), compute_dtype=torch.bfloat16))
    assert not att.kv.kernel


def test_compiled_bf16_decode_calls_the_kernel_and_keeps_the_eager_tokens(tmp_path, monkeypatch):
    """A bf16 engine with --compile: decode steps (plain and over a shared prefix) run compiled
    graphs that call the kernel; their greedy tokens agree with eager steps, which call it too."""
    from conftest import make_tiny_model, run_to_completion

    from kiln.config import EngineConfig
    from kiln.engine.engine import Engine
    from kiln.sampling_params import SamplingParams

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    folder = make_tiny_model("llama", tmp_path / "tiny", hidden_size=256)  # head_dim 64
    cfg = EngineConfig(model=str(folder), dtype="bfloat16", kv_cache_memory=8 << 20,
                       max_num_seqs=4, max_num_batched_tokens=64, compile=True)
    eng = Engine(cfg)
    runner = eng.runner
    assert all(layer.kv.kernel for layer in runner.model.attention_layers())
    compiled_steps = []
    run_compiled = runner.graphs.run

    def spy(model, ids, positions, meta):
        compiled_steps.append(meta.decode_shared is not None)
        return run_compiled(model, ids, positions, meta)

    monkeypatch.setattr(runner.graphs, "run", spy)
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 256, (5 * 16,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 20, 4)]
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10)
    graphs, outs = runner.graphs, {}
    for compiled in (True, False):
        runner.graphs = graphs if compiled else None
        e = Engine(cfg, runner=runner)
        e.add_request("first", prompts[0], params)  # publishes the prefix
        e.step()
        for i, p in enumerate(prompts[1:]):
            e.add_request(str(i), p, params)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            outs[compiled] = run_to_completion(e)
        kernel_calls = sum(ev.count for ev in prof.key_averages()
                           if ev.key == "kiln_cpu::decode_attention")
        assert kernel_calls >= 10 * runner.model_config.num_hidden_layers
    assert set(compiled_steps) == {True, False}  # the cascade and the plain graphs ran
    same = sum(a == b for rid in outs[False] for a, b in zip(outs[True][rid], outs[False][rid]))
    total = sum(len(t) for t in outs[False].values())
    assert total == 40 and same / total >= 0.9, f"{same}/{total}"


# --------------------------------------------------------------------------- int4 / int8 linears


def _w4(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    mn = (-scale * torch.randint(4, 12, (n, k // 32), generator=g)).half().float()
    return q, scale, mn


def _dequant4(q, scale, mn):
    n, k = q.shape
    return (q.float().view(n, -1, 32) * scale[..., None] + mn[..., None]).view(n, k)


# N: one block, three (an odd tail task), six, many; M: every row-tile size and tails of it.
@pytest.mark.parametrize("n,k", [(16, 32), (48, 64), (96, 576), (1536, 576), (64, 1536)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16, 33])
def test_w4_linear_matches_the_dequantized_weight(n, k, m):
    q, scale, mn = _w4(n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    got = cpu_kernels.w4_linear(x, cpu_kernels.pack_w4(q, scale, mn), n)
    want = x.float() @ _dequant4(q, scale, mn).t()
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # fp32 accumulation, one bf16 rounding of the output
    assert (got.float() - want).abs().max() <= 8e-3 * want.abs().max()


def _q8_rows(x):
    """x [M, K] quantized as w4a8_linear does: per row D = max|x| / 127, per group of 32 a power
    of two on top, 2^-t with t = floor(log2(max_row / max_group)) <= 15, q = round-half-even(x
    127 2^t / max_row). Returns q [M, G, 32], the groups' scales [M, G, 1], their sums [M, G]."""
    m, k = x.shape
    xg = x.float().view(m, k // 32, 32)
    gmax = xg.abs().amax(-1, keepdim=True)
    rmax = gmax.amax(1, keepdim=True)
    t = torch.floor(torch.log2(rmax / gmax)).clamp(max=15).nan_to_num(15)  # 0/0, x/0: 15
    inv = torch.where(rmax > 0, 127.0 / rmax, torch.zeros_like(rmax))
    return torch.round(xg * (inv * 2.0 ** t)), rmax / 127.0 * 2.0 ** -t, xg.sum(-1)


# N: tasks of 3 blocks and a tail of 1 or 2; M: row tiles of 4 and single-row tails.
@pytest.mark.parametrize("n,k", [(16, 32), (80, 64), (96, 576), (960, 576), (64, 1536)])
@pytest.mark.parametrize("m", [1, 3, 4, 7, 32, 129])
def test_w4a8_linear_matches_q8_activations_times_the_weight(n, k, m):
    """Exact integer dot products of the int8 activations and the 4-bit codes, scaled per group:
    the reference computes the same sums in fp32 (the min term from x's exact group sums)."""
    q, scale, mn = _w4(n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4)).bfloat16()
    x[0, :32] = 0  # an all-zero group (and below, an all-zero row): no NaN
    x[-1, 32:] *= 1e-3  # groups far below their row's max: shifted scales
    if m > 3:
        x[1] = 0
    got = cpu_kernels.w4a8_linear(x, cpu_kernels.pack_w4(q, scale, mn), n)
    qx, dx, sx = _q8_rows(x)  # [M, G, 32], [M, G, 1], [M, G]
    qw = q.float().view(n, k // 32, 32)
    dots = torch.einsum("mgk,ngk->mng", qx, qw)  # integers, exact in fp32 (< 2^24)
    want = (dots * dx.squeeze(-1)[:, None, :] * scale[None]).sum(-1) + sx @ mn.t()
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert not got.isnan().any()
    assert (got.float() - want).abs().max() <= 8e-3 * want.abs().max()
    # and it approximates the bf16 product to the activations' 8 bits
    exact = x.float() @ _dequant4(q, scale, mn).t()
    assert (got.float() - exact).norm() <= 0.03 * exact.norm()


@pytest.mark.parametrize("n,k", [(16, 32), (48, 64), (80, 576), (4096, 576)])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 16, 33])
def test_w8_linear_matches_the_dequantized_weight(n, k, m):
    """Up to 4 rows convert int8 in the loop, more rows through a bf16 scratch: both exact."""
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, generator=g) * 0.01
    x = torch.randn(m, k, generator=g).bfloat16()
    got = cpu_kernels.w8_linear(x, cpu_kernels.pack_w8(q), scale)
    want = (x.float() @ q.float().t()) * scale
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert (got.float() - want).abs().max() <= 8e-3 * want.abs().max()


def test_packed_layouts_round_trip():
    q, scale, mn = _w4(48, 96)
    q2, s2, m2 = cpu_kernels.unpack_w4(cpu_kernels.pack_w4(q, scale, mn))
    assert torch.equal(q2, q) and torch.equal(s2, scale) and torch.equal(m2, mn)
    q8 = torch.randint(-128, 128, (48, 96), dtype=torch.int8)
    packed = cpu_kernels.pack_w8(q8)
    assert torch.equal(cpu_kernels.unpack_w8(packed), q8)
    rows = torch.tensor([[0, 17], [47, 16]])  # an embedding lookup of a [2, 2] batch
    assert torch.equal(cpu_kernels.unpack_w8_rows(packed, rows), q8[rows])


def test_linear_kernels_reject_mismatched_inputs():
    q, scale, mn = _w4(32, 64)
    packed = cpu_kernels.pack_w4(q, scale, mn)
    with pytest.raises(RuntimeError, match="K = 32"):
        cpu_kernels.w4_linear(torch.zeros(2, 32).bfloat16(), packed, 32)
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_kernels.w4_linear(torch.zeros(2, 64), packed, 32)
    p8 = cpu_kernels.pack_w8(torch.zeros(32, 64, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="scale fp32"):
        cpu_kernels.w8_linear(torch.zeros(1, 64).bfloat16(), p8, torch.ones(16))
    assert cpu_kernels.w4_linear(torch.zeros(0, 64).bfloat16(), packed, 32).shape == (0, 32)
    with pytest.raises(RuntimeError, match="K = 32"):
        cpu_kernels.w4a8_linear(torch.zeros(2, 32).bfloat16(), packed, 32)
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_kernels.w4a8_linear(torch.zeros(2, 64), packed, 32)
    assert cpu_kernels.w4a8_linear(torch.zeros(0, 64).bfloat16(), packed, 32).shape == (0, 32)


def test_int4_engine_decodes_with_the_layer_kernel_graphs_or_eager_alike(tmp_path, monkeypatch):
    """An int4 engine with --compile: its quantized layers hold kiln's layouts. Decode steps run
    each layer as one decode_layer call; with that kernel off they run compiled graphs (or
    eager modules) that call kiln_cpu::w4_linear / w8_linear. All three give the same greedy
    tokens (up to bf16 rounding, see below), and the kernel's steps need no compiled graph."""
    from conftest import make_tiny_model, run_to_completion

    from kiln.config import EngineConfig
    from kiln.engine.engine import Engine
    from kiln.layers.quant import Int4Linear, Int8Linear
    from kiln.models import llama
    from kiln.sampling_params import SamplingParams

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    folder = make_tiny_model("llama", tmp_path / "tiny", hidden_size=256)
    cfg = EngineConfig(model=str(folder), dtype="bfloat16", quantization="int4",
                       dense_weights=False, kv_cache_memory=8 << 20, max_num_seqs=4,
                       max_num_batched_tokens=64, compile=True)
    kernel_engine = Engine(cfg)
    assert kernel_engine.runner.decode_kernel_rows == llama.DECODE_KERNEL_MAX_ROWS
    assert kernel_engine.runner.graphs is None  # every decode batch runs the kernel
    monkeypatch.setattr(llama, "DECODE_KERNEL_MAX_ROWS", 0)
    eng = Engine(cfg)  # the layer kernel off: graphs for every bucket
    runner = eng.runner
    assert runner.decode_kernel_rows == 0 and runner.graphs is not None
    layers = [m for m in runner.model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    assert layers and all(m.kiln for m in layers)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10)
    graphs, outs = runner.graphs, {}
    n_layers = runner.model_config.num_hidden_layers
    for mode in ("kernel", "compiled", "eager"):
        if mode == "kernel":
            e = Engine(cfg, runner=kernel_engine.runner)
        else:
            runner.graphs = graphs if mode == "compiled" else None
            e = Engine(cfg, runner=runner)
        for i, p in enumerate(prompts):
            e.add_request(str(i), p, params)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            outs[mode] = run_to_completion(e)
        calls = {ev.key: ev.count for ev in prof.key_averages()}
        if mode == "kernel":
            assert calls.get("kiln_cpu::decode_layer", 0) >= 9 * n_layers
        else:
            assert calls.get("kiln_cpu::decode_layer", 0) == 0
            assert calls.get("kiln_cpu::w4_linear", 0) >= 10 * n_layers
        assert calls.get("kiln_cpu::w8_linear", 0) >= 10  # the head, once a step
    total = sum(len(t) for t in outs["eager"].values())
    assert total == 30
    # A random tiny model's logits are near ties, so one bf16 rounding can swap two tokens (and
    # shift the rest): >= 80% must agree, and every sequence's first tokens. Eager steps and the
    # layer kernel run the same RoPE (rope_write, rounded once): their first 5; the compiled
    # graphs round in their own places (inductor's fused loops): their first 4.
    for mode, first in (("kernel", 5), ("compiled", 4)):
        same = sum(a == b for rid in outs["eager"]
                   for a, b in zip(outs[mode][rid], outs["eager"][rid]))
        assert all(outs[mode][rid][:first] == outs["eager"][rid][:first] for rid in outs["eager"])
        assert same / total >= 0.8, f"{mode}: {same}/{total}"


def test_runner_decisions_record_the_kernel_decode_path_and_nothing_compiled(tmp_path):
    """An int4 bf16 model with --compile on kiln's kernels: every decode batch runs the layer
    kernel, so torch.compile compiles nothing, and runner.decisions says so (with the KV dtype it
    used and the dense copies it kept), in the form the effective config records."""
    import json

    from conftest import make_tiny_model

    from kiln.config import EngineConfig
    from kiln.engine.model_runner import ModelRunner
    from kiln.models import llama
    from kiln.models.loader import open_checkpoint

    folder = make_tiny_model("llama", tmp_path / "tiny", hidden_size=256)
    cfg = EngineConfig(model=str(folder), dtype="bfloat16", quantization="int4",
                       dense_weights=True, kv_cache_memory=8 << 20, max_num_seqs=4,
                       max_num_batched_tokens=64, compile=True)
    runner = ModelRunner(cfg, open_checkpoint(folder))
    d = runner.decisions
    rows = llama.DECODE_KERNEL_MAX_ROWS
    assert d.decode_kernel_rows == runner.decode_kernel_rows == rows
    assert d.decode_path.value == "kernel"
    assert f"up to {rows} rows run kiln's one-call decode-layer kernel" in d.decode_path.reason
    assert d.compiled.value is False and d.compile_buckets == ()
    assert d.compiled.reason == (f"decode steps of up to {rows} rows run kiln's layer kernel: "
                                 "nothing to compile")
    assert runner.graphs is None and runner.compile_seconds == 0.0
    assert d.kv_cache_dtype.value == runner.kv_dtype_name == "bf16"
    assert "model dtype (bfloat16)" in d.kv_cache_dtype.reason
    assert "attention kernels read the pool" in d.kv_cache_dtype.reason
    # Only the int8 head keeps a dense copy: the int4 layers on kiln's kernels keep none.
    assert d.dense_weights.value is True
    assert "int4 layers on kiln's kernels keep none" in d.dense_weights.reason
    out = json.loads(json.dumps(d.to_dict()))
    assert set(out) == {"kv_cache_dtype", "decode_path", "compiled", "dense_weights",
                        "batch_invariant", "cascade"}
    assert out["compiled"] == {"value": False, "reason": d.compiled.reason}


@pytest.mark.parametrize("shared", [0, 32])
def test_decode_layer_equals_the_layer_modules(tmp_path, shared):
    """One int4 decoder layer's decode step as one decode_layer call equals the layer's modules
    with PyTorch's attention (norms, RoPE, K/V written to the pool, attention over ragged
    contexts, optionally a shared prefix, the MLP, the residuals), to bf16 rounding."""
    from conftest import make_tiny_model

    from kiln.config import EngineConfig
    from kiln.engine.engine import Engine

    folder = make_tiny_model("llama", tmp_path / "tiny", hidden_size=256)
    cfg = EngineConfig(model=str(folder), dtype="bfloat16", quantization="int4",
                       dense_weights=False, kv_cache_memory=8 << 20, max_num_seqs=4,
                       max_num_batched_tokens=64, compile=False)
    model = Engine(cfg).runner.model
    layer = model.model.layers[1]
    kv = layer.self_attn.attn.kv
    assert layer.decode_kernel_rows() > 0
    # A bf16 CPU model built with the kernels runs the one-pass RMSNorm and SiLU-and-mul too.
    assert layer.input_layernorm.elementwise_kernel and layer.mlp.elementwise_kernel
    g = torch.Generator().manual_seed(5)
    b, length = 3, 40
    x = torch.randn(b, 256, generator=g).bfloat16()
    own = torch.tensor([39, 20, 5])  # each row's last position in its own part
    pos = own + shared
    cos, sin = model.model._rotary[0].lookup(pos, torch.bfloat16)
    gather = torch.arange(b * length).view(b, length) + 64
    mask = torch.arange(length)[None, :] <= own[:, None]
    meta = AttentionMetadata(slot_mapping=gather[torch.arange(b), own], num_decodes=b,
                             decode_gather=gather, decode_mask=mask[:, None, None, :],
                             decode_shared=torch.arange(shared) + 8 if shared else None)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    pool = kv.k.clone(), kv.v.clone()
    set_context(meta)
    try:
        with torch.inference_mode():
            kv.kernel = False
            want = layer(cos, sin, x).float()
            want_pool = kv.k.clone(), kv.v.clone()
            kv.kernel = True
            kv.k.copy_(pool[0])
            kv.v.copy_(pool[1])
            got = layer.forward_decode_kernel(cos, sin, x).float()
    finally:
        set_context(None)
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * scale)
    torch.testing.assert_close(kv.k, want_pool[0], rtol=2e-2, atol=2e-2)
    assert torch.equal(kv.v, want_pool[1])
    meta.slot_mapping = torch.tensor([0, 1, kv.k.shape[0]])
    set_context(meta)
    try:
        with pytest.raises(RuntimeError, match="outside the pool"):
            layer.forward_decode_kernel(cos, sin, x)
    finally:
        set_context(None)


@pytest.mark.parametrize("rows", [1, 7, 40])
def test_rms_norm_and_silu_mul_equal_pytorchs_ops(rows):
    """The eager steps' one-pass RMSNorm and SiLU-and-mul equal the modules' PyTorch ops (to
    one bf16 rounding, SmolLM2's sizes)."""
    from kiln.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(6)
    x = (torch.randn(rows, 576, generator=g) * 3).bfloat16()
    norm = RMSNorm(576, 1e-5).to(torch.bfloat16)
    norm.weight.data = torch.randn(576, generator=g).bfloat16()
    want = norm(x)
    norm.elementwise_kernel = True
    torch.testing.assert_close(norm(x), want, rtol=1e-2, atol=1e-2)
    gu = (torch.randn(rows, 2 * 1536, generator=g) * 4).bfloat16()
    want = torch.nn.functional.silu(gu[:, :1536]) * gu[:, 1536:]
    torch.testing.assert_close(cpu_kernels.silu_mul(gu), want, rtol=1e-2, atol=1e-2)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu_kernels.silu_mul(gu[:, :40])
