"""`kiln` command line: one small module per command; heavy imports happen inside each command,
so `kiln --help` and `kiln serve --dry-run` stay quick."""

from __future__ import annotations

import argparse
import os
import select
import sys
from typing import Any

from kiln import __version__
from kiln.i18n import detect_lang, set_lang


class KilnParser(argparse.ArgumentParser):
    """No prefix matching: `--model foo` once meant `--model-dir foo` and served the default
    model. Subcommands' parsers are built from the parent's class, so they inherit this."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    from kiln.cli import bench, config_cmd, doctor, list_models, ps, pull, replay, run, serve, stop

    p = KilnParser(
        prog="kiln", description="kiln: an OpenAI-compatible LLM server with its own engine.")
    p.add_argument("--version", action="version", version=f"kiln {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for mod in (serve, run, pull, list_models, ps, stop, doctor, config_cmd, bench, replay):
        mod.add_parser(sub)
    for command in sub.choices.values():  # errors print the command's usage, not kiln's
        command.set_defaults(command_parser=command)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after `--` goes untouched to an external engine (vLLM / SGLang).
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    # The language first: settings resolution (and argparse's own checks) may fail, and their
    # errors should already speak it. The table's `lang` row records the same choice later.
    set_lang(detect_lang(argv))
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.unknown_args = []
    # `kiln run MODEL --temperature 0 "a prompt"`: words after the options are still the prompt.
    if getattr(args, "command", None) == "run" and extra and not any(
            x.startswith("-") for x in extra):
        args.prompt = list(args.prompt) + extra
    elif extra and getattr(args, "command", None) == "serve":
        # kt-cli's habit: options kiln does not know go to the external engine. Which engine
        # runs is known only once the settings resolve, so `kiln serve` decides.
        args.unknown_args = extra
    elif extra:
        from kiln.cli import unknown_args_error

        unknown_args_error(getattr(args, "command_parser", None) or parser, extra)
    args.passthrough = passthrough
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # a short listing is still buffered: meet a closed pipe here
        return rc
    except BrokenPipeError:
        if not _stdout_reader_left():
            raise  # another pipe or socket broke: a real error, with its traceback
        # `kiln list --registry | head`: the reader left, which ends a listing, not an error (a
        # C tool dies of SIGPIPE, 141 to the shell). stdout goes to /dev/null so the exit's
        # flush of what is still buffered does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _stdout_reader_left() -> bool:
    """Whether stdout is a pipe whose reading end is closed (poll reports POLLERR on it)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll(), or stdout is not a file
        return False


if __name__ == "__main__":
    raise SystemExit(main())
