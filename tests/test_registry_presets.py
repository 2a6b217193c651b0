"""Model registry (models.toml) and runtime presets."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kiln.config import BY_NAME
from kiln.errors import ConfigError
from kiln.resolve.hardware import GPUInfo, HardwareInfo
from kiln.resolve.presets import (
    PRESETS,
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
)

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
    with pytest.raises(ConfigError, match="MoE"):
        gpu_experts_per_layer(dense, vram, 1)


def test_registry_file_errors_are_config_errors(tmp_path: Path) -> None:
    bad = tmp_path / "models.toml"
    common = 'family = "llama"\nkind = "dense"\nparams = "1B"\ndescription = "d"\n'
    first = f'[[models]]\nname = "a"\nhf_repo = "o/a"\naliases = ["x"]\n{common}'
    second = f'[[models]]\nname = "x"\nhf_repo = "o/x"\n{common}'
    bad.write_text(first + second)
    with pytest.raises(ConfigError, match="used by"):
        load_registry(bad)
    bad.write_text('[[models]]\nname = "a"\n')
    with pytest.raises(ConfigError, match="lacks"):
        load_registry(bad)


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
    "vocab_size": 151936,
}


def test_estimate_params_is_close_to_the_real_counts() -> None:
    assert estimate_params(SMOLLM2_135M) == pytest.approx(134.5e6, rel=0.05)
    assert estimate_params(LLAMA_8B) == pytest.approx(8.03e9, rel=0.05)
    assert estimate_params(QWEN3_30B_A3B) == pytest.approx(30.5e9, rel=0.05)


@pytest.mark.parametrize(
    ("config", "gpus", "expected"),
    [
        (SMOLLM2_135M, [], "cpu-small"),
        (LLAMA_8B, [], "cpu-large"),
        ({**LLAMA_8B, "quantization": "Q4_K_M"}, [24], "gpu-single"),
        (LLAMA_8B, [80], "gpu-single"),
        (LLAMA_70B, [80, 80, 80, 80], "gpu-throughput"),
        (QWEN3_30B_A3B, [24], "moe-hybrid"),
        (QWEN3_30B_A3B, [141], "gpu-single"),
        (QWEN3_30B_A3B, [], "cpu-large"),
        (LLAMA_70B, [24], None),
    ],
)
def test_infer_preset(config: dict, gpus: list[int], expected: str | None) -> None:
    name, reason = infer_preset(config, hw_with(gpus))
    assert name == expected, reason
    assert reason  # the decision trace always has a why


def test_infer_preset_without_size_information() -> None:
    name, reason = infer_preset({"architectures": ["X"]}, hw_with([]))
    assert name is None and "size" in reason


def test_moe_hybrid_settings_fill_num_gpu_experts() -> None:
    entry = lookup("qwen3-30b-a3b")
    assert entry is not None
    s = moe_hybrid_settings(entry, hw_with([24]))
    assert s["cpu_offload_experts"] is True
    assert s["num_gpu_experts"] == gpu_experts_per_layer(entry, 24 * GIB, 1)
    with pytest.raises(ConfigError, match="needs a GPU"):
        moe_hybrid_settings(entry, hw_with([]))
