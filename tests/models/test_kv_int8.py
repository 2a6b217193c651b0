"""int8 KV cache (`--kv-cache-dtype int8`): per (token, head) scales, greedy agreement with
full-precision KV on SmolLM2, and the token capacity it buys."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model, run_to_completion

from kiln.sampling_params import SamplingParams

KV_MEMORY = 256 << 20  # the same as conftest's smollm2_runner
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,",
           "The three primary colors are", "Water boils at"]
NEW_TOKENS = 32


def runner_for(model: str, **kw):
    from kiln.engine.model_runner import ModelRunner
    from kiln.models.loader import open_checkpoint
    from kiln.settings.engine_config import EngineConfig

    kw.setdefault("max_num_batched_tokens", 64)
    return ModelRunner(EngineConfig.of(model=model, dtype="float32", **kw), open_checkpoint(model))


@pytest.fixture(scope="module")
def int8_runner(gguf_path):
    """The one extra SmolLM2 runner: fp32 compute, int8 KV, the fixture runner's KV budget."""
    return runner_for(str(gguf_path), kv_cache_dtype="int8", max_model_len=2048,
                      kv_cache_memory=KV_MEMORY, max_num_batched_tokens=512)


def test_quantize_round_trip_is_within_half_a_step():
    from kiln.layers.attention import INT8_SCALE_DTYPE, quantize_int8

    x = torch.randn(10, 3, 64, generator=torch.Generator().manual_seed(0)) * 5
    x[0, 0] = 0.0  # an all-zero row must not divide by zero
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.dtype == INT8_SCALE_DTYPE and scale.shape == (10, 3)
    back = q.float() * scale.float().unsqueeze(-1)
    assert torch.all((back - x).abs() <= scale.float().unsqueeze(-1) / 2 + 1e-6)
    assert torch.equal(back[0, 0], torch.zeros(64))


@pytest.mark.parametrize("dim", [64, 48])
def test_int8_store_keeps_keys_rotated_and_scores_unchanged(dim):
    from kiln.layers.attention import INT8_SCALE_DTYPE, KVStore, rotation_matrix

    r = rotation_matrix(dim, torch.device("cpu"))
    assert torch.allclose(r @ r.T, torch.eye(dim), atol=1e-5)  # orthonormal
    g = torch.Generator().manual_seed(1)
    k = torch.randn(10, 3, dim, generator=g)
    k[:, :, 5] *= 20  # an outlier channel, as real keys have
    v = torch.randn(10, 3, dim, generator=g)
    q = torch.randn(10, 3, dim, generator=g)

    def store(rotated: bool) -> KVStore:
        s = KVStore(torch.zeros(16, 3, dim, dtype=torch.int8),
                    torch.zeros(16, 3, dim, dtype=torch.int8),
                    torch.zeros(16, 3, dtype=INT8_SCALE_DTYPE),
                    torch.zeros(16, 3, dtype=INT8_SCALE_DTYPE))
        if not rotated:
            s.rotation = torch.eye(dim)
        return s

    slots = torch.tensor([3, 7, 0, 1, 2, 4, 5, 6, 8, 9])
    exact = (q * k).sum(-1)
    errors = {}
    for rotated in (True, False):
        s = store(rotated)
        s.write(slots, k, v)
        ck, cv = s.gather(slots)
        assert ck.dtype == torch.float32 and ck.shape == k.shape
        assert torch.allclose(cv, v, atol=0.05)  # values are stored as they are
        errors[rotated] = ((s.query(q) * ck).sum(-1) - exact).abs().max().item()
    assert errors[True] < 0.5 * errors[False], errors  # the rotation shrinks the key error


def test_int8_kv_holds_at_least_1_9x_the_tokens_of_16_bit_kv(tmp_path, smollm2_runner,
                                                             int8_runner):
    # A tiny model with SmolLM2's head_dim (64), planned twice over the same budget.
    folder = make_tiny_model("llama", tmp_path / "hd64", hidden_size=128, num_attention_heads=2,
                             num_key_value_heads=1)
    caps = {dt: runner_for(str(folder), kv_cache_dtype=dt, kv_cache_memory=8 << 20)
            .plan.token_capacity for dt in ("bf16", "int8")}
    assert caps["int8"] >= 1.9 * caps["bf16"], caps
    # SmolLM2: 16-bit KV is half the fp32 runner's bytes per token.
    assert int8_runner.kv_dtype_name == "int8"
    bytes16 = smollm2_runner.kv_bytes_per_token() // 2
    cap16 = KV_MEMORY // (bytes16 * 16) * 16
    assert int8_runner.plan.token_capacity >= 1.9 * cap16
    layer = next(iter(int8_runner.model.attention_layers()))
    assert layer.kv.k.dtype == torch.int8 and layer.kv.quantized


def test_int8_kv_greedy_tokens_agree_with_fp32_kv(make_engine, gguf_path, int8_runner,
                                                   smollm2_tokenizer):
    """Agreement = the fraction of (prompt, position) pairs where the two greedy outputs hold the
    same token, over 5 prompts x 32 tokens. After a divergence the texts usually differ at every
    later position, so this is close to "tokens before the first divergence" and strict."""
    from kiln.engine.engine import Engine
    from kiln.settings.engine_config import EngineConfig

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    engines = {
        "fp32": make_engine(),
        "int8": Engine(EngineConfig.of(model=str(gguf_path), dtype="float32",
                                    kv_cache_dtype="int8", max_num_batched_tokens=512),
                       runner=int8_runner),
    }
    outs = {}
    for name, eng in engines.items():
        for i, p in enumerate(PROMPTS):
            eng.add_request(str(i), smollm2_tokenizer.encode(p), params)
        outs[name] = run_to_completion(eng)
    same = total = 0
    for i in range(len(PROMPTS)):
        a, b = outs["fp32"][str(i)], outs["int8"][str(i)]
        assert len(a) == len(b) == NEW_TOKENS
        same += sum(x == y for x, y in zip(a, b))
        total += NEW_TOKENS
    assert same / total >= 0.95, f"int8 KV agrees on {same}/{total} tokens"
