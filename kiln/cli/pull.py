"""`kiln pull MODEL`: fetch a model into the Hugging Face cache and say where it is."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kiln.cli import add_json_flag, add_lang_flag, add_model_dir_flag
from kiln.errors import KilnError, error_record
from kiln.i18n import msg
from kiln.i18n.catalogue import CATALOGUE


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "pull",
        help="download a model (resumable) and print where it is",
        description="Download MODEL into the Hugging Face cache. MODEL is a kiln alias "
        "(see `kiln list --registry`), owner/repo (safetensors) or owner/repo:QUANT (one GGUF "
        "file). Already-present models are not downloaded again.",
    )
    p.add_argument("model", metavar="MODEL", help="alias, owner/repo or owner/repo:QUANT")
    add_model_dir_flag(p, "also look for MODEL in DIR before downloading (repeatable)")
    add_json_flag(p, "print the resolved source as JSON (a failure as {\"error\": {type, code, "
                  "message}})")
    add_lang_flag(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from kiln.resolve.hardware import format_bytes
    from kiln.resolve.sources import configured_model_dirs, offline_mode, resolve_model

    if offline_mode():
        print(msg("pull.offline"), file=sys.stderr)
    try:
        src = resolve_model(
            args.model,
            model_dirs=configured_model_dirs(getattr(args, "model_dir", None)),
            interactive=False,
            download=True,
        )
    except KilnError as e:
        print(msg("pull.error", error=e), file=sys.stderr)
        if getattr(args, "json", False):  # the failure too, for a program: its code and text
            print(json.dumps({"error": error_record(e)}, indent=2))
        return e.exit_code
    if getattr(args, "json", False):
        print(json.dumps(src.to_dict(), indent=2))
        return 0
    key = f"pull.origin.{src.origin}"
    where = msg(key) if key in CATALOGUE else src.origin
    quant = f" {src.quant}" if src.quant else ""
    print(f"{src.name}: {where}")
    print(msg("pull.path", path=src.path))
    print(msg("pull.format", format=src.format, quant=quant, files=len(src.files),
              size=format_bytes(src.total_bytes)))
    kind, reason = _serves(src)
    print(msg("pull.serves", kind=kind, reason=reason))
    print(msg("pull.run_it", model=args.model))
    return 0


def _serves(src: Any) -> tuple[str, str]:
    """What the pulled model serves: `--kind auto`'s rule."""
    from kiln.kinds import kind_of

    return kind_of(src.path, None, src.registry_entry)
