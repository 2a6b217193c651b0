"""`kiln doctor`, `kiln list` and `kiln pull` through their argparse entry points."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pytest

from kiln.cli import doctor, list_models, pull
from kiln.i18n import msg
from kiln.resolve.sources import default_model_path


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kiln")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (doctor, list_models, pull):
        module.add_parser(sub)
    return parser.parse_args(list(argv))


def run(*argv: str) -> int:
    args = parse(*argv)
    return int(args.func(args))


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh HOME (default model dirs) and HF cache per test; no offline flag leaking in."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("KILN_MODEL_DIRS", raising=False)
    return tmp_path


def cache_repo(cache: Path, repo_id: str, files: dict[str, bytes]) -> None:
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / ("d" * 40)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(name.encode()).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("d" * 40)


def test_subcommands_register_func() -> None:
    for argv in (["doctor"], ["list"], ["pull", "smollm2"]):
        args = parse(*argv)
        assert args.func.__module__.startswith("kiln.cli.")


def test_doctor_prints_one_status_per_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("doctor") == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.strip() and not line.startswith(" ")]
    names = (
        "cpu",
        "memory",
        "pytorch",
        "gpu",
        "engine vllm",
        "engine sglang",
        "hf cache",
        "default model",
    )
    for name in names:
        assert any(name in line for line in lines), name
    assert all(line.split()[0] in ("OK", "WARN") for line in lines[:-1])  # last: summary
    assert str(default_model_path()) in out
    assert out.rstrip().endswith("WARN")  # the "N OK, M WARN" summary


def test_doctor_json_warns_with_a_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-dir"
    assert run("doctor", "--json", "--model-dir", str(missing)) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"]["logical_cores"] >= 1
    assert all(c["status"] in ("OK", "WARN") for c in data["checks"])
    assert all(c["fix"] for c in data["checks"] if c["status"] == "WARN")
    bad = [c for c in data["checks"] if str(missing) in c["detail"]]
    assert bad and bad[0]["status"] == "WARN" and f"mkdir -p {missing}" in bad[0]["fix"]
    assert bad[0]["code"] == "doctor.model_dir_missing"
    assert {"path": str(missing), "origin": "flag", "exists": False, "models": 0} in data[
        "model_dirs"
    ]
    assert run("doctor", "--strict", "--model-dir", str(missing)) == 1


def test_list_shows_embedded_cache_and_folder_models(
    isolated: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache_repo(isolated / "hub", "acme/tiny-GGUF", {"tiny-Q4_K_M.gguf": b"GGUF" * 10})
    models = isolated / "models"
    (models / "my-model").mkdir(parents=True)
    (models / "my-model" / "config.json").write_text("{}")
    (models / "my-model" / "model.safetensors").write_bytes(b"\0" * 3)

    assert run("list", "--model-dir", str(models)) == 0
    out = capsys.readouterr().out
    header, *rows = out.splitlines()
    assert header.split() == ["NAME", "SIZE", "FORMAT", "QUANT", "SERVES", "SOURCE", "PATH"]
    by_name = {r.split()[0]: r.split() for r in rows}
    assert by_name["smollm2"][1:7] == ["94", "MiB", "gguf", "Q4_1", "generate", "embedded"]
    assert "hf-cache" in by_name["acme/tiny-GGUF:Q4_K_M"]
    assert "folder" in by_name["my-model"] and "safetensors" in by_name["my-model"]

    assert run("list", "--json", "--model-dir", str(models)) == 0
    data = json.loads(capsys.readouterr().out)
    # (+ "package": models installed with their PyPI packages, the audio ones, where present)
    assert {m["source"] for m in data} - {"package"} == {"embedded", "hf-cache", "folder"}
    mine = next(m for m in data if m["name"] == "my-model")
    assert mine["size_bytes"] == 3 and mine["format"] == "safetensors"


def test_list_registry(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("list", "--registry") == 0
    out = capsys.readouterr().out
    assert "smollm2" in out and "HuggingFaceTB/SmolLM2-135M-Instruct" in out
    assert "deepseek-v3" in out
    # MoE rows: total and active parameters, routed experts and how many a token uses.
    qwen = next(line for line in out.splitlines() if line.startswith("qwen3-30b-a3b "))
    assert "30.5B (3.3B active)" in qwen and "128 experts, 8 per token" in qwen
    deepseek = next(line for line in out.splitlines() if line.startswith("deepseek-v3 "))
    assert "256 experts, 8 per token + 1 shared" in deepseek


def test_pull_embedded_prints_where_it_is(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("pull", "smollm2") == 0
    out = capsys.readouterr().out
    assert msg("pull.origin.embedded") in out and str(default_model_path()) in out


def test_pull_cached_repo_does_not_download(
    isolated: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("tried to use the network")

    monkeypatch.setattr(huggingface_hub, "list_repo_files", boom)
    cache_repo(isolated / "hub", "acme/tiny-GGUF", {"tiny-Q4_K_M.gguf": b"GGUF"})
    assert run("pull", "acme/tiny-GGUF:Q4_K_M", "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["origin"] == "hf-cache" and data["quant"] == "Q4_K_M"


def test_pull_offline_missing_model_fails_with_a_hint(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert run("pull", "acme/not-here", "--json") == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["error"]["code"] == "model.not_cached"
    # what a person reads: the offline notice, why the model is not found, and the way out
    assert msg("pull.offline") in err and msg("model.offline_on") in err and "hint:" in err


def test_a_listing_into_a_reader_that_left_ends_without_a_traceback() -> None:
    """`kiln list --registry | head -3`: head exits after three lines; kiln's next write meets a
    closed pipe and ends quietly with SIGPIPE's status, as a C tool would."""
    import subprocess
    import sys

    # The read end closed before kiln writes: every write meets EPIPE (SIGPIPE ignored, as
    # Python does), whatever the pipe's buffer size.
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli.main", "list", "--registry"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err
