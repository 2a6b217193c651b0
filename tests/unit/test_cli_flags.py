"""Flags that never silently mean something else: no prefix matching, -p is the port, the
--tp / --kv-dtype aliases, -m/--model equal to MODEL, the device refused before the model is
looked up, and an unwritable artifact as one warning line after the real error."""

from __future__ import annotations

import json

import pytest

from kiln.cli.main import build_parser, main
from kiln.i18n import msg


def _settings(tmp_path, *argv: str) -> dict:
    eff = tmp_path / "eff.json"
    assert main(["serve", "--dry-run", "--effective-config-json", str(eff), *argv]) == 0
    return json.loads(eff.read_text())["settings"]


def test_a_prefix_of_a_flag_is_not_that_flag(capsys):
    # `--model-d` once matched `--model-dir`; `--mod foo` matched it too.
    for argv in (["serve", "--model-d", "x"], ["serve", "--mod", "foo"],
                 ["serve", "--max-num-seq", "4"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert argv[1] in capsys.readouterr().err  # named as a flag kiln does not have


def test_every_parser_refuses_abbreviations():
    root = build_parser()
    stack = [root]
    while stack:
        p = stack.pop()
        assert p.allow_abbrev is False, p.prog
        for action in p._actions:
            stack.extend(getattr(action, "choices", None) and isinstance(action.choices, dict)
                         and action.choices.values() or [])


def _failed(tmp_path, capsys, *argv: str) -> tuple[str | None, str]:
    """`kiln serve --dry-run ...`, which must fail: its effective config's error code and its
    stderr."""
    eff = tmp_path / "eff.json"
    assert main(["serve", *argv, "--dry-run", "--effective-config-json", str(eff)]) != 0
    return json.loads(eff.read_text())["error"]["code"], capsys.readouterr().err


def test_model_option_is_the_model_and_an_unknown_one_is_named(tmp_path, capsys):
    code, err = _failed(tmp_path, capsys, "--model", "foo")
    assert code == "model.unknown" and "'foo'" in err
    assert "--model-dir" not in err


def test_model_option_and_positional_must_agree(tmp_path, capsys, gguf_path):
    s = _settings(tmp_path, "-m", str(gguf_path))
    assert s["port"]["value"] == 8000
    assert main(["serve", str(gguf_path), "--model", str(gguf_path), "--dry-run"]) == 0
    capsys.readouterr()
    code, err = _failed(tmp_path, capsys, str(gguf_path), "--model", "other")
    assert code == "config.two_models" and "other" in err


def test_short_p_is_the_port_and_pp_stays_pipeline_parallel(tmp_path, gguf_path):
    s = _settings(tmp_path, str(gguf_path), "-p", "9000")
    assert (s["port"]["value"], s["pipeline_parallel_size"]["value"]) == (9000, 1)
    from kiln.settings import sources as S

    seen = S.cli_values(build_parser().parse_args(["serve", "-pp", "2", "-p", "9001"]))
    assert seen["port"] == ("9001", "-p") and seen["pipeline_parallel_size"] == ("2", "-pp")


def test_tp_and_kv_dtype_aliases(tmp_path, gguf_path):
    s = _settings(tmp_path, str(gguf_path), "--kv-dtype", "int8")
    assert (s["kv_cache_dtype"]["value"], s["kv_cache_dtype"]["source"]) == ("int8", "cli")
    from kiln.settings import sources as S
    from kiln.settings.table import BY_NAME

    assert "--tp" in BY_NAME["tensor_parallel_size"].flags
    ns = build_parser().parse_args(["serve", "--tp", "2"])
    assert S.cli_values(ns)["tensor_parallel_size"] == ("2", "--tp")


def test_device_is_refused_before_the_model_is_looked_up(tmp_path, capsys, monkeypatch):
    import torch

    from kiln.resolve import sources

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: --device cuda is usable")

    def never(*a, **k):
        raise AssertionError("the model was resolved before the device was checked")

    monkeypatch.setattr(sources, "resolve_model", never)
    eff = tmp_path / "eff.json"
    rc = main(["serve", "--model", "owner/not-here", "--device", "cuda",
               "--effective-config-json", str(eff)])
    assert rc != 0
    assert "error (device)" in capsys.readouterr().err
    assert json.loads(eff.read_text())["phase"] == "device"


def test_an_unwritable_artifact_is_a_warning_line_after_the_real_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    eff = blocker / "eff.json"  # its parent is a file: cannot be created
    rc = main(["serve", "--model", "foo", "--dry-run", "--effective-config-json", str(eff)])
    assert rc != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(lines)
    assert "'foo'" in lines[0]  # the real error (the model not found) comes first
    assert lines[-1].startswith("kiln: warning: --effective-config-json") and str(eff) in lines[-1]


def test_served_model_name_is_repeatable_and_defaults_to_the_name_and_canonical_ids(tmp_path):
    s = _settings(tmp_path, "smollm2", "--served-model-name", "a", "--served-model-name", "b,c")
    assert s["served_model_name"]["value"] == ["a", "b", "c"]
    assert s["served_model_name"]["source"] == "cli"
    s = _settings(tmp_path, "smollm2")
    assert s["served_model_name"]["value"] == ["smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert s["served_model_name"]["code"] == "served_model_name.with_aliases"


def test_help_names_kilns_engine_as_the_default(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "which engine runs the model (default: kiln)" in out


def test_an_unwritable_artifact_in_a_dry_run_is_one_error_line_that_names_the_flag(
        tmp_path, capsys, gguf_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    eff = blocker / "eff.json"
    rc = main(["serve", str(gguf_path), "--dry-run", "--effective-config-json", str(eff)])
    assert rc != 0
    err = capsys.readouterr().err
    # kiln's own error frame (not cli.unexpected_error's), in the artifacts phase
    assert err.startswith(msg("cli.error", phase="artifacts", error="")) and "Traceback" not in err
    assert f"--effective-config-json {eff}" in err


def test_kiln_run_on_a_base_model_runs_the_prompt_as_a_completion(tmp_path, capsys):
    from conftest import add_word_tokenizer, make_tiny_model

    folder = make_tiny_model("llama", tmp_path / "base")
    add_word_tokenizer(folder)
    rc = main(["run", str(folder), "--temperature", "0", "--max-tokens", "4",
               "--kv-cache-memory", "8MiB", "the cat sat"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert msg("run.no_template", name="base") in err and "Traceback" not in err
    assert out.strip()  # the completion's tokens


def test_ferrums_greedy_argmax_and_tts_slots_are_settings_kiln_says_what_it_does_with(
        tmp_path, monkeypatch):
    """ferrum's --greedy-argmax is kiln's only greedy path (on, from the table); its
    --disable-greedy-argmax is recorded and answered, not obeyed; --tts-slots is a setting
    (env and config key too) that a model which does not speak says it ignores."""
    s = _settings(tmp_path, "smollm2", "--greedy-argmax")
    assert s["greedy_argmax"] == {"value": True, "source": "cli", "affects": "performance",
                                  "reason": "set by --greedy-argmax"}
    eff = tmp_path / "eff.json"
    assert main(["serve", "smollm2", "--dry-run", "--disable-greedy-argmax",
                 "--effective-config-json", str(eff)]) == 0
    got = json.loads(eff.read_text())
    assert got["settings"]["greedy_argmax"]["value"] is True
    assert got["settings"]["greedy_argmax"]["code"] == "greedy_argmax.one_greedy_path"
    (w,) = [w for w in got["warnings"] if w["code"] == "startup.greedy_argmax_kept"]
    assert "--disable-greedy-argmax (cli)" in w["message"]  # the flag and where it came from
    monkeypatch.setenv("KILN_TTS_SLOTS", "3")
    assert main(["serve", "smollm2", "--dry-run", "--effective-config-json", str(eff)]) == 0
    got = json.loads(eff.read_text())
    assert got["settings"]["tts_slots"] == {"value": 3, "source": "env",
                                            "affects": "performance",
                                            "reason": "set by KILN_TTS_SLOTS"}
    (w,) = [w for w in got["warnings"] if w["code"] == "startup.tts_slots_not_speech"]
    assert "--tts-slots 3 (env)" in w["message"]
    assert all(w["code"] for w in got["warnings"])  # every warning comes with its code

