"""Model registry (models.toml) and runtime presets."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kiln.errors import ConfigError
from kiln.resolve.hardware import GPUInfo, HardwareInfo
from kiln.resolve.presets import (
    PRESETS,
    estimate_active_params,
    estimate_params,
    get_preset,
    infer_preset,
    moe_hybrid_settings,
)
from kiln.resolve.registry import (
    gpu_experts_per_layer,
    infer_entry,
    load_registry,
    lookup,
    parse_param_count,
)
from kiln.settings.table import BY_NAME

GIB = 1024**3


def test_registry_loads_with_one_embedded_default() -> None:
    entries = load_registry()
    assert len(entries) >= 10
    embedded = [e for e in entries if e.embedded]
    assert [e.name for e in embedded] == ["smollm2"]
    assert embedded[0].hf_repo == "HuggingFaceTB/SmolLM2-135M-Instruct"
    for e in entries:
        assert e.kind in ("dense", "moe")
        assert (e.gpu_experts_rule is not None) == (e.kind == "moe"), e.name
        assert e.max_tensor_parallel in (1, 2, 4, 8), e.name
        assert "/" in e.hf_repo and e.description
        assert set(e.recommended) <= set(BY_NAME), e.name
    assert {"llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe", "deepseek_v3"} <= {
        e.family for e in entries
    }


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("smollm2", "smollm2"),
        ("SmolLM2:135M", "smollm2"),
        ("smollm2-135m", "smollm2"),
        ("Mixtral", "mixtral-8x7b"),
        ("qwen3-moe", "qwen3-30b-a3b"),
        ("nope", None),
    ],
)
def test_lookup_is_case_insensitive_and_knows_aliases(name: str, expected: str | None) -> None:
    entry = lookup(name)
    assert (entry.name if entry else None) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/data/models/SmolLM2-135M-Instruct", "smollm2"),
        ("HuggingFaceTB/SmolLM2-360M-Instruct", "smollm2-360m"),
        ("/c/hub/models--Qwen--Qwen3-8B/snapshots/0123abcd", "qwen3-8b"),
        ("/x/qwen2.5-7b-instruct-q4_k_m-00001-of-00002.gguf", "qwen2.5-7b"),
        ("/x/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf", "llama3.1-8b"),
        ("/m/qwen3/my-finetune", None),  # an alias as a parent folder name is not evidence
        ("acme/unknown", None),
    ],
)
def test_infer_entry_from_folders_files_and_repos(text: str, expected: str | None) -> None:
    entry = infer_entry(text)
    assert (entry.name if entry else None) == expected


def test_gpu_experts_per_layer_follows_the_formula() -> None:
    entry = lookup("qwen3-30b-a3b")
    assert entry is not None and entry.gpu_experts_rule is not None
    r = entry.gpu_experts_rule
    vram = 24 * GIB
    budget = vram * r.vram_fraction - r.dense_params * 2.0 - r.reserve_bytes
    expected = math.floor(budget / (r.moe_layers * r.params_per_expert * 2.0))
    assert 0 < expected < r.experts_per_layer
    assert gpu_experts_per_layer(entry, vram, 1) == expected
    assert gpu_experts_per_layer(entry, 80 * GIB, 1) == r.experts_per_layer  # all fit
    assert gpu_experts_per_layer(entry, 2 * GIB, 1) == 0  # not even the dense part
    assert gpu_experts_per_layer(entry, vram, 2) > expected  # TP shards experts too
    assert gpu_experts_per_layer(entry, vram, 1, quant="Q4_K_M") > expected  # smaller weights
    dense = lookup("llama3.1-8b")
    assert dense is not None
    with pytest.raises(ConfigError) as e:
        gpu_experts_per_layer(dense, vram, 1)
    assert e.value.code == "registry.not_moe"


def test_registry_file_errors_are_config_errors(tmp_path: Path) -> None:
    bad = tmp_path / "models.toml"
    common = 'family = "llama"\nkind = "dense"\nparams = "1B"\ndescription = "d"\n'
    first = f'[[models]]\nname = "a"\nhf_repo = "o/a"\naliases = ["x"]\n{common}'
    second = f'[[models]]\nname = "x"\nhf_repo = "o/x"\n{common}'
    bad.write_text(first + second)
    with pytest.raises(ConfigError) as e:
        load_registry(bad)
    assert e.value.code == "registry.name_taken" and "'x'" in str(e.value)
    bad.write_text('[[models]]\nname = "a"\n')
    with pytest.raises(ConfigError) as e:
        load_registry(bad)
    assert e.value.code == "registry.entry_incomplete" and "hf_repo" in str(e.value)


def test_unknown_preset_lists_the_known_ones() -> None:
    assert get_preset("CPU-Small") is PRESETS["cpu-small"]
    with pytest.raises(ConfigError) as err:
        get_preset("turbo")
    text = str(err.value)
    assert all(name in text for name in PRESETS)


def test_presets_set_only_known_settings() -> None:
    assert {
        "cpu-small",
        "cpu-large",
        "gpu-single",
        "gpu-throughput",
        "moe-hybrid",
        "latency",
    } <= set(PRESETS)
    for p in PRESETS.values():
        assert set(p.settings) <= set(BY_NAME)
    assert PRESETS["moe-hybrid"].settings["cpu_offload_experts"] is True
    assert PRESETS["cpu-small"].settings["max_num_seqs"] == 16


def hw_with(gpus_gib: list[int]) -> HardwareInfo:
    gpus = [GPUInfo(i, "GPU", (9, 0), g * GIB, g * GIB) for i, g in enumerate(gpus_gib)]
    return HardwareInfo(
        cpu_model="test",
        physical_cores=16,
        logical_cores=32,
        usable_cores=32,
        cpu_flags=["avx2", "avx512f"],
        numa_nodes=1,
        ram_total_bytes=256 * GIB,
        ram_available_bytes=200 * GIB,
        cgroup_memory_limit_bytes=None,
        gpus=gpus,
        gpu_source="torch" if gpus else None,
        torch_version="2.13.0",
        cuda_version="12.8" if gpus else None,
        torch_cuda_available=bool(gpus),
    )


SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
}
LLAMA_70B = {
    **LLAMA_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 2048,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "vocab_size": 151936,
}
MIXTRAL_8X7B = {
    **LLAMA_8B,
    "architectures": ["MixtralForCausalLM"],
    "vocab_size": 32000,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}
QWEN15_MOE_A27B = {  # a gated shared expert 4 experts wide, every layer MoE
    "architectures": ["Qwen2MoeForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "decoder_sparse_step": 1,
    "vocab_size": 151936,
}
DEEPSEEK_V3 = {  # MLA is estimated as plain attention: close enough at this size
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "vocab_size": 129280,
}
OLMOE_1B_7B = {  # 1.3B active: a small model to decode
    "architectures": ["OlmoeForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 1024,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "vocab_size": 50304,
}


def test_estimate_params_is_close_to_the_real_counts() -> None:
    assert estimate_params(SMOLLM2_135M) == pytest.approx(134.5e6, rel=0.05)
    assert estimate_params(LLAMA_8B) == pytest.approx(8.03e9, rel=0.05)
    assert estimate_params(QWEN3_30B_A3B) == pytest.approx(30.5e9, rel=0.05)


@pytest.mark.parametrize(("config", "total", "active"), [
    (QWEN3_30B_A3B, 30.5e9, 3.3e9),
    (MIXTRAL_8X7B, 46.7e9, 12.9e9),
    (QWEN15_MOE_A27B, 14.3e9, 2.7e9),
    (DEEPSEEK_V3, 671e9, 37e9),  # 3 dense layers, a shared expert in the other 58
    (OLMOE_1B_7B, 6.9e9, 1.3e9),
])
def test_moe_total_and_active_params_are_close_to_the_published_ones(
        config: dict, total: float, active: float) -> None:
    assert estimate_params(config) == pytest.approx(total, rel=0.05)
    assert estimate_active_params(config) == pytest.approx(active, rel=0.05)


def test_a_dense_model_is_all_active() -> None:
    assert estimate_active_params(LLAMA_8B) == estimate_params(LLAMA_8B)


def test_a_moe_on_cpu_fits_by_total_and_decodes_by_active_params() -> None:
    """Qwen3-30B-A3B in Q4_K_M (~18 GiB) fits the 200 GiB of RAM; its 3.3B active params
    decode like a dense 3B (cpu-large); OLMoE's 1.3B active like a small one (cpu-small)."""
    # The registry's published counts, as startup passes them for a model it knows.
    q4 = {**QWEN3_30B_A3B, "quantization": "Q4_K_M", "total_bytes": 18_600_000_000,
          "num_params": 30.5e9, "active_params": 3.3e9}
    name, reason, code = infer_preset(q4, hw_with([]))
    assert (name, code) == ("cpu-large", "preset.moe_large_active")
    # the figures it went by, for a person: total, weights, active, experts
    assert "~30.5B total (17.3 GiB weights" in reason and "~3.3B active" in reason, reason
    assert "128 experts, 8 per token" in reason
    name, reason, code = infer_preset(OLMOE_1B_7B, hw_with([]))
    assert (name, code) == ("cpu-small", "preset.moe_small_active") and "1.3B active" in reason
    small_ram = hw_with([])
    small_ram.ram_available_bytes = 8 * GIB
    name, _, code = infer_preset(q4, small_ram)
    assert (name, code) == ("cpu-large", "preset.moe_large_active_over_ram")


