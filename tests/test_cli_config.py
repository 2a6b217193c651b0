"""`kiln config set|get|show|path` on a config file of the test's own."""

from __future__ import annotations

from kiln.cli.main import main


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
    assert "choose one of" in capsys.readouterr().err
    assert main(["config", "--config", str(cfg), "set", "warp_factor", "9"]) != 0
    assert "unknown setting" in capsys.readouterr().err
    assert not cfg.exists()
