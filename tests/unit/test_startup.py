"""What `kiln serve` decides before loading weights: precedence, dry-run, fail-closed device,
and the artifacts written when startup fails."""

from __future__ import annotations

import argparse
import json

import pytest

from kiln.cli.main import main
from kiln.errors import ConfigError
from kiln.i18n import msg
from kiln.settings import sources as S
from kiln.settings.resolve import resolve_settings
from kiln.settings.rules import AutoContext


def _cli(*argv: str) -> dict:
    p = argparse.ArgumentParser()
    S.add_setting_arguments(p)
    return S.cli_values(p.parse_args(list(argv)))


@pytest.mark.parametrize("top", ["cli", "env", "file", "preset", "registry", "auto"])
def test_each_source_wins_over_the_ones_below_it(top):
    layers = {
        "cli": _cli("--max-num-seqs", "1"),
        "env": S.env_values({"KILN_MAX_NUM_SEQS": "2"}),
        "file": {"max_num_seqs": 3},
        "preset": {"max_num_seqs": 4},
        "registry": {"max_num_seqs": 5},
    }
    order = ["cli", "env", "file", "preset", "registry", "auto"]
    given = {k: v for k, v in layers.items() if order.index(k) >= order.index(top)}
    s = resolve_settings(**given, ctx=AutoContext(device="cpu"))
    expected = {"cli": 1, "env": 2, "file": 3, "preset": 4, "registry": 5, "auto": 32}[top]
    assert s["max_num_seqs"] == expected
    assert s.source("max_num_seqs") == top
    # Every lower source that was given is still listed as a candidate.
    assert [c.source for c in s.values["max_num_seqs"].candidates] == \
        [k for k in order if k in given] + (["auto"] if top == "auto" else [])


def test_auto_reason_is_recorded():
    s = resolve_settings(ctx=AutoContext(device="cpu", physical_cores=6))
    assert s["num_threads"] == 6 and s.source("num_threads") == "auto"
    assert s.values["num_threads"].code == "num_threads.physical_cores"
    assert "6 physical core" in s.values["num_threads"].reason  # the number it follows


def test_conflicting_spellings_of_one_flag_are_rejected_by_name():
    with pytest.raises(ConfigError, match="--enable-prefix-caching and "
                                            "--no-enable-prefix-caching") as e:
        _cli("--enable-prefix-caching", "--no-enable-prefix-caching")
    assert e.value.code == "config.conflicting_flags"
    # Two spellings that agree are fine.
    assert _cli("--disable-prefix-cache", "--no-enable-prefix-caching")[
        "enable_prefix_caching"][0] is False


def test_bad_values_name_the_flag():
    with pytest.raises(ConfigError, match="--max-num-seqs") as e:
        resolve_settings(env=S.env_values({"KILN_MAX_NUM_SEQS": "-3"}))
    assert e.value.code == "config.invalid_value"
    with pytest.raises(ConfigError) as e:
        resolve_settings(file={"kv_cache_dtype": "int3"})
    assert e.value.code == "config.invalid_choice" and "--kv-cache-dtype" in str(e.value)


def test_served_model_names_reject_bad_lists():
    for bad in ("a,,b", "a, b", "a,a", ""):
        with pytest.raises(ConfigError):
            resolve_settings(cli={"served_model_name": (bad, "--served-model-name")})