def test_a_moe_on_gpu_needs_its_total_in_vram() -> None:
    """3.3B active does not make Qwen3-30B-A3B fit a 24 GiB GPU: all 30.5B must be there."""
    name, reason, code = infer_preset(QWEN3_30B_A3B, hw_with([24]))
    assert (name, code) == ("moe-hybrid", "preset.experts_split")
    assert "~3.4B active" in reason  # estimated from the config


@pytest.mark.parametrize(("name", "experts", "per_token", "shared", "family"), [
    ("qwen3-30b-a3b", 128, 8, 0, "qwen3_moe"),
    ("qwen3-235b-a22b", 128, 8, 0, "qwen3_moe"),
    ("qwen2-moe", 60, 4, 1, "qwen2_moe"),
    ("qwen1.5-moe-a2.7b", 60, 4, 1, "qwen2_moe"),
    ("deepseek-v2-lite", 64, 6, 2, "deepseek_v2"),
    ("deepseek-v3", 256, 8, 1, "deepseek_v3"),
    ("mixtral-8x7b", 8, 2, 0, "mixtral"),
    ("glm-4.5-air", 128, 8, 1, "glm4_moe"),
    ("gpt-oss-20b", 32, 4, 0, "gpt_oss"),
    ("gpt-oss-120b", 128, 4, 0, "gpt_oss"),
    ("minimax-m2", 256, 8, 0, "minimax_m2"),
    ("kimi-k2", 384, 8, 1, "deepseek_v3"),
])
def test_moe_aliases_resolve_with_their_expert_counts(
        name: str, experts: int, per_token: int, shared: int, family: str) -> None:
    entry = lookup(name)
    assert entry is not None and entry.kind == "moe" and entry.family == family
    rule = entry.gpu_experts_rule
    assert rule is not None
    assert (rule.experts_per_layer, rule.experts_per_token, rule.shared_experts) == (
        experts, per_token, shared)
    assert entry.active_params and entry.experts is not None
    assert entry.experts.startswith(f"{experts} experts, {per_token} per token")
    # The registry's own numbers agree: total from the rule within 5% of `params`.
    total = rule.dense_params + rule.moe_layers * rule.experts_per_layer * rule.params_per_expert
    active = rule.dense_params + rule.moe_layers * per_token * rule.params_per_expert
    assert total == pytest.approx(_billions(entry.params), rel=0.05)
    assert active == pytest.approx(_billions(entry.active_params), rel=0.15)


