"""Messages in English and Chinese: the catalogue is complete, --lang / KILN_LANG / the locale
pick the language, the CLI speaks it, and what machines read stays English."""

from __future__ import annotations

import io
import json
import re
import string
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln import i18n as M
from kiln.cli.main import main as kiln
from kiln.errors import DeviceError, ModelNotFoundError

CJK = re.compile(r"[\u4e00-\u9fff]")
LOCALE_VARS = ("KILN_LANG", "LC_ALL", "LC_MESSAGES", "LANG")


@pytest.fixture(autouse=True)
def english_after(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No language or locale leaking in from the machine, none leaking out to other tests."""
    for var in LOCALE_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("KILN_CONFIG", raising=False)
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    M.set_lang("en")
    yield
    M.set_lang("en")


def fields(text: str) -> set[tuple[str, str | None, str | None]]:
    """Each {field} with its conversion and format spec: `{timeout:g}` in one language and
    `{timeout}` in the other would print the same number two ways."""
    return {(name, conversion, spec)
            for _, name, spec, conversion in string.Formatter().parse(text) if name is not None}


# --- the catalogue ----------------------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(M.CATALOGUE))
def test_every_message_has_both_languages_with_the_same_fields(key: str) -> None:
    entry = M.CATALOGUE[key]
    # A header written without quotes, [device.no_cuda], nests tables: key "device".
    assert set(entry) == set(M.LANGS), f'catalogue.toml: write the key quoted, ["{key}..."]'
    assert all(isinstance(entry[lang], str) and entry[lang].strip() for lang in M.LANGS)
    assert entry["zh"] != entry["en"], "the Chinese text is a copy of the English"
    assert fields(entry["zh"]) == fields(entry["en"])


def test_every_key_the_code_looks_up_is_in_the_catalogue() -> None:
    root = Path(M.__file__).parents[1]  # kiln/
    used = {k for p in root.rglob("*.py")
            for k in re.findall(r"""\bmsg\(\s*["']([\w.]+)["']""", p.read_text())}
    assert used, "no msg() calls found"
    assert used - set(M.CATALOGUE) == set()


def test_every_catalogue_entry_is_used() -> None:
    """A key the code no longer names is dead text that translators still keep. Used: its name
    appears as a string in kiln/, or it belongs to a family an f-string builds
    (`f"pull.origin.{src.origin}"` names every `pull.origin.*`)."""
    root = Path(M.__file__).parents[1]  # kiln/
    code = [p.read_text() for p in root.rglob("*.py")]
    strings = {s for text in code for s in re.findall(r"""["']([\w.-]+)["']""", text)}
    families = {f for text in code for f in re.findall(r"""\bf["']([\w.]+\.)\{""", text)}
    assert "pull.origin." in families, families  # the f-string family the docstring names
    unused = sorted(k for k in M.CATALOGUE
                    if k not in strings and not any(k.startswith(f) for f in families))
    assert unused == [], f"catalogue keys nothing in kiln/ names (delete them): {unused}"


def test_a_message_prints_in_the_language_and_keeps_its_english() -> None:
    M.set_lang("zh")
    m = M.msg("device.no_cuda", requested="cuda")
    assert m == "--device cuda：未找到 CUDA GPU"
    assert M.english(m) == "--device cuda: no CUDA GPU found"
    nested = M.msg("cli.warning", warning=M.msg("startup.gpu_experts_unsized"))
    assert CJK.search(nested) and not CJK.search(M.english(nested))
    assert M.english(M.msg("dry.ram", available=1.25, total=2.0)).endswith("1.2 GiB available "
                                                                            "of 2.0 GiB")


def test_a_catalogued_error_reads_in_the_language_and_records_in_english() -> None:
    M.set_lang("zh")
    err = DeviceError(M.msg("device.no_cuda", requested="cuda"), hint=M.msg("device.cuda_fix"))
    assert "提示：" in str(err) and "未找到 CUDA GPU" in str(err)
    assert err.english().startswith("--device cuda: no CUDA GPU found\n  hint: install a CUDA")
    M.set_lang("en")
    assert str(DeviceError("plain", hint="do this")) == "plain\n  hint: do this"


# --- choosing the language --------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "env", "lang"), [
    ([], {}, "en"),
    (["serve", "--lang", "zh"], {}, "zh"),
    (["doctor", "--lang=zh"], {"KILN_LANG": "en"}, "zh"),
    (["doctor", "--lang", "en"], {"LANG": "zh_CN.UTF-8"}, "en"),
    ([], {"KILN_LANG": "zh"}, "zh"),
    ([], {"LANG": "zh_CN.UTF-8"}, "zh"),
    ([], {"LC_MESSAGES": "zh_TW.UTF-8", "LANG": "en_US.UTF-8"}, "zh"),
    ([], {"LC_ALL": "C", "LANG": "zh_CN.UTF-8"}, "en"),  # LC_ALL wins, as POSIX says
    (["serve", "--lang", "fr"], {"KILN_LANG": "zh"}, "zh"),  # not a language: argparse says so
])
def test_lang_comes_from_the_flag_then_kiln_lang_then_the_locale(
        argv: list[str], env: dict[str, str], lang: str) -> None:
    assert M.detect_lang(argv, env) == lang


# --- the CLI in Chinese -----------------------------------------------------------------------


def test_doctor_lang_zh_prints_chinese(capsys: pytest.CaptureFixture[str]) -> None:
    assert kiln(["doctor", "--lang", "zh"]) == 0
    out = capsys.readouterr().out
    assert "项正常" in out and "个物理核心" in out
    # check names and OK/WARN stay for scripts
    assert re.search(r"^OK +cpu ", out, re.MULTILINE)


def test_doctor_json_stays_english_in_chinese(capsys: pytest.CaptureFixture[str]) -> None:
    assert kiln(["doctor", "--lang", "zh", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    text = json.dumps(data, ensure_ascii=False)
    assert not CJK.search(text)
    assert any("physical" in c["detail"] for c in data["checks"])


def test_failing_serve_lang_zh_prints_a_chinese_error_and_hint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ec = tmp_path / "effective.json"
    rc = kiln(["serve", str(tmp_path / "missing.gguf"), "--lang", "zh", "--dry-run",
               "--effective-config-json", str(ec)])
    err = capsys.readouterr().err
    assert rc != 0
    assert "kiln: 错误（model）：文件或目录不存在" in err
    assert "\n  提示：请检查路径" in err
    # What machines read stays English.
    recorded = json.loads(ec.read_text())
    assert recorded["status"] == "failed"
    assert recorded["error"]["message"].startswith("no such file or folder:")


def test_failing_device_check_in_chinese_records_lang_with_its_source(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ec = tmp_path / "effective.json"
    rc = kiln(["serve", "--lang", "zh", "--device", "npu", "--dry-run",
               "--effective-config-json", str(ec)])
    err = capsys.readouterr().err
    assert rc != 0
    assert "kiln: 错误（device）：未知设备 'npu'" in err and "提示：请使用 --device" in err
    recorded = json.loads(ec.read_text())
    assert recorded["settings"]["lang"] == {"value": "zh", "source": "cli",
                                            "affects": "observability",
                                            "reason": "set by --lang"}
    assert recorded["error"]["message"].startswith("unknown device 'npu'\n  hint: use --device")


@pytest.mark.parametrize("env", [{"KILN_LANG": "zh"}, {"LANG": "zh_CN.UTF-8"}])
def test_kiln_lang_and_a_chinese_locale_select_chinese(
        env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert kiln(["serve", "--device", "npu", "--dry-run"]) != 0
    assert "未知设备" in capsys.readouterr().err


def test_the_config_file_can_set_the_language(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "kiln.toml"
    cfg.write_text('lang = "zh"\ndevice = "npu"\n')
    assert kiln(["serve", "--config", str(cfg), "--dry-run"]) != 0
    assert "未知设备" in capsys.readouterr().err


def test_default_stays_english(capsys: pytest.CaptureFixture[str]) -> None:
    assert kiln(["serve", "--device", "npu", "--dry-run"]) != 0
    err = capsys.readouterr().err
    assert "kiln: error (device): unknown device 'npu'\n  hint: use --device" in err
    assert not CJK.search(err)


def test_dry_run_summary_in_chinese(capsys: pytest.CaptureFixture[str]) -> None:
    assert kiln(["serve", "--lang", "zh", "--dry-run", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("硬件：\n")
    assert "\n模型：\n" in out and "设置（非默认值及其来源）：" in out
    assert re.search(r"^  lang +\s*= zh +\[cli\]", out, re.MULTILINE)


# --- the interactive model picker -------------------------------------------------------------


def test_the_model_picker_can_be_cancelled(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from kiln.resolve.sources import resolve_model

    M.set_lang("zh")
    monkeypatch.setattr(sys, "stdin", io.StringIO("0\n"))
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model(None, interactive=True, offline=True)
    menu = capsys.readouterr().err
    assert menu.startswith("未指定 MODEL，请选择一个：") and "   0. 取消\n" in menu
    assert "已取消" in str(err.value) and err.value.english().startswith(
        "no model picked (cancelled)")
