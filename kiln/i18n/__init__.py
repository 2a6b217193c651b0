"""kiln's human-facing text in English and Chinese: one catalogue (the data file
kiln/i18n/catalogue.toml, read by catalogue.py), one lookup (here).

    msg("device.no_cuda", requested="cuda")  ->  "--device cuda: no CUDA GPU found"
                                                  "--device cuda：未找到 CUDA GPU"      (lang zh)

The language is chosen once, early in the CLI (`--lang`, else `KILN_LANG`, else the locale:
LC_ALL > LC_MESSAGES > LANG starting with "zh"), before settings resolution can fail, so its
errors are already in that language. `lang` is also a row of the settings table, so the effective
config records where it came from; a config-file value takes over once the settings resolve.

A `CatalogueText` is a str in the current language that keeps its English rendering in `.en`:
what people read (errors, hints, warnings, --dry-run, doctor) prints it as it is; what machines read
(effective-config and doctor JSON, the decision trace, log lines, OpenAI error bodies) takes
`english(text)`, so it stays the same whatever the language.

Technical terms (GPU, KV cache, GGUF, flags, setting names) stay untranslated in Chinese, as in
kt-cli. Every key has both languages with the same {fields} (tests/unit/test_i18n.py checks).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Self

from kiln.i18n.catalogue import CATALOGUE

LANGS = ("en", "zh")

_lang = "en"


def set_lang(lang: str | None) -> None:
    global _lang
    _lang = lang if lang in LANGS else "en"


def get_lang() -> str:
    return _lang


def lang_from_locale(environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """(lang, "VAR=value") from the POSIX locale variables, first set one wins; None if unset."""
    environ = os.environ if environ is None else environ
    for var in ("LC_ALL", "LC_MESSAGES", "LANG"):
        value = environ.get(var)
        if value:
            return ("zh" if value.lower().startswith("zh") else "en"), f"{var}={value}"
    return None


def detect_lang(argv: Sequence[str] = (), environ: Mapping[str, str] | None = None) -> str:
    """The CLI's language before argparse and the settings table run: --lang, KILN_LANG, the
    locale, English. A value that is not a language is skipped here; the table rejects it
    later with a proper error (in the language found so far)."""
    environ = os.environ if environ is None else environ
    asked: str | None = None
    for i, arg in enumerate(argv):
        if arg == "--lang" and i + 1 < len(argv):
            asked = argv[i + 1]
        elif arg.startswith("--lang="):
            asked = arg.split("=", 1)[1]
    for value in (asked, environ.get("KILN_LANG")):
        if value in LANGS:
            return value
    found = lang_from_locale(environ)
    return found[0] if found else "en"


class CatalogueText(str):
    """A catalogue message rendered in the language current at creation; `.en` is its English
    rendering, `.key` and `.fields` what it was made from."""

    key: str
    fields: dict[str, Any]
    en: str

    def __new__(cls, key: str, fields: dict[str, Any]) -> Self:
        entry = CATALOGUE[key]
        obj = super().__new__(cls, entry[_lang].format(**fields))
        obj.key, obj.fields = key, fields
        obj.en = entry["en"].format(**{k: _english_field(v) for k, v in fields.items()})
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        # copy/pickle keep the text as rendered (not re-rendered in a later language).
        return _rebuild, (type(self), str.__str__(self), self.en,
                          {"key": self.key, "fields": self.fields})


def msg(key: str, /, **fields: Any) -> CatalogueText:
    """The catalogue's text for `key` in the current language, {fields} filled in."""
    return CatalogueText(key, fields)


def _english_field(value: Any) -> Any:
    """A field for the English rendering: text in English, numbers as they are (for {x:.1f})."""
    if isinstance(value, (CatalogueText, Joined)) or callable(getattr(value, "english", None)):
        return english(value)
    return value


class Joined(str):
    """Messages (and plain text) joined: the current language's text, `.en` the English one."""

    en: str

    def __new__(cls, parts: Sequence[Any], sep: str = "") -> Self:
        obj = super().__new__(cls, sep.join(map(str, parts)))
        obj.en = sep.join(english(p) for p in parts)
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), str.__str__(self), self.en, {})


def _rebuild(cls: type[str], text: str, en: str, attrs: dict[str, Any]) -> Any:
    obj = str.__new__(cls, text)
    obj.en = en  # type: ignore[attr-defined]
    for name, value in attrs.items():
        setattr(obj, name, value)
    return obj


def join(parts: Sequence[Any], sep: str = "") -> Self:
    """`sep.join(parts)` that keeps the English rendering for what machines read."""
    return Joined(parts, sep)


def coded(text: Any) -> dict[str, Any]:
    """What machines read of a warning: `{"code", "message"}`, the code the catalogue key (what
    a program or a test matches, the same in every language; None for plain text), the message
    English. The same pair an effective config's error carries."""
    return {"code": getattr(text, "key", None), "message": english(text)}


def english(text: Any) -> str:
    """What machines read: a CatalogueText's English rendering, a KilnError's `english()`,
    anything else as str()."""
    if isinstance(text, (CatalogueText, Joined)):
        return text.en
    render = getattr(text, "english", None)
    return render() if callable(render) else str(text)
