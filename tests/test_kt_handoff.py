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
    assert "MoE model on SGLang" in settings["cpu_offload_experts"]["reason"]
    assert settings["kt_threadpool_count"]["source"] == "auto"
    assert "NUMA node (2 found)" in settings["kt_threadpool_count"]["reason"]
    assert "80% of the 64 physical cores of the 2 NUMA node(s)" in \
        settings["kt_cpuinfer"]["reason"]
    assert "24 GiB per GPU x TP 1" in settings["num_gpu_experts"]["reason"]
    assert "kt-cli's default" in settings["kt_weight_path"]["reason"]
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
    assert "not supported by kiln's engine" not in err
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
    assert "Glm4MoeForCausalLM" in err and "--engine vllm or --engine sglang" in err
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
    assert "hands off to vLLM" in eff["settings"]["engine"]["reason"]
    # One GPU: auto picks kiln's own engine, which then judges the architecture.
    machine["hw"] = two_socket_machine()
    rc, _, eff, _, err = dry_run(tmp_path, capsys, str(folder), "--engine", "auto")
    assert rc == 1 and "Glm4MoeForCausalLM" in err and eff["phase"] == "model"


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
    assert eff["settings"]["cpu_offload_experts"]["reason"].startswith("a dense model")


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
    from kiln.auto_rules import AutoContext
    from kiln.config import resolve_settings

    cli = {"engine": ("sglang", "--engine"), "kt_cpuinfer": (16, "--kt-cpuinfer")}
    s = resolve_settings(cli=cli, ctx=AutoContext(is_moe=False))
    assert s["cpu_offload_experts"] is True
    assert s.values["cpu_offload_experts"].reason == "--kt-cpuinfer given"
    assert resolve_settings(cli={"engine": ("vllm", "--engine")},
                            ctx=AutoContext(is_moe=True))["cpu_offload_experts"] is False


def test_amx_method_on_a_cpu_without_amx_is_an_error_that_says_what_to_do(
        machine: dict[str, HardwareInfo], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    machine["hw"] = two_socket_machine(flags=["avx2", "avx512f"])
    folder = model_folder(tmp_path / "Qwen3-30B-A3B", QWEN3_30B_A3B)
    rc, _, eff, _, err = dry_run(tmp_path, capsys, str(folder), "--engine", "sglang")
    assert rc == 1
    assert "--kt-method AMXINT4 (kt-cli's default)" in err and "Intel AMX" in err
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
    assert rc == 1
    assert f"--kt-weight-path {missing}" in err and "not found" in err
    assert "hint:" in err and "weight converter" in err
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
    assert tp["value"] == 4 and "cli asked 8" in tp["reason"] and "reduced to 4" in tp["reason"]
    assert any("tensor parallel size 8 (cli) reduced to 4" in w for w in eff["warnings"])
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
