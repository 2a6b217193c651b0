"""The hand-off to SGLang + kt-kernel, the way kt-cli starts it: local and HF-cached MoE
checkpoints planned from config.json alone (any architecture), kt-kernel on for MoE models by
default, kt-cli's defaults (thread pools, cpuinfer, method, prefill threshold), the weights path
checked, TP reduced to the model's maximum. The machine is simulated: two sockets (two NUMA
nodes, 64 physical cores, AMX) and one 24 GiB GPU."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from kiln.cli.main import main
from kiln.i18n import msg
from kiln.resolve import hardware
from kiln.resolve.hardware import GPUInfo, HardwareInfo
from kiln.resolve.registry import gpu_experts_per_layer, lookup

GIB = 1 << 30
AMX = ["amx_bf16", "amx_int8", "amx_tile", "avx2", "avx512_bf16", "avx512f"]

# Qwen/Qwen3-30B-A3B's config.json (the values kiln reads; the rest as published).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "norm_topk_prob": True, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 151643,
    "eos_token_id": 151645,
}
# zai-org/GLM-4.5-Air's config.json: an architecture kiln's own engine does not run.
GLM_45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
    "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_hidden_layers": 46, "first_k_dense_replace": 1, "num_attention_heads": 96,
    "num_key_value_heads": 8, "head_dim": 128, "n_routed_experts": 128, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 1.0, "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5,
    "attention_bias": True, "use_qk_norm": False, "vocab_size": 151552,
    "max_position_embeddings": 131072, "rope_theta": 1000000, "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": [151329, 151336],
}


def two_socket_machine(flags: list[str] | None = None, gpus_gib: tuple[int, ...] = (24,)
                       ) -> HardwareInfo:
    gpus = [GPUInfo(i, "NVIDIA GeForce RTX 4090", (8, 9), g * GIB, g * GIB)
            for i, g in enumerate(gpus_gib)]
    return HardwareInfo(
        cpu_model="Intel Xeon Platinum 8480+ (simulated, 2 sockets)", physical_cores=64,
        logical_cores=128, usable_cores=128, cpu_flags=list(AMX if flags is None else flags),
        numa_nodes=2, ram_total_bytes=512 * GIB, ram_available_bytes=480 * GIB,
        cgroup_memory_limit_bytes=None, gpus=gpus, gpu_source="torch", torch_version="2.8.0",
        cuda_version="12.8", torch_cuda_available=True)


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, HardwareInfo]:
    """The simulated hardware (replace machine["hw"] to change it), a bare HF cache and no
    config file, KILN_* variable or engine on PATH from this machine."""
    box = {"hw": two_socket_machine()}
    monkeypatch.setattr(hardware, "probe_hardware", lambda refresh=False: box["hw"])
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    (tmp_path / "empty-config.toml").write_text("")
    monkeypatch.setenv("KILN_CONFIG", str(tmp_path / "empty-config.toml"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for name in list(__import__("os").environ):
        if name.startswith("KILN_") and name != "KILN_CONFIG":
            monkeypatch.delenv(name)
    return box


def model_folder(folder: Path, config: dict[str, Any], shards: int = 2) -> Path:
    """config.json and a sharded safetensors index whose shards are placeholders: planning
    never opens them."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    index = {"metadata": {}, "weight_map": {f"w{i}": n for i, n in enumerate(names)}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    for n in names:
        (folder / n).write_bytes(b"\0" * 64)
    return folder