def test_dry_run_default_model_prints_sources_without_loading(capsys, tmp_path):
    out_json = tmp_path / "eff.json"
    trace = tmp_path / "trace.jsonl"
    rc = main(["serve", "--dry-run", "--max-num-seqs", "7", "--effective-config-json",
               str(out_json), "--decision-trace-jsonl", str(trace)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "max_num_seqs" in text and "[cli]" in text and "[auto]" in text
    assert "SmolLM2-135M-Instruct" in text
    eff = json.loads(out_json.read_text())
    assert eff["status"] == "dry-run"
    assert eff["settings"]["max_num_seqs"] == {
        "value": 7, "source": "cli", "affects": "performance", "reason": "set by --max-num-seqs"}
    assert eff["model"]["format"] == "gguf" and eff["model"]["total_bytes"] > 50_000_000
    assert eff["hardware"]["physical_cores"] >= 1
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert any(r.get("setting") == "max_num_seqs" and r["chosen"] == 7 for r in rows)
    assert rows[-1]["decision"] == "startup"


def test_cpu_defaults_follow_the_gguf_quantization(tmp_path, capsys):
    """On CPU the default Q4_1 GGUF runs its own 4-bit blocks through the int4 kernels (auto),
    with bf16 copies for large steps; an external engine gets the checkpoint as it is."""
    eff_path = tmp_path / "eff.json"
    assert main(["serve", "--dry-run", "--device", "cpu",
                 "--effective-config-json", str(eff_path)]) == 0
    eff = json.loads(eff_path.read_text())["settings"]
    assert eff["quantization"]["value"] == "int4" and eff["quantization"]["source"] == "auto"
    assert "Q4_1" in eff["quantization"]["reason"]
    assert eff["dense_weights"]["value"] is True and eff["dense_weights"]["source"] == "auto"
    assert main(["serve", "--dry-run", "--device", "cpu", "--quantization", "none",
                 "--effective-config-json", str(eff_path)]) == 0
    eff = json.loads(eff_path.read_text())["settings"]
    assert eff["quantization"]["value"] == "none"
    assert eff["dense_weights"]["value"] is False  # nothing is quantized
    assert main(["serve", "--dry-run", "--engine", "vllm",
                 "--effective-config-json", str(eff_path)]) == 0
    assert json.loads(eff_path.read_text())["settings"]["quantization"]["value"] == "none"
    capsys.readouterr()


def _corrupt_model(tmp_path):
    folder = tmp_path / "TinyLlama-corrupt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256}))
    (folder / "model.safetensors").write_bytes(b"\x00garbage, not safetensors" * 10)
    return folder


def test_dry_run_never_reads_weights(tmp_path, capsys):
    folder = _corrupt_model(tmp_path)
    assert main(["serve", str(folder), "--dry-run"]) == 0
    assert "TinyLlama-corrupt" in capsys.readouterr().out


def test_corrupt_weights_write_failed_artifacts(tmp_path, capsys):
    folder = _corrupt_model(tmp_path)
    eff, trace = tmp_path / "eff.json", tmp_path / "trace.jsonl"
    rc = main(["serve", str(folder), "--effective-config-json", str(eff),
               "--decision-trace-jsonl", str(trace), "--port", "1"])
    assert rc != 0
    data = json.loads(eff.read_text())
    assert data["status"] == "failed" and data["phase"] == "load"
    assert data["error"]["message"] and data["error"]["code"] == "load.tokenizer_failed"
    last = json.loads(trace.read_text().splitlines()[-1])
    assert last["status"] == "failed" and last["phase"] == "load"
    assert last["error_code"] == "load.tokenizer_failed"
    assert "error" in capsys.readouterr().err


def test_device_cuda_fails_closed_before_model_work(tmp_path, capsys):
    folder = _corrupt_model(tmp_path)
    eff = tmp_path / "eff.json"
    rc = main(["serve", str(folder), "--device", "cuda", "--effective-config-json", str(eff)])
    assert rc != 0
    err = capsys.readouterr().err
    assert "--device cpu" in err  # the way out, printed
    data = json.loads(eff.read_text())
    assert data["phase"] == "device" and data["error"]["code"] == "device.no_cuda"


def test_env_and_config_file_sources(tmp_path, monkeypatch):
    cfg = tmp_path / "kiln.toml"
    cfg.write_text('max_num_batched_tokens = 256\nkv-cache-dtype = "int8"\n')
    monkeypatch.setenv("KILN_MAX_NUM_SEQS", "5")
    eff = tmp_path / "eff.json"
    assert main(["serve", "--dry-run", "--config", str(cfg), "--effective-config-json",
                 str(eff)]) == 0
    s = json.loads(eff.read_text())["settings"]
    assert (s["max_num_seqs"]["value"], s["max_num_seqs"]["source"]) == (5, "env")
    assert (s["max_num_batched_tokens"]["value"], s["max_num_batched_tokens"]["source"]) == \
        (256, "file")
    assert s["kv_cache_dtype"]["source"] == "file"


def test_unknown_config_key_and_preset_are_errors(tmp_path, capsys):
    cfg = tmp_path / "kiln.toml"
    cfg.write_text("max_num_seq = 3\n")
    assert main(["serve", "--dry-run", "--config", str(cfg)]) != 0
    assert "max_num_seq" in capsys.readouterr().err
    assert main(["serve", "--dry-run", "--runtime-preset", "warp-speed"]) != 0
    err = capsys.readouterr().err
    assert "warp-speed" in err and "cpu-small" in err


def test_preset_is_inferred_and_yields_to_cli(tmp_path):
    eff = tmp_path / "eff.json"
    assert main(["serve", "--dry-run", "--max-num-seqs", "3", "--effective-config-json",
                 str(eff)]) == 0
    data = json.loads(eff.read_text())
    assert data["preset"]["name"] == "cpu-small"
    assert data["settings"]["runtime_preset"]["source"] == "auto"
    assert data["settings"]["max_num_seqs"]["source"] == "cli"
    assert data["settings"]["max_num_batched_tokens"]["source"] == "preset"


def _dry_run(tmp_path, capsys, *argv: str) -> tuple[int, dict, str]:
    """`kiln serve --dry-run ...`: exit code, effective config, stderr."""
    eff = tmp_path / "eff.json"
    rc = main(["serve", "--dry-run", *argv, "--effective-config-json", str(eff)])
    return rc, json.loads(eff.read_text()), capsys.readouterr().err


def test_kiln_engine_rejects_multi_gpu_settings(tmp_path, capsys):
    rc, eff, err = _dry_run(tmp_path, capsys, "--tensor-parallel-size", "2")
    assert rc != 0 and eff["error"]["code"] == "startup.one_device"
    assert "--engine vllm" in err  # the way out, printed


def test_kiln_engine_rejects_settings_only_external_engines_honour(tmp_path, capsys):
    rc, eff, err = _dry_run(tmp_path, capsys, "--dist-init-addr", "10.0.0.1:5000")
    assert rc != 0 and eff["error"]["code"] == "startup.not_on_kiln"
    assert "--dist-init-addr" in err and "--engine vllm" in err and "--engine sglang" in err
    # LoRA adapters are kiln's too now: the folder is checked instead
    rc, eff, err = _dry_run(tmp_path, capsys, "--lora-modules", "a=/nonexistent/a")
    assert rc != 0 and eff["error"]["code"] == "lora.file_missing"
    assert "/nonexistent/a" in err
    # kiln's engine splits experts too; on a dense model there is nothing to split: a warning.
    rc, eff, _ = _dry_run(tmp_path, capsys, "--cpu-offload-experts")
    assert rc == 0
    (w,) = [w for w in eff["warnings"] if w["code"] == "startup.offload_dense"]
    assert "--cpu-offload-experts (cli)" in w["message"] and "smollm2" in w["message"]


def test_dry_run_of_a_moe_shows_its_experts_and_the_active_params_preset(tmp_path, capsys):
    """An MoE folder kiln has no registry entry for: the experts come from its config, and the
    preset's reason gives total and active parameters (a tiny model: cpu-small on a machine
    without a GPU, gpu-single with one)."""
    from conftest import make_tiny_model

    moe = make_tiny_model("qwen3_moe", tmp_path / "qwen3_moe")
    capsys.readouterr()
    eff_path = tmp_path / "eff.json"
    assert main(["serve", "--dry-run", str(moe), "--device", "cpu",
                 "--effective-config-json", str(eff_path)]) == 0
    text = capsys.readouterr().out
    assert msg("dry.experts", experts=8, moe_layers=2, layers=3, active=2, shared="") in text
    eff = json.loads(eff_path.read_text())
    assert (eff["preset"]["name"], eff["preset"]["code"]) in (
        ("cpu-small", "preset.moe_small_active"), ("gpu-single", "preset.fits_one_gpu"))
    assert eff["settings"]["runtime_preset"]["code"] == eff["preset"]["code"]
    assert "B total (" in eff["preset"]["reason"]
    assert "B active (8 experts, 2 per token)" in eff["preset"]["reason"]
