"""docs/flags.md, written from the settings table (kiln/settings/table.py's SETTINGS) and the front-end
flags `kiln serve` adds around it, by `kiln config docs`.

The page is generated so that it cannot drift from the flags argparse builds from the same rows;
tests/unit/test_docs.py regenerates it in memory and fails when the file in the tree differs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kiln.i18n import msg
from kiln.settings import table as C
from kiln.settings.sources import add_common_arguments
from kiln.settings.values import parse_bytes, positive_bytes

# Where the repository's copy lives (an editable install: kiln/ sits beside docs/).
DEFAULT_PATH = Path(__file__).resolve().parents[2] / "docs" / "flags.md"
COMMAND = "kiln config docs"

GROUP_TITLES = {
    "server": "Server: HTTP, API limits, chat output, several models, pages",
    "model": "Model: what to serve and where it is found",
    "engine": "Engine: device, weights, batching, KV cache, kernels, LoRA, speculation, MoE",
    "observability": "Traces, request dumps and faults",
}


def _cell(text: str) -> str:
    """A table cell: pipes escaped, no line breaks, and <name> kept as text (Markdown would
    take <think> for an HTML tag and drop it)."""
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text.replace("<", "&lt;").replace(">", "&gt;")


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return str(n)


def _default(s: C.Setting) -> str:
    if s.auto is not None and s.default in (None, "auto"):
        return "auto"
    if s.default is None:
        return "unset"
    if s.is_bool:
        return "on" if s.default else "off"
    if s.parse in (parse_bytes, positive_bytes) and isinstance(s.default, int):
        return _size(s.default)
    if isinstance(s.default, (list, tuple)):
        return "`" + ",".join(map(str, s.default)) + "`"
    return f"`{s.default}`"


def _values(s: C.Setting) -> str:
    if s.is_bool:
        return "on / off"
    if s.choices:
        return "`" + "\\|".join(map(str, s.choices)) + "`"
    return f"`{s.metavar}`" if s.metavar else ""


def _flags(s: C.Setting) -> str:
    flags = [f"`{f}`" for f in (*s.flags, *s.neg_flags)]
    extra = []
    if s.repeatable:
        extra.append("repeatable")
    if s.nargs == "+":
        extra.append("several values per flag")
    return ", ".join(flags) + (f" ({', '.join(extra)})" if extra else "") if flags else "-"


def _engines(s: C.Setting) -> str:
    return ", ".join(s.engines)


def _front_end_flags() -> list[argparse.Action]:
    """`kiln serve`'s options that are not rows of the table (the model, the config file, the
    dry run and the two records), read from the parser the command builds."""
    parser = argparse.ArgumentParser(add_help=False)
    add_common_arguments(parser)
    return [a for a in parser._actions if a.option_strings and a.dest not in C.BY_NAME]


def flags_markdown() -> str:
    lines = [
        "# Settings and flags",
        "",
        (f"Generated from the settings table (`SETTINGS` in `kiln/settings/table.py`) by `{COMMAND}`: "
         "edit the table, then run that command (`tests/unit/test_docs.py` fails while this page is "
         "stale). `kiln serve --help` prints the same flags."),
        "",
        ("Every setting is one row: its name is the config-file key (`~/.config/kiln/config.toml`"
         " or `--config`; dashes or underscores), `KILN_<NAME>` its environment variable, and its"
         " flags are taken by `kiln serve` and `kiln run`; `kiln bench --offline --engine-arg "
         "NAME=VALUE` and the offline `LLM(model, **settings)` take the name. A value is resolved from, highest "
         "first: **CLI > `KILN_*` > config file > runtime preset > model registry > auto rule > "
         "default**, and keeps its source and, for auto values, the rule's reason "
         "(`kiln serve --dry-run`, `--effective-config-json`, `--decision-trace-jsonl`)."),
        "",
        ("Columns: *default* `auto` means an auto rule decides from the hardware and the model "
         "(the reason is in the effective config); *affects* is what a change can move "
         "(correctness, performance, memory, observability, server); *engines* are the engines "
         "that honour it (`kiln`: kiln's own engine and front-end; `vllm`, `sglang`: handed to "
         "that engine by `--engine`)."),
        "",
        "## Command-line only (kiln serve, kiln run)",
        "",
        "| flag | what it does |",
        "|---|---|",
        ("| `MODEL` (positional) | what to serve: registry alias, `owner/repo[:QUANT]`, a folder "
         "or a `.gguf` file (the `model` row below gives a default) |"),
    ]
    for a in _front_end_flags():
        flags = ", ".join(f"`{f}`" for f in a.option_strings)
        if a.metavar:
            flags += f" `{a.metavar}`"
        lines.append(f"| {flags} | {_cell(a.help or '')} |")
    lines.append("| `--` ARGS | everything after `--` goes to an external engine untouched |")
    groups: dict[str, list[C.Setting]] = {}
    for s in C.SETTINGS:
        groups.setdefault(s.group, []).append(s)
    for group, rows in groups.items():
        lines += ["", f"## {GROUP_TITLES.get(group, group.capitalize())}", "",
                  ("| setting | flags | values | default | env | affects | engines | "
                   "what it does |"),
                  "|---|---|---|---|---|---|---|---|"]
        for s in rows:
            lines.append(f"| `{s.name}` | {_flags(s)} | {_values(s)} | {_default(s)} | "
                         f"`{s.env_var}` | {s.affects} | {_engines(s)} | {_cell(s.help)} |")
    lines += ["", f"{len(C.SETTINGS)} settings.", ""]
    return "\n".join(lines)


def write(path: Path = DEFAULT_PATH) -> bool:
    """Writes the page; True when the file changed."""
    text = flags_markdown()
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return True


def is_current(path: Path = DEFAULT_PATH) -> bool:
    return path.exists() and path.read_text() == flags_markdown()


def main(args: Any) -> int:
    """`kiln config docs [--check] [--output PATH]`."""
    path = Path(args.output) if args.output else DEFAULT_PATH
    if args.check:
        if is_current(path):
            print(msg("docs.current", path=path))
            return 0
        print(msg("docs.stale", path=path, command=COMMAND))
        return 1
    changed = write(path)
    print(msg("docs.written" if changed else "docs.already_current", path=path,
              count=len(C.SETTINGS)))
    return 0
