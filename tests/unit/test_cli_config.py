"""`kiln config set|get|show|path` on a config file of the test's own."""

from __future__ import annotations

import pytest

from kiln.cli.main import main
from kiln.errors import ConfigError
from kiln.i18n import msg
from kiln.settings.table import setting


def test_config_set_then_get_reports_the_file_as_source(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KILN_MAX_NUM_SEQS", raising=False)
    cfg = tmp_path / "config.toml"
    assert main(["config", "--config", str(cfg), "set", "max-num-seqs", "12"]) == 0
    assert "max_num_seqs = 12" in cfg.read_text()
    capsys.readouterr()
    assert main(["config", "--config", str(cfg), "get", "max_num_seqs"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("12") and "[file]" in out
    assert main(["config", "--config", str(cfg), "path"]) == 0
    assert str(cfg) in capsys.readouterr().out


def test_config_set_rejects_bad_values_and_unknown_keys(tmp_path, capsys):
    cfg = tmp_path / "config.toml"
    assert main(["config", "--config", str(cfg), "set", "kv_cache_dtype", "int3"]) != 0
    err = capsys.readouterr().err
    assert "'int3'" in err and "int8" in err  # the value refused, the ones it takes
    assert main(["config", "--config", str(cfg), "set", "warp_factor", "9"]) != 0
    assert "'warp_factor'" in capsys.readouterr().err
    with pytest.raises(ConfigError) as e:
        setting("warp_factor")
    assert e.value.code == "config.unknown_setting"
    assert not cfg.exists()


def test_config_commands_use_KILN_CONFIG_as_serve_does(tmp_path, capsys, monkeypatch, gguf_path):
    import json

    monkeypatch.delenv("KILN_MAX_NUM_SEQS", raising=False)
    cfg = tmp_path / "other.toml"
    monkeypatch.setenv("KILN_CONFIG", str(cfg))
    assert main(["config", "set", "max-num-seqs", "12"]) == 0
    assert "max_num_seqs = 12" in cfg.read_text()
    capsys.readouterr()
    assert main(["config", "path"]) == 0
    assert capsys.readouterr().out.strip() == str(cfg)
    assert main(["config", "get", "max_num_seqs"]) == 0
    assert "[file]" in capsys.readouterr().out
    eff = tmp_path / "eff.json"
    assert main(["serve", str(gguf_path), "--dry-run", "--effective-config-json", str(eff)]) == 0
    assert json.loads(eff.read_text())["settings"]["max_num_seqs"]["source"] == "file"


def test_model_key_in_the_config_file_is_the_model_to_serve(tmp_path, capsys, monkeypatch,
                                                            gguf_path):
    import json

    monkeypatch.delenv("KILN_MODEL", raising=False)
    cfg = tmp_path / "config.toml"
    assert main(["config", "--config", str(cfg), "set", "model", str(gguf_path)]) == 0
    eff = tmp_path / "eff.json"
    assert main(["serve", "--config", str(cfg), "--dry-run", "--effective-config-json",
                 str(eff)]) == 0
    got = json.loads(eff.read_text())
    assert got["settings"]["model"]["source"] == "file"
    assert got["model"]["gguf_file"] == str(gguf_path)
    # MODEL on the command line beats the file's.
    assert main(["serve", "smollm2", "--config", str(cfg), "--dry-run",
                 "--effective-config-json", str(eff)]) == 0
    got = json.loads(eff.read_text())
    assert got["settings"]["model"] == {"value": "smollm2", "source": "cli",
                                        "affects": "correctness", "reason": "set by MODEL"}


def test_config_get_of_an_auto_setting_says_serve_decides_it(tmp_path, capsys, monkeypatch):
    """dtype's rule reads the model and the hardware, which `kiln config` does not load: get
    says so (as show does) instead of printing the rule's answer for no model on no CPU (once
    "float32, CPU has no native bf16" on a CPU with AVX512-BF16)."""
    monkeypatch.delenv("KILN_DTYPE", raising=False)
    cfg = tmp_path / "config.toml"
    assert main(["config", "--config", str(cfg), "get", "dtype"]) == 0
    assert capsys.readouterr().out == (f"{msg('config.decided_at_serve')}\t[auto] "
                                       f"{msg('config.decided_at_serve.hint')}\n")
    assert main(["config", "--config", str(cfg), "set", "dtype", "bfloat16"]) == 0
    capsys.readouterr()
    assert main(["config", "--config", str(cfg), "get", "dtype"]) == 0
    assert capsys.readouterr().out.startswith("bfloat16\t[file] ")
