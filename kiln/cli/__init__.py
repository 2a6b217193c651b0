"""One small module per command (`add_parser` + `main`); what several commands take is here."""

from __future__ import annotations

import argparse


def add_model_dir_flag(p: argparse.ArgumentParser, help_text: str = "extra model folder") -> None:
    """--model-dir DIR, repeatable: doctor, list and pull read the same extra model folders."""
    p.add_argument("--model-dir", action="append", default=[], metavar="DIR", help=help_text)


def add_json_flag(p: argparse.ArgumentParser, help_text: str = "print JSON") -> None:
    """--json: the command prints its result as JSON for scripts instead of a table or text."""
    p.add_argument("--json", action="store_true", help=help_text)


def add_lang_flag(p: argparse.ArgumentParser) -> None:
    """--lang en|zh for commands without the settings table's flags (serve, run and bench get
    it from the table's `lang` row). cli.main has already applied it; this lets argparse accept
    it and reject other values."""
    p.add_argument("--lang", choices=("auto", "en", "zh"),
                   help="language of kiln's messages (default: KILN_LANG, else the locale)")


def format_table(rows: list[list[str]], header: list[str]) -> str:
    """Columns padded to their widest cell, two spaces apart (kiln list, kiln ps)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


def unknown_args_error(parser: argparse.ArgumentParser, extra: list[str],
                       why: str | None = None) -> None:
    """argparse's exit 2 with the command's own usage (`kiln serve`'s, not `kiln`'s), naming
    the nearest flag the command has for the first unknown option."""
    import difflib

    from kiln.i18n import msg

    flags = [o for a in parser._actions for o in a.option_strings]
    first = next((x.split("=", 1)[0] for x in extra if x.startswith("-")), None)
    near = difflib.get_close_matches(first, flags, n=1, cutoff=0.75) if first else []
    nearest = str(msg("serve.did_you_mean", flag=near[0])) if near else ""
    if why is None:
        parser.error(f"unrecognized arguments: {' '.join(extra)}{nearest}")
    parser.error(str(msg(why, args=" ".join(extra), nearest=nearest)))
