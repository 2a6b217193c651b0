"""`kiln` command line: one small module per command; heavy imports happen inside each command,
so `kiln --help` and `kiln serve --dry-run` stay quick."""

from __future__ import annotations

import argparse
import sys

from kiln import __version__


def build_parser() -> argparse.ArgumentParser:
    from kiln.cli import bench, config_cmd, doctor, list_models, pull, replay, run, serve

    p = argparse.ArgumentParser(
        prog="kiln", description="kiln: an OpenAI-compatible LLM server with its own engine.")
    p.add_argument("--version", action="version", version=f"kiln {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for mod in (serve, run, pull, list_models, doctor, config_cmd, bench, replay):
        mod.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after `--` goes untouched to an external engine (vLLM / SGLang).
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `kiln run MODEL --temperature 0 "a prompt"`: words after the options are still the prompt.
    if getattr(args, "command", None) == "run" and extra and not any(
            x.startswith("-") for x in extra):
        args.prompt = list(args.prompt) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.passthrough = passthrough
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