def hf_cached(cache: Path, repo_id: str, config: dict[str, Any]) -> Path:
    """models--owner--repo/snapshots/<rev>/ with refs/main, files as symlinks to blobs, the way
    huggingface_hub lays them out."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    rev = "c" * 40
    snap = model_folder(repo / "staging", config)
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / rev).mkdir(parents=True)
    for i, f in enumerate(sorted(snap.iterdir())):
        blob = repo / "blobs" / f"{i:064x}"
        f.rename(blob)
        (repo / "snapshots" / rev / f.name).symlink_to(blob)
    snap.rmdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    return repo / "snapshots" / rev


def dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str
            ) -> tuple[int, list[str], dict[str, Any], list[dict[str, Any]], str]:
    """`kiln serve ... --dry-run`: (exit code, the engine's argv, effective config, decision
    trace, stderr)."""
    eff, trace = tmp_path / "eff.json", tmp_path / "trace.jsonl"
    rc = main(["serve", *argv, "--dry-run", "--effective-config-json", str(eff),
               "--decision-trace-jsonl", str(trace)])
    out, err = capsys.readouterr()
    lines = out.splitlines()
    argv_out: list[str] = []
    if rc == 0 and any(line.endswith("command:") for line in lines):
        start = next(i for i, line in enumerate(lines) if line.endswith("command:"))
        command = next(line for line in lines[start + 1:] if not line.startswith("#"))
        argv_out = shlex.split(command)
    rows = [json.loads(r) for r in trace.read_text().splitlines()] if trace.exists() else []
    return rc, argv_out, json.loads(eff.read_text()) if eff.exists() else {}, rows, err


def said(warnings: list[dict[str, Any]], code: str) -> list[str]:
    """The English messages of the effective config's warnings with this code: what a test
    matches instead of the wording (the message is left for the data it carries)."""
    return [w["message"] for w in warnings if w["code"] == code]


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def expected_gpu_experts(name: str = "qwen3-30b-a3b", vram_gib: int = 24, tp: int = 1) -> int:
    entry = lookup(name)
    assert entry is not None
    return gpu_experts_per_layer(entry, vram_gib * GIB, tp)


def assert_kt_like_kt_cli(argv: list[str], weights: str) -> None:
    """kt-kernel flags as kt-cli gives them on the simulated machine."""
    assert argv[argv.index("--model-path") + 1] == weights
    assert flag(argv, "--kt-weight-path") == weights  # no converted weights: the model itself
    assert flag(argv, "--kt-method") == "AMXINT4"
    assert flag(argv, "--kt-threadpool-count") == "2"  # one pool per NUMA node
    assert flag(argv, "--kt-cpuinfer") == str(int(64 * 0.8))  # 80% of both nodes' cores
    n = expected_gpu_experts()
    assert 0 < n < 128
    assert flag(argv, "--kt-num-gpu-experts") == str(n)
    assert flag(argv, "--kt-gpu-prefill-token-threshold") == "4096"


# --------------------------------------------------------------------------- acceptance


def test_local_qwen3_moe_folder_dry_run_prints_sglang_with_kt_flags(
        machine: dict[str, HardwareInfo], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    folder = model_folder(tmp_path / "models" / "Qwen3-30B-A3B", QWEN3_30B_A3B)
    rc, argv, eff, rows, err = dry_run(tmp_path, capsys, str(folder), "--engine", "sglang")
    assert rc == 0, err
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert_kt_like_kt_cli(argv, str(folder))
    settings = eff["settings"]
    assert settings["cpu_offload_experts"]["value"] is True
    assert settings["cpu_offload_experts"]["code"] == "cpu_offload_experts.moe_on_sglang"
    assert settings["kt_threadpool_count"]["source"] == "auto"
    assert settings["kt_threadpool_count"]["code"] == "kt_threadpool_count.numa_nodes"
    assert "(2 found)" in settings["kt_threadpool_count"]["reason"]
    assert settings["kt_cpuinfer"]["code"] == "kt_cpuinfer.kt_cli_share"
    assert "64 physical cores of the 2 NUMA node(s)" in settings["kt_cpuinfer"]["reason"]
    assert settings["num_gpu_experts"]["code"] == "num_gpu_experts.registry_rule"
    assert "24 GiB" in settings["num_gpu_experts"]["reason"]  # the VRAM it is sized for
    assert settings["kt_weight_path"]["code"] == "kt_weight_path.model_folder"  # kt-cli's default
    # Planned from config.json: the experts are the config's, no checkpoint was opened.
    assert eff["model"]["config"]["num_experts"] == 128
    chosen = {r["setting"]: r["chosen"] for r in rows if r.get("decision") == "setting"}
    assert chosen["kt_cpuinfer"] == 51 and chosen["num_gpu_experts"] == expected_gpu_experts()


def test_hf_cached_qwen3_moe_dry_run_prints_the_same_sglang_command(
        machine: dict[str, HardwareInfo], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    snap = hf_cached(tmp_path / "hub", "Qwen/Qwen3-30B-A3B", QWEN3_30B_A3B)
    rc, argv, eff, _, err = dry_run(tmp_path, capsys, "Qwen/Qwen3-30B-A3B", "--engine", "sglang")
    assert rc == 0, err
    assert eff["model"]["origin"] == "hf-cache"
    assert_kt_like_kt_cli(argv, str(snap))


def test_glm_45_air_folder_reaches_sglang_instead_of_kilns_loader(
        machine: dict[str, HardwareInfo], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    folder = model_folder(tmp_path / "GLM-4.5-Air", GLM_45_AIR)
    rc, argv, eff, _, err = dry_run(tmp_path, capsys, str(folder), "--engine", "sglang")
    assert rc == 0, err
    assert eff["status"] == "dry-run" and "error" not in eff
    assert flag(argv, "--model-path") == str(folder)
    assert eff["model"]["config"]["architecture"] == "Glm4MoeForCausalLM"
    # The registry's GLM-4.5-Air rule sized its GPU experts; kt-kernel is on by default.
    entry = lookup("glm-4.5-air")
    assert entry is not None and eff["model"]["registry_entry"] == "glm-4.5-air"
    assert flag(argv, "--kt-num-gpu-experts") == str(
        gpu_experts_per_layer(entry, 24 * GIB, 1))
    assert flag(argv, "--kt-method") == "AMXINT4"
    # vLLM gets it too (no kt flags there).
    rc, argv, _, _, err = dry_run(tmp_path, capsys, str(folder), "--engine", "vllm")
    assert rc == 0, err
    assert argv[:2] == ["vllm", "serve"] and flag(argv, "--tensor-parallel-size") is None
    assert not [a for a in argv if a.startswith("--kt-")]


def test_kilns_own_engine_still_refuses_an_architecture_it_does_not_run(
        machine: dict[str, HardwareInfo], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    folder = model_folder(tmp_path / "GLM-4.5-Air", GLM_45_AIR)
    rc, _, eff, _, err = dry_run(tmp_path, capsys, str(folder))
    assert rc == 1
    assert eff["error"]["code"] == "model.arch_unsupported" and "Glm4MoeForCausalLM" in err
    assert "--engine sglang" in err  # the hint's way out
    assert eff["status"] == "failed" and eff["phase"] == "model"


def test_engine_auto_plans_from_config_json_and_hands_several_gpus_to_vllm(
        machine: dict[str, HardwareInfo], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import kiln.backends

    folder = model_folder(tmp_path / "GLM-4.5-Air", GLM_45_AIR)
    machine["hw"] = two_socket_machine(gpus_gib=(24, 24))
    monkeypatch.setattr(kiln.backends, "is_engine_available", lambda *a, **k: True)
    rc, argv, eff, _, err = dry_run(tmp_path, capsys, str(folder), "--engine", "auto",
                                    "-tp", "2")
    assert rc == 0, err
    assert argv[:3] == ["vllm", "serve", str(folder)]
    assert flag(argv, "--tensor-parallel-size") == "2"
    assert eff["settings"]["engine"]["value"] == "vllm"
    assert eff["settings"]["engine"]["code"] == "engine.gpus_to_vllm"
    # One GPU: auto picks kiln's own engine, which then judges the architecture.
    machine["hw"] = two_socket_machine()
    rc, _, eff, _, err = dry_run(tmp_path, capsys, str(folder), "--engine", "auto")
    assert rc == 1 and eff["error"]["code"] == "model.arch_unsupported"
    assert "Glm4MoeForCausalLM" in err and eff["phase"] == "model"


# --------------------------------------------------------------------------- kt-cli's defaults


def test_kt_kernel_off_with_the_flag_and_for_dense_models(
        machine: dict[str, HardwareInfo], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    folder = model_folder(tmp_path / "Qwen3-30B-A3B", QWEN3_30B_A3B)
    rc, argv, eff, _, err = dry_run(tmp_path, capsys, str(folder), "--engine", "sglang",
                                    "--no-cpu-offload-experts")
    assert rc == 0, err
    assert not [a for a in argv if a.startswith("--kt-")]
    assert eff["settings"]["cpu_offload_experts"] == {
        "value": False, "source": "cli", "affects": "memory",
        "reason": "set by --no-cpu-offload-experts"}
    dense = {**QWEN3_30B_A3B, "architectures": ["Qwen3ForCausalLM"], "num_experts": 0}
    rc, argv, eff, _, err = dry_run(tmp_path, capsys, str(model_folder(tmp_path / "d", dense)),
                                    "--engine", "sglang")
    assert rc == 0, err
    assert not [a for a in argv if a.startswith("--kt-")]
    assert eff["settings"]["cpu_offload_experts"]["code"] == "cpu_offload_experts.dense_on_gpu"


def test_kt_defaults_follow_the_pools_asked_for_and_explicit_values_win(
        machine: dict[str, HardwareInfo], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    folder = model_folder(tmp_path / "Qwen3-30B-A3B", QWEN3_30B_A3B)
    weights = tmp_path / "Qwen3-30B-A3B-INT4"
    weights.mkdir()
    rc, argv, eff, _, err = dry_run(
        tmp_path, capsys, str(folder), "--engine", "sglang", "--kt-threadpool-count", "1",
        "--kt-weight-path", str(weights), "--kt-method", "amxint8",
        "--kt-gpu-prefill-token-threshold", "2048", "--num-gpu-experts", "8")
    assert rc == 0, err
    assert flag(argv, "--kt-threadpool-count") == "1"
    assert flag(argv, "--kt-cpuinfer") == str(int(32 * 0.8))  # one node's 32 cores
    assert flag(argv, "--kt-weight-path") == str(weights)
    assert flag(argv, "--kt-method") == "AMXINT8"
    assert flag(argv, "--kt-gpu-prefill-token-threshold") == "2048"
    assert flag(argv, "--kt-num-gpu-experts") == "8"
    assert eff["settings"]["kt_weight_path"]["source"] == "cli"


def test_a_cpu_thread_count_turns_kt_kernel_on_for_a_model_kiln_cannot_tell_is_moe(
        machine: dict[str, HardwareInfo], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    from kiln.settings.resolve import resolve_settings
    from kiln.settings.rules import AutoContext

    cli = {"engine": ("sglang", "--engine"), "kt_cpuinfer": (16, "--kt-cpuinfer")}
    s = resolve_settings(cli=cli, ctx=AutoContext(is_moe=False))
    assert s["cpu_offload_experts"] is True
    assert s.values["cpu_offload_experts"].code == "cpu_offload_experts.kt_flags_given"
    assert "--kt-cpuinfer" in s.values["cpu_offload_experts"].reason
    assert resolve_settings(cli={"engine": ("vllm", "--engine")},
                            ctx=AutoContext(is_moe=True))["cpu_offload_experts"] is False


def test_amx_method_on_a_cpu_without_amx_is_an_error_that_says_what_to_do(
        machine: dict[str, HardwareInfo], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    machine["hw"] = two_socket_machine(flags=["avx2", "avx512f"])
    folder = model_folder(tmp_path / "Qwen3-30B-A3B", QWEN3_30B_A3B)
    rc, _, eff, _, err = dry_run(tmp_path, capsys, str(folder), "--engine", "sglang")
    assert rc == 1 and eff["error"]["code"] == "startup.kt_no_amx"
    assert "AMXINT4" in err  # the method asked for, then the ways out
    assert "--kt-method LLAMAFILE" in err and "--no-cpu-offload-experts" in err
    assert eff["status"] == "failed"
    # A method that needs no AMX goes through.
    rc, argv, _, _, err = dry_run(tmp_path, capsys, str(folder), "--engine", "sglang",
                                  "--kt-method", "BF16")
    assert rc == 0, err
    assert flag(argv, "--kt-method") == "BF16"


def test_missing_kt_weight_path_is_an_error_with_a_hint(
        machine: dict[str, HardwareInfo], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    folder = model_folder(tmp_path / "Qwen3-30B-A3B", QWEN3_30B_A3B)
    missing = tmp_path / "no-such-weights"
    rc, _, eff, _, err = dry_run(tmp_path, capsys, str(folder), "--engine", "sglang",
                                 "--kt-weight-path", str(missing))
    assert rc == 1 and eff["error"]["code"] == "startup.kt_weights_missing"
    assert str(missing) in err
    assert eff["status"] == "failed" and eff["phase"] == "settings"


def test_tp_above_the_models_maximum_is_reduced_with_a_warning(
        machine: dict[str, HardwareInfo], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    machine["hw"] = two_socket_machine(gpus_gib=(24,) * 8)
    folder = model_folder(tmp_path / "Qwen3-30B-A3B", QWEN3_30B_A3B)  # 4 KV heads: TP <= 4
    rc, argv, eff, rows, err = dry_run(tmp_path, capsys, str(folder), "--engine", "sglang",
                                       "-tp", "8")
    assert rc == 0, err
    assert flag(argv, "--tp-size") == "4"
    tp = eff["settings"]["tensor_parallel_size"]
    assert tp["value"] == 4 and tp["code"] == "tensor_parallel_size.model_max"
    assert said(eff["warnings"], "startup.tp_reduced")
    row = next(r for r in rows if r.get("setting") == "tensor_parallel_size")
    assert [c["value"] for c in row["candidates"]] == [8, 4]
    # The GPU experts are sized for the TP that runs.
    assert flag(argv, "--kt-num-gpu-experts") == str(expected_gpu_experts(tp=4))


def test_model_max_tp_from_the_config_when_the_registry_does_not_know_the_model() -> None:
    from kiln.models.config import ModelConfig
    from kiln.resolve.parallel import model_max_tp

    glm = ModelConfig.from_hf(GLM_45_AIR, require_supported=False)
    assert model_max_tp(None, glm) == 8
    assert model_max_tp(None, ModelConfig.from_hf(QWEN3_30B_A3B)) == 4
    assert model_max_tp(None, None) is None


# --------------------------------------------------------------------------- issue 43: kt-cli's habits
# deepseek-ai/DeepSeek-V3's config.json (the values kiln reads, and its auto_map: the model's own
# code, so SGLang needs --trust-remote-code).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "norm_topk_prob": True, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
    "max_position_embeddings": 163840, "rope_theta": 10000, "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0,
    "eos_token_id": 1,
}

# What kt-cli's `kt run` puts on every SGLang line for an MoE model (kt-kernel on), by flag;
# SGLang's aliases count as the same flag.
KT_CLI_FLAGS = ("--host", "--port", "--model-path", "--kt-weight-path", "--kt-cpuinfer",
                "--kt-threadpool-count", "--kt-num-gpu-experts", "--kt-method",
                "--kt-gpu-prefill-token-threshold", "--attention-backend",
                "--mem-fraction-static", "--chunked-prefill-size", "--max-running-requests",
                "--max-total-tokens", "--watchdog-timeout", "--enable-mixed-chunk",
                "--tensor-parallel-size", "--enable-p2p-check")
SGLANG_ALIASES = {"--tp-size": "--tensor-parallel-size", "--model": "--model-path"}


def kt_flags(argv: list[str]) -> set[str]:
    return {SGLANG_ALIASES.get(a, a) for a in argv if a.startswith("--")}


def test_unknown_options_after_model_go_to_sglang_and_kt_clis_own_are_settings(
        machine: dict[str, HardwareInfo], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    folder = model_folder(tmp_path / "Qwen3-30B-A3B", QWEN3_30B_A3B)
    rc, argv, eff, _, err = dry_run(
        tmp_path, capsys, str(folder), "--engine", "sglang", "--attention-backend", "flashinfer",
        "--max-total-tokens", "60000", "--watchdog-timeout", "600",
        "--disable-shared-experts-fusion", "--enable-dp-attention", "--dp-size", "2")
    assert rc == 0, err
    # kt-cli's first-class SGLang options are kiln settings (provenance, overriding preset kt)...
    assert flag(argv, "--attention-backend") == "flashinfer"
    assert flag(argv, "--max-total-tokens") == "60000"
    assert flag(argv, "--watchdog-timeout") == "600"
    assert "--disable-shared-experts-fusion" in argv
    s = eff["settings"]
    assert s["attention_backend"]["source"] == "cli" and s["max_total_tokens"]["value"] == 60000
    # ... and options kiln does not know reach SGLang as given, at the end of the line.
    assert argv[-3:] == ["--enable-dp-attention", "--dp-size", "2"]
    # kiln's own flags are still checked before anything is handed over.
    rc, argv, eff, _, err = dry_run(tmp_path, capsys, str(folder), "--engine", "sglang",
                                    "--max-num-seqs", "lots", "--enable-dp-attention")
    assert rc != 0 and eff["error"]["code"] == "config.invalid_value" and not argv
    assert "'lots'" in err and "--max-num-seqs" in err


def test_an_unknown_option_on_kilns_engine_names_the_nearest_flag_with_serves_usage(
        machine: dict[str, HardwareInfo], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    for argv, nearest in ((["--attention-backnd", "triton"], "--attention-backend"),
                          (["--max-running-request", "8"], "--max-running-requests")):
        with pytest.raises(SystemExit) as e:
            main(["serve", "smollm2", *argv, "--dry-run"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("usage: kiln serve") and "kiln serve: error" in err
        assert msg("serve.unknown_args", args=" ".join(argv),
                   nearest=str(msg("serve.did_you_mean", flag=nearest))) in err


def test_preset_kt_gives_kt_clis_fixed_sglang_flags_each_overridable(
        machine: dict[str, HardwareInfo], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    folder = model_folder(tmp_path / "Qwen3-30B-A3B", QWEN3_30B_A3B)
    eff_path = tmp_path / "eff.json"
    rc = main(["serve", str(folder), "--engine", "sglang", "--dry-run", "--mem-fraction-static",
               "0.9", "--effective-config-json", str(eff_path)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    argv = shlex.split(out.strip().splitlines()[-1])
    assert flag(argv, "--attention-backend") == "triton"
    assert flag(argv, "--max-total-tokens") == "40000"
    assert flag(argv, "--max-running-requests") == "32"
    assert flag(argv, "--chunked-prefill-size") == "4096"
    assert flag(argv, "--watchdog-timeout") == "3000"
    assert flag(argv, "--tp-size") == "1"  # spelled out, as kt-cli does, with kt-kernel on
    assert "--enable-mixed-chunk" in argv and "--enable-p2p-check" in argv
    assert flag(argv, "--mem-fraction-static") == "0.9"  # the person's value beats the preset's
    assert json.loads(eff_path.read_text())["preset"]["name"] == "kt"
    assert any(line.split()[0] == "attention_backend" and "[preset kt]" in line
               for line in out.splitlines() if line.startswith("  "))
    s = json.loads(eff_path.read_text())["settings"]
    assert s["gpu_memory_utilization"]["source"] == "cli"
    assert s["watchdog_timeout"] == {"value": 3000.0, "source": "preset", "affects": "server",
                                     "reason": "set by preset kt"}
    # kt-cli passes --trust-remote-code for every model; kiln says why it does not here.
    assert "--trust-remote-code" not in argv
    assert s["trust_remote_code"]["code"] == "trust_remote_code.engine_code"
    assert "--trust-remote-code" in s["trust_remote_code"]["reason"]
    # A model that ships its own code gets it (config.json's auto_map), as does a remote Kimi.
    ds = model_folder(tmp_path / "my-finetune", DEEPSEEK_V3)  # no registry entry: its config
    rc, argv, eff, _, err = dry_run(tmp_path, capsys, str(ds), "--engine", "sglang")
    assert rc == 0, err
    assert "--trust-remote-code" in argv
    assert eff["settings"]["trust_remote_code"]["code"] == "trust_remote_code.model_code"
    assert "modeling_deepseek" in eff["settings"]["trust_remote_code"]["reason"]
    rc, argv, eff, _, err = dry_run(tmp_path, capsys, "kimi-k2", "--engine", "sglang")
    assert rc == 0, err
    assert "--trust-remote-code" in argv and eff["settings"]["trust_remote_code"]["source"] == \
        "registry"
    # kt-kernel off: no preset kt, SGLang's own defaults.
    rc, argv, eff, _, err = dry_run(tmp_path, capsys, str(folder), "--engine", "sglang",
                                    "--no-cpu-offload-experts")
    assert rc == 0, err
    assert eff["preset"]["name"] is None and "--attention-backend" not in argv


def test_kt_clis_folder_names_are_found_and_get_the_registry_rule(
        machine: dict[str, HardwareInfo], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    models = tmp_path / "kt-models"
    folder = model_folder(models / "Qwen--Qwen3-30B-A3B", QWEN3_30B_A3B)
    # By registry name, with kt's model folder: found there, not downloaded again.
    rc, argv, eff, _, err = dry_run(tmp_path, capsys, "qwen3-30b-a3b", "--engine", "sglang",
                                    "--model-dir", str(models))
    assert rc == 0, err
    assert flag(argv, "--model-path") == str(folder) and eff["model"]["origin"] == "model-dir"
    # By path: the registry rule applies (GPU experts sized for the GPU).
    rc, argv, eff, _, err = dry_run(tmp_path, capsys, str(folder), "--engine", "sglang")
    assert rc == 0, err
    assert eff["model"]["registry_entry"] == "qwen3-30b-a3b"
    assert flag(argv, "--kt-num-gpu-experts") == str(expected_gpu_experts())
    assert not said(eff["warnings"], "startup.no_registry_rule")
    # A folder kiln cannot name: default parameters, said once, with the tip.
    other = model_folder(tmp_path / "my-moe", QWEN3_30B_A3B)
    rc, argv, eff, _, err = dry_run(tmp_path, capsys, str(other), "--engine", "sglang")
    assert rc == 0, err
    notes = said(eff["warnings"], "startup.no_registry_rule")
    assert len(notes) == 1 and f"--model-path {other}" in notes[0]  # the tip names the folder
    assert not said(eff["warnings"], "startup.gpu_experts_unsized")


def test_model_path_short_names_and_a_choice_among_registry_matches(
        machine: dict[str, HardwareInfo], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    ds = model_folder(tmp_path / "D", DEEPSEEK_V3)
    rc, argv, eff, _, err = dry_run(tmp_path, capsys, "deepseek-v3", "--model-path", str(ds),
                                    "--engine", "sglang")
    assert rc == 0, err
    assert flag(argv, "--model-path") == str(ds) and flag(argv, "--served-model-name") == \
        "deepseek-v3"
    assert eff["model"]["registry_entry"] == "deepseek-v3"
    assert eff["settings"]["model_path"]["source"] == "cli"
    entry = lookup("deepseek-v3")
    assert entry is not None
    assert flag(argv, "--kt-num-gpu-experts") == str(gpu_experts_per_layer(entry, 24 * GIB, 1))
    assert "--disable-shared-experts-fusion" in argv  # the registry's, as kt-cli's
    # kt-cli's short names: m2 is MiniMax-M2 (fetched by SGLang: not on this machine).
    rc, argv, eff, _, err = dry_run(tmp_path, capsys, "m2", "--engine", "sglang")
    assert rc == 0, err
    assert flag(argv, "--model-path") == "MiniMaxAI/MiniMax-M2"
    # A short name that points at one model takes it, and says so.
    rc, argv, eff, _, err = dry_run(tmp_path, capsys, "qwen3-30", "--engine", "sglang")
    assert rc == 0, err
    assert eff["model"]["registry_entry"] == "qwen3-30b-a3b"
    assert msg("model.search_picked", spec="'qwen3-30'", name="qwen3-30b-a3b",
               repo="Qwen/Qwen3-30B-A3B") in err
    # Several: listed when nobody can answer ...
    rc, _, eff, _, err = dry_run(tmp_path, capsys, "deepseek-v", "--engine", "sglang")
    assert rc != 0 and eff["error"]["code"] == "model.search_several"
    assert "deepseek-v2-lite, deepseek-v3" in err

    # ... and a choice at a terminal.
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stdin", Terminal("2\n"))
    rc, argv, eff, _, err = dry_run(tmp_path, capsys, "deepseek-v", "--engine", "sglang")
    assert rc == 0, err
    assert "1. deepseek-v2-lite" in err and "2. deepseek-v3" in err
    assert eff["model"]["registry_entry"] == "deepseek-v3"
    assert flag(argv, "--model-path") == "deepseek-ai/DeepSeek-V3"


def test_kt_clis_own_spellings_carry_every_flag_kt_clis_line_would(
        machine: dict[str, HardwareInfo], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Each as a kt-cli user types it (kt-cli's own spellings included); the SGLang line carries
    every flag of kt-cli's. Where kiln's value differs (trust-remote-code only where the model
    ships code), the effective config says why."""
    models = tmp_path / "models"
    qwen = model_folder(models / "Qwen--Qwen3-30B-A3B", QWEN3_30B_A3B)
    ds = model_folder(models / "deepseek-v3", DEEPSEEK_V3)
    glm = model_folder(models / "zai-org--GLM-4.5-Air", GLM_45_AIR)
    commands = [
        ["qwen3-30b-a3b", "--model-dir", str(models)],
        [str(qwen)],
        ["deepseek-v3", "--model-path", str(ds)],
        [str(ds), "--gpu-experts", "4", "--cpu-threads", "32", "--numa-nodes", "1"],
        ["kimi-k2"],
        ["m2"],
        [str(glm), "--max-running-requests", "16", "--chunked-prefill-size", "8192"],
        ["qwen3-30b-a3b", "--model-dir", str(models), "--tp", "1", "--kt-method", "AMXINT8",
         "--kt-gpu-prefill-threshold", "2048"],
        ["mixtral-moe", "--attention-backend", "flashinfer", "--watchdog-timeout", "600"],
        [str(qwen), "--served-model-name", "Qwen3", "--mem-fraction-static", "0.9",
         "--max-total-tokens", "60000", "--enable-dp-attention"],
    ]
    for command in commands:
        rc, argv, eff, _, err = dry_run(tmp_path, capsys, *command, "--engine", "sglang")
        assert rc == 0, (command, err)
        missing = set(KT_CLI_FLAGS) - kt_flags(argv)
        assert not missing, (command, missing)
        assert eff["preset"]["name"] == "kt", command
        if "--trust-remote-code" not in argv:
            assert eff["settings"]["trust_remote_code"]["code"] == \
                "trust_remote_code.engine_code", command
    # kt-cli's spellings landed on kiln's settings (the last command's and the 4th's).
    assert flag(argv, "--served-model-name") == "Qwen3"
    assert flag(argv, "--mem-fraction-static") == "0.9"
    assert flag(argv, "--max-total-tokens") == "60000" and argv[-1] == "--enable-dp-attention"