def _billions(text: str) -> float:
    value = parse_param_count(text)
    assert value is not None
    return value


def test_param_counts_parse_the_registry_text() -> None:
    assert parse_param_count("135M") == 135e6 and parse_param_count("30.5B") == 30.5e9
    assert parse_param_count("many") is None and parse_param_count(None) is None
    entry = lookup("qwen3-30b-a3b")
    assert entry is not None and entry.param_counts == (30.5e9, 3.3e9)


@pytest.mark.parametrize(
    ("config", "gpus", "expected"),
    [
        (SMOLLM2_135M, [], ("cpu-small", "preset.small_model")),
        (LLAMA_8B, [], ("cpu-large", "preset.large_model")),
        ({**LLAMA_8B, "quantization": "Q4_K_M"}, [24], ("gpu-single", "preset.fits_one_gpu")),
        (LLAMA_8B, [80], ("gpu-single", "preset.fits_one_gpu")),
        (LLAMA_70B, [80, 80, 80, 80], ("gpu-throughput", "preset.needs_tensor_parallel")),
        (QWEN3_30B_A3B, [24], ("moe-hybrid", "preset.experts_split")),
        (QWEN3_30B_A3B, [141], ("gpu-single", "preset.fits_one_gpu")),
        (QWEN3_30B_A3B, [], ("cpu-large", "preset.moe_large_active")),
        (LLAMA_70B, [24], (None, "preset.too_big")),
    ],
)
def test_infer_preset(config: dict, gpus: list[int], expected: tuple[str | None, str]) -> None:
    name, reason, code = infer_preset(config, hw_with(gpus))
    assert (name, code) == expected, reason
    assert reason  # the decision trace always has a why


