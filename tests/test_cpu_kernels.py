"""kiln's C++ CPU decode-attention kernel (kiln/layers/cpu_kernels.cpp): its numbers against
PyTorch, its bounds check, the cascade merge, and compiled decode steps that call it. Skipped
where the kernel cannot run (no AVX512-BF16, no compiler)."""

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