def test_a_real_hand_off_prints_the_summary_and_the_command_it_launches(
        machine: dict[str, HardwareInfo], tmp_path: Path,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a dry run: kiln starts the engine (the fake SGLang, which fails as it loads), after
    printing what the dry run shows and the command line."""
    import sys

    fake = Path(__file__).resolve().parents[1] / "fixtures" / "fake_engine.py"
    folder = model_folder(tmp_path / "Qwen3-30B-A3B", QWEN3_30B_A3B)
    monkeypatch.setenv("FAKE_EXIT_BEFORE_READY", "3")
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    rc = main(["serve", str(folder), "--engine", "sglang", "--engine-command",
               f"{sys.executable} {fake}", "--port", "39999"])
    out, err = capsys.readouterr()
    assert rc == 3, err
    assert "preset: kt" in err and "kt_cpuinfer" in err and "[preset kt]" in err
    line = err.split("launching server with command:\n", 1)[1].splitlines()[0]
    argv = shlex.split(line)
    assert argv[:2] == [sys.executable, str(fake)]
    assert not set(KT_CLI_FLAGS) - kt_flags(argv)
    assert msg("launch.exited_early", engine="sglang", code=3) in out  # the engine really ran


def test_a_draft_alias_reaches_the_engines_as_what_they_load(
        machine: dict[str, HardwareInfo], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    folder = model_folder(tmp_path / "Qwen3-30B-A3B", QWEN3_30B_A3B)
    rc, argv, eff, _, err = dry_run(tmp_path, capsys, str(folder), "--engine", "sglang",
                                    "--speculative-model", "qwen3-0.6b",
                                    "--num-speculative-tokens", "3")
    assert rc == 0, err
    assert flag(argv, "--speculative-draft-model-path") == "Qwen/Qwen3-0.6B"
    assert "qwen3-0.6b resolved" in eff["settings"]["speculative_model"]["reason"]
    # On this machine (a kt-style folder in --model-dir): its files.
    models = tmp_path / "models"
    draft = model_folder(models / "Qwen--Qwen3-0.6B", {**QWEN3_30B_A3B, "num_experts": 0,
                                                       "architectures": ["Qwen3ForCausalLM"]})
    rc, argv, _, _, err = dry_run(tmp_path, capsys, str(folder), "--engine", "vllm",
                                  "--speculative-model", "qwen3-0.6b", "--model-dir",
                                  str(models), "--num-speculative-tokens", "3")
    assert rc == 0, err
    assert json.loads(flag(argv, "--speculative-config") or "{}")["model"] == str(draft)


def test_a_registry_model_that_is_not_here_is_not_answered_with_other_models(
        machine: dict[str, HardwareInfo], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    for spec in ("qwen3-0.6b", "Qwen/Qwen3-0.6B", "m2"):  # m2: kt-cli's short name
        rc, _, eff, _, err = dry_run(tmp_path, capsys, spec)
        assert rc != 0 and eff["error"]["code"] == "model.not_cached"
        assert eff["error"]["hint_code"] == "model.list_hint"  # the way out, no suggestions
        assert f"kiln pull {spec}" in err
    # A name kiln does not know still gets suggestions.
    rc, _, eff, _, err = dry_run(tmp_path, capsys, "Qwen/Qwen3-0.7B")
    assert rc != 0 and eff["error"]["hint_code"] == "model.did_you_mean"


def test_the_embedded_models_repo_offline_is_the_embedded_copy(
        machine: dict[str, HardwareInfo], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, eff, _, err = dry_run(tmp_path, capsys, "HuggingFaceTB/SmolLM2-135M-Instruct",
                                 "--offline")
    assert rc == 0, err
    assert eff["model"]["origin"] == "embedded" and eff["model"]["format"] == "gguf"
    assert eff["model"]["name"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


# kt-cli's fixed flags with the values `kt run` gives them (kt-kernel on, one 24 GiB GPU, two
# NUMA nodes of 32 cores); the model-dependent ones (GPU experts, remote code) are checked apart.
KT_CLI_VALUES = {"--attention-backend": "triton", "--max-total-tokens": "40000",
                 "--max-running-requests": "32", "--chunked-prefill-size": "4096",
                 "--mem-fraction-static": "0.98", "--watchdog-timeout": "3000",
                 "--kt-method": "AMXINT4", "--kt-threadpool-count": "2",
                 "--kt-cpuinfer": str(int(64 * 0.8)), "--kt-gpu-prefill-token-threshold": "4096",
                 "--tp-size": "1", "--host": "127.0.0.1", "--port": "8000"}


def test_issue_43s_commands_as_a_kt_cli_user_types_them_give_kt_clis_sglang_line(
        machine: dict[str, HardwareInfo], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Acceptance of issue 43: the commands of its items 1-7 and 9 (the hand-off ones), each with
    --dry-run on the simulated 2-socket machine with one 24 GiB GPU, give an SGLang line with
    every flag kt-cli's `kt run` gives, at kt-cli's value, or kiln's reason where it differs
    (--trust-remote-code only for models that ship code). Item 8 (a real hand-off) is
    test_a_real_hand_off_prints_the_summary_and_the_command_it_launches."""
    models = tmp_path / "models"
    qwen = model_folder(models / "Qwen--Qwen3-30B-A3B", QWEN3_30B_A3B)
    ds = model_folder(tmp_path / "D", DEEPSEEK_V3)
    config = tmp_path / "kt.toml"
    # The default model, and a kt-cli option's default, from the config file.
    config.write_text('model = "qwen3-30b-a3b"\nwatchdog_timeout = 600\n')
    knobs = ["--sequence-fit-policy", "full-input-must-fit",
             "--scheduler-prefill-first-until-active", "8", "--scheduler-prefill-step-chunk",
             "512", "--scheduler-active-decode-prefill-chunk", "256"]
    commands: dict[str, list[str]] = {
        "1 SGLang's options": ["qwen3-30b-a3b", "--attention-backend", "triton"],
        "2 kt-cli's fixed flags": ["kimi-k2"],
        "3 kt's folder by name": ["qwen3-30b-a3b", "--model-dir", str(models)],
        "3 kt's folder by path": [str(qwen)],
        "4 short alias": ["m2"],
        "4 --model-path": ["deepseek-v3", "--model-path", str(ds)],
        "5 config file's model": ["--config", str(config)],
        "6 served names": ["qwen3-30b-a3b", "--served-model-name", "a",
                           "--served-model-name", "b"],
        "7 ferrum's scheduler knobs": ["qwen3-30b-a3b", *knobs],
        "9 draft alias": ["qwen3-30b-a3b", "--speculative-draft-model-path", "qwen3-0.6b",
                          "--num-speculative-tokens", "3"],
    }
    runs = {}
    for item, command in commands.items():
        rc, argv, eff, _, err = dry_run(tmp_path, capsys, *command, "--engine", "sglang")
        assert rc == 0, (item, err)
        assert argv[1:3] == ["-m", "sglang.launch_server"], item
        missing = set(KT_CLI_FLAGS) - kt_flags(argv)
        assert not missing, (item, missing)
        # A value a person gave wins over kt-cli's (the config file's watchdog in item 5).
        given = {"--watchdog-timeout": "600"} if item.startswith("5") else {}
        for name, value in {**KT_CLI_VALUES, **given}.items():
            assert flag(argv, name) == value, (item, name, flag(argv, name))
        assert "--enable-mixed-chunk" in argv and "--enable-p2p-check" in argv, item
        entry = lookup(eff["model"]["registry_entry"])
        assert entry is not None, item
        assert flag(argv, "--kt-num-gpu-experts") == str(gpu_experts_per_layer(entry, 24 * GIB,
                                                                               1)), item
        assert eff["preset"]["name"] == "kt", item
        # The simulated CPU's AMX, as check_kt sees it (not the machine the test runs on).
        assert eff["settings"]["kt_method"]["code"] == "kt_method.amx", item
        trust = eff["settings"]["trust_remote_code"]
        if "--trust-remote-code" not in argv:  # kt-cli passes it always; kiln says why not
            assert trust["code"] == "trust_remote_code.engine_code", item
            assert "--trust-remote-code" in trust["reason"], item
        runs[item] = argv, eff
    # What each item fixed, on its own line.
    argv, eff = runs["1 SGLang's options"]
    assert eff["settings"]["attention_backend"]["source"] == "cli"
    assert flag(argv, "--model-path") == "Qwen/Qwen3-30B-A3B"  # SGLang fetches it
    argv, eff = runs["2 kt-cli's fixed flags"]
    assert "--trust-remote-code" in argv and flag(argv, "--model-path") == \
        "moonshotai/Kimi-K2-Instruct"
    assert eff["settings"]["watchdog_timeout"]["source"] == "preset"
    for item in ("3 kt's folder by name", "3 kt's folder by path"):
        argv, eff = runs[item]
        assert flag(argv, "--model-path") == str(qwen), item
        assert eff["model"]["registry_entry"] == "qwen3-30b-a3b", item
    assert runs["3 kt's folder by name"][1]["model"]["origin"] == "model-dir"
    argv, eff = runs["4 short alias"]
    assert flag(argv, "--model-path") == "MiniMaxAI/MiniMax-M2"
    assert "--trust-remote-code" in argv and "--disable-shared-experts-fusion" in argv
    argv, eff = runs["4 --model-path"]
    assert flag(argv, "--model-path") == str(ds) and "--trust-remote-code" in argv
    assert flag(argv, "--served-model-name") == "deepseek-v3"
    argv, eff = runs["5 config file's model"]
    assert eff["settings"]["model"]["source"] == "file"
    assert flag(argv, "--model-path") == "Qwen/Qwen3-30B-A3B"
    assert flag(argv, "--watchdog-timeout") == "600"  # the file's, over preset kt's 3000
    assert eff["settings"]["watchdog_timeout"]["source"] == "file"
    argv, eff = runs["6 served names"]
    assert eff["settings"]["served_model_name"]["value"] == ["a", "b"]
    assert flag(argv, "--served-model-name") == "a"  # SGLang takes one name, and kiln says so
    assert said(eff["engine"]["warnings"], "handoff.sglang_one_name")
    argv, eff = runs["7 ferrum's scheduler knobs"]
    for knob in knobs[::2]:  # kiln's scheduler's knobs: not passed on, each said why
        assert knob not in argv
        assert any(f"{knob}=" in w for w in said(eff["engine"]["warnings"], "handoff.ignores"))
    assert eff["settings"]["scheduler_prefill_step_chunk"] == {
        "value": 512, "source": "cli", "affects": "performance",
        "reason": "set by --scheduler-prefill-step-chunk"}
    argv, eff = runs["9 draft alias"]
    assert flag(argv, "--speculative-draft-model-path") == "Qwen/Qwen3-0.6B"
    assert flag(argv, "--speculative-num-steps") == "3"
    assert "qwen3-0.6b resolved" in eff["settings"]["speculative_model"]["reason"]


def test_ferrums_scheduler_knobs_reach_vllm_where_it_has_one_and_are_said_ignored_elsewhere(
        machine: dict[str, HardwareInfo], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    folder = model_folder(tmp_path / "Qwen3-30B-A3B", QWEN3_30B_A3B)
    rc, argv, eff, _, err = dry_run(
        tmp_path, capsys, str(folder), "--engine", "vllm", "--scheduler-prefill-step-chunk",
        "512", "--sequence-fit-policy", "full-input-must-fit",
        "--scheduler-active-decode-prefill-chunk", "256", "--greedy-argmax")
    assert rc == 0, err
    # vLLM's v1 scheduler cuts each request's prefill at --long-prefill-token-threshold.
    assert flag(argv, "--long-prefill-token-threshold") == "512"
    warnings = eff["engine"]["warnings"]
    assert said(warnings, "handoff.vllm_fit_policy")  # full-input-must-fit: not vLLM's rule
    assert any("--scheduler-active-decode-prefill-chunk=256" in w
               for w in said(warnings, "handoff.ignores"))
    assert "--greedy-argmax" not in argv  # vLLM's greedy rows are an argmax already


def test_a_ferrum_size_tag_names_that_size_or_fails_never_another_size(
        machine: dict[str, HardwareInfo], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """ferrum's (and Ollama's) FAMILY:SIZE: qwen3:4b is Qwen3-4B; qwen3:14b, a size kiln's
    registry lacks, is an error listing the sizes it has, not Qwen3-8B (the family's default)
    with '14b' taken for a GGUF quant. The same for a draft model."""
    rc, argv, _, _, err = dry_run(tmp_path, capsys, "qwen3:4b", "--engine", "sglang")
    assert rc == 0, err
    assert flag(argv, "--model-path") == "Qwen/Qwen3-4B"
    rc, _, eff, _, err = dry_run(tmp_path, capsys, "qwen3:14b", "--engine", "sglang")
    assert rc != 0 and eff["error"]["code"] == "model.unknown_size"
    assert "qwen3:0.6b, qwen3:4b, qwen3:8b" in err and "Qwen3-8B" not in err
    folder = model_folder(tmp_path / "Qwen3-30B-A3B", QWEN3_30B_A3B)
    rc, argv, _, _, err = dry_run(tmp_path, capsys, str(folder), "--engine", "sglang",
                                  "--spec-draft", "qwen3:0.6b", "--spec-tokens", "3")
    assert rc == 0, err
    assert flag(argv, "--speculative-draft-model-path") == "Qwen/Qwen3-0.6B"
    rc, argv, eff, _, err = dry_run(tmp_path, capsys, str(folder), "--engine", "sglang",
                                    "--spec-draft", "qwen3:14b", "--spec-tokens", "3")
    assert rc != 0 and eff["error"]["code"] == "model.unknown_size" and "qwen3:14b" in err