def test_infer_preset_without_size_information() -> None:
    name, _, code = infer_preset({"architectures": ["X"]}, hw_with([]))
    assert (name, code) == (None, "preset.no_size")


def test_moe_hybrid_settings_fill_num_gpu_experts() -> None:
    entry = lookup("qwen3-30b-a3b")
    assert entry is not None
    s = moe_hybrid_settings(entry, hw_with([24]))
    assert s["cpu_offload_experts"] is True
    assert s["num_gpu_experts"] == gpu_experts_per_layer(entry, 24 * GIB, 1)
    with pytest.raises(ConfigError) as e:
        moe_hybrid_settings(entry, hw_with([]))
    assert e.value.code == "preset.moe_hybrid_needs_gpu"


def test_every_moe_rule_names_its_config_json_source() -> None:
    """models.toml writes the config.json numbers beside each rule: the comment above
    experts_per_layer names the repo and the values the rule is built from."""
    from importlib.resources import files

    text = files("kiln.resolve").joinpath("models.toml").read_text(encoding="utf-8")
    for block in text.split("[[models]]")[1:]:
        if "[models.gpu_experts_rule]" not in block:
            continue
        rule = block.split("[models.gpu_experts_rule]", 1)[1]
        repo = block.split('hf_repo = "', 1)[1].split('"', 1)[0]
        assert f"# config.json ({repo})" in rule, repo
        assert "hidden_size" in rule and "num_hidden_layers" in rule, repo


def test_dense_weights_stored_wider_than_the_experts_are_counted_at_their_width() -> None:
    """gpt-oss: MXFP4 experts but bf16 attention. Counting the dense weights at the experts'
    half byte would leave ~2.7 GB of a 16 GiB GPU unaccounted for."""
    entry = lookup("gpt-oss-120b")
    assert entry is not None and entry.gpu_experts_rule is not None
    rule = entry.gpu_experts_rule
    n = gpu_experts_per_layer(entry, 16 * GIB, 1)
    budget = 16 * GIB * rule.vram_fraction - rule.dense_params * 2.0 - rule.reserve_bytes
    assert n == int(budget // (rule.moe_layers * rule.params_per_expert * rule.bytes_per_param))
    # A quant given for the whole file re-encodes the dense weights too.
    q = gpu_experts_per_layer(entry, 16 * GIB, 1, quant="Q4_0")
    budget_q = 16 * GIB * rule.vram_fraction - rule.dense_params * 0.5625 - rule.reserve_bytes
    assert q == int(budget_q // (rule.moe_layers * rule.params_per_expert * 0.5625))
