"""The value parsers of kiln's settings table (kiln/settings/table.py's `SETTINGS`): each takes what a
flag, an env var or a config file gave and returns the typed value, or raises ValueError with
what was wrong (resolution turns it into a ConfigError naming the source)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.errors import BadValue


def parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false), got {value!r}")


def parse_bytes(value: Any) -> int:
    """'4GiB', '512M', '1.5G', 1073741824 -> bytes. Units are binary (K=1024), like vLLM's."""
    if isinstance(value, int):
        return value
    text = str(value).strip().upper().replace("IB", "").replace("B", "")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(float(text))


def parse_name_list(value: Any) -> list[str]:
    """'a,b' or ['a', 'b'] -> ['a', 'b']; rejects empty names, padding and duplicates. A flag
    given several times is a list of its values (each may be 'a,b'), taken in order."""
    def flat(v: Any) -> list[str]:
        if isinstance(v, (list, tuple)):
            return [x for e in v for x in flat(e)]
        return str(v).split(",")

    items = flat(value)
    names: list[str] = []
    for raw in items:
        if raw != raw.strip():
            raise ValueError(f"name {raw!r} has surrounding whitespace")
        if not raw:
            raise ValueError("empty name in list")
        if raw in names:
            raise ValueError(f"duplicate name {raw!r}")
        names.append(raw)
    return names


def parse_str_list(value: Any) -> list[str]:
    if isinstance(value, list):
        return [str(v) for v in value]
    return [v for v in str(value).split(",") if v]


def lora_module(item: str) -> tuple[str, str]:
    """One LoRA adapter as vLLM's --lora-modules takes it: 'NAME=PATH', a bare PATH (named after
    its folder) or the JSON form '{"name": ..., "path": ...}' -> (name, path)."""
    text = str(item).strip()
    if text.startswith("{"):
        import json

        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"LoRA module {text!r} is not valid JSON: {e}") from None
        name, path = obj.get("name"), obj.get("path")
        if not (isinstance(name, str) and isinstance(path, str)):
            raise ValueError(f"LoRA module {text!r} needs string fields name and path")
    elif "=" in text:
        name, path = text.split("=", 1)
    else:
        path, name = text, Path(text.rstrip("/")).name
    if not name or not path or "=" in name:
        raise ValueError(f"LoRA module {text!r} must be NAME=PATH")
    return name, path


def parse_lora_modules(value: Any) -> list[str]:
    """--lora-modules / --lora values (repeatable, several per flag; comma-separated or a JSON
    list in env and config) -> ['name=path', ...], names unique."""
    def items(v: Any) -> list[str]:
        if isinstance(v, (list, tuple)):
            return [x for e in v for x in items(e)]
        text = str(v).strip()
        if text.startswith("["):
            import json

            return [json.dumps(e) if isinstance(e, dict) else str(e) for e in json.loads(text)]
        if text.startswith("{"):
            return [text]
        return [t for t in text.split(",") if t.strip()]

    out: dict[str, str] = {}
    for item in items(value):
        name, path = lora_module(item)
        if name in out:
            raise BadValue(f"LoRA adapter name {name!r} given twice", code="lora.name_given_twice")
        out[name] = path
    return [f"{n}={p}" for n, p in out.items()]


def parse_http_list(value: Any) -> list[str]:
    """vLLM's spelling of an HTTP list, a JSON list ('["GET", "POST"]'), or 'GET,POST'."""
    if isinstance(value, list):
        return [str(v) for v in value]
    text = str(value).strip()
    if text.startswith("["):
        import json

        items = json.loads(text)
        if not isinstance(items, list):
            raise ValueError(f"expected a list, got {value!r}")
        return [str(v) for v in items]
    return [v.strip() for v in text.split(",") if v.strip()]


def positive_bytes(value: Any) -> int:
    n = parse_bytes(value)
    if n <= 0:
        raise ValueError(f"must be a positive size, got {value!r}")
    return n


def positive_int(value: Any) -> int:
    n = int(value)
    if n <= 0:
        raise ValueError(f"must be a positive integer, got {n}")
    return n


def positive_int_or_auto(value: Any) -> int | str:
    return "auto" if str(value).strip().lower() == "auto" else positive_int(value)


def non_negative_int(value: Any) -> int:
    n = int(value)
    if n < 0:
        raise ValueError(f"must be >= 0, got {n}")
    return n


def fraction(value: Any) -> float:
    x = float(value)
    if not 0 < x <= 1:
        raise ValueError(f"must be in (0, 1], got {x}")
    return x


def parse_env_hash(value: Any) -> str:
    text = str(value).strip()
    algo, _, digest = text.partition(":")
    if algo != "sha256" or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError("expected sha256:<64 lowercase hex digits>")
    return text


def parse_json_object(value: Any) -> dict[str, Any]:
    import json

    if isinstance(value, dict):
        return value
    try:
        obj = json.loads(str(value))
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise TypeError(f"must be a JSON object ({{...}}), got {type(obj).__name__}")
    return obj


def parse_faults(value: Any) -> tuple[Any, ...]:
    from kiln.obs.faults import parse_faults as parse

    return parse(value)


def parse_duration(value: Any) -> float:
    """Ollama's keep_alive: seconds as a number, or "30s" / "5m" / "2h"; any negative value
    means forever (-> -1.0, which JSON can hold where inf cannot), 0 means at once."""
    import math

    if isinstance(value, bool):
        raise TypeError(f"expected a duration such as 300, '5m' or -1, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).strip().lower()
        units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
        unit = next((u for u in ("ms", "s", "m", "h") if text.endswith(u)), "")
        try:
            seconds = float(text[: len(text) - len(unit)]) * units.get(unit, 1)
        except ValueError:
            raise ValueError(f"expected a duration such as 300, '5m' or -1, got {value!r}"
                             ) from None
    if math.isnan(seconds):
        raise ValueError("a duration cannot be NaN")
    return -1.0 if seconds < 0 else seconds


def positive_wait_ms(value: Any) -> int:
    n = int(value)
    if n <= 0:
        raise ValueError(f"the wait must be > 0 ms, got {n} (leave the setting unset to turn "
                         "prefix rendezvous off)")
    return n
