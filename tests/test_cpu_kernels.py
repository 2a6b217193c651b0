"""kiln's C++ CPU kernels (kiln/layers/cpu_kernels.cpp). Decode attention: its numbers against
PyTorch, its bounds check, the cascade merge, and compiled decode steps that call it. The int4
and int8 weight-only linears: their numbers against the dequantized weight for every row-tile
and block tail, their packed layouts, their shape checks, and a compiled quantized engine that
calls them. Skipped where the kernels cannot run (no AVX512-BF16, no compiler)."""

from __future__ import annotations

import pytest
import torch

from kiln.layers import cpu_kernels
from kiln.layers.attention import Attention, AttentionMetadata, KVStore

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
    assert att.kv is not None and att.kv.decode_kernel
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
    """With a shared prefix the kernel attends to the rows' own parts, GEMMs to the shared
    part, and the two softmaxes merge through their log-sum-exps: equal to attending to the
    whole context at once."""
    att, q, meta, want = _attention_over_pool(shared)
    assert att.kv is not None
    got = att._decode_kernel(q, att.kv, meta)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # shared GEMMs: bf16 probs


def test_a_quantized_or_fp32_pool_keeps_the_pytorch_paths():
    att = Attention(9, 3, 64)
    att.attach(KVStore(torch.zeros(16, 3, 64), torch.zeros(16, 3, 64)))
    assert att.kv is not None and not att.kv.decode_kernel
    att.attach(KVStore(torch.zeros(16, 3, 64, dtype=torch.int8),
                       torch.zeros(16, 3, 64, dtype=torch.int8),
                       torch.ones(16, 3, dtype=torch.float16),
                       torch.ones(16, 3, dtype=torch.float16), compute_dtype=torch.bfloat16))
    assert not att.kv.decode_kernel


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
    assert all(layer.kv.decode_kernel for layer in runner.model.attention_layers())
    compiled_steps = []
    run_compiled = runner._run_compiled

    def spy(ids, positions, meta):
        compiled_steps.append(meta.decode_shared is not None)
        return run_compiled(ids, positions, meta)

    monkeypatch.setattr(runner, "_run_compiled", spy)
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 256, (5 * 16,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 20, 4)]
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10)
    graphs, outs = runner._compiled, {}
    for compiled in (True, False):
        runner._compiled = graphs if compiled else None
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


def test_compiled_int4_engine_calls_the_linear_kernels(tmp_path, monkeypatch):
    """An int4 engine with --compile: its quantized layers hold kiln's layouts, and compiled and
    eager decode steps call kiln_cpu::w4_linear / w8_linear, with the same greedy tokens."""
    from conftest import make_tiny_model, run_to_completion

    from kiln.config import EngineConfig
    from kiln.engine.engine import Engine
    from kiln.layers.quant import Int4Linear, Int8Linear
    from kiln.sampling_params import SamplingParams

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    folder = make_tiny_model("llama", tmp_path / "tiny", hidden_size=256)
    cfg = EngineConfig(model=str(folder), dtype="bfloat16", quantization="int4",
                       dense_weights=False, kv_cache_memory=8 << 20, max_num_seqs=4,
                       max_num_batched_tokens=64, compile=True)
    eng = Engine(cfg)
    runner = eng.runner
    layers = [m for m in runner.model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    assert layers and all(m.kiln for m in layers)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10)
    graphs, outs = runner._compiled, {}
    for compiled in (True, False):
        runner._compiled = graphs if compiled else None
        e = Engine(cfg, runner=runner)
        for i, p in enumerate(prompts):
            e.add_request(str(i), p, params)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            outs[compiled] = run_to_completion(e)
        calls = {ev.key: ev.count for ev in prof.key_averages()}
        assert calls.get("kiln_cpu::w4_linear", 0) >= 10 * runner.model_config.num_hidden_layers
        assert calls.get("kiln_cpu::w8_linear", 0) >= 10  # the head, once a step
    same = sum(a == b for rid in outs[False] for a, b in zip(outs[True][rid], outs[False][rid]))
    total = sum(len(t) for t in outs[False].values())
    assert total == 30 and same / total >= 0.9, f"{same}/{total}"
