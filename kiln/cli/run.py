"""`kiln run [MODEL] [PROMPT]`: a streamed answer in the terminal, or a chat (like `ollama run`).

With PROMPT (or text on stdin), one answer and exit. Without, an interactive chat that keeps the
history; `/bye` or Ctrl-D leaves. Runs the engine in-process: no server, no port.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kiln import startup, startup_report
from kiln.i18n import msg
from kiln.settings.sources import add_common_arguments


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("run", help="chat with MODEL in the terminal",
                              description="One-shot answer to PROMPT, or an interactive chat.")
    p.add_argument("model", nargs="?", metavar="MODEL", help="what to run (default: smollm2)")
    p.add_argument("prompt", nargs="*", metavar="PROMPT", help="one-shot prompt")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop when TEXT is generated (cut from the answer; repeatable)")
    add_common_arguments(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING)
    prompt = " ".join(args.prompt).strip()
    if getattr(args, "model_option", None) and args.model:
        # `kiln run -m MODEL "a question"`: with -m, every word is the prompt.
        prompt, args.model = " ".join([args.model, *args.prompt]).strip(), None
    if args.model and not prompt and not _looks_like_model(args.model):
        prompt, args.model = args.model, None  # `kiln run "a question"` uses the default model
    if not prompt and not sys.stdin.isatty():
        prompt = sys.stdin.read().strip()
    sp = startup.StartupPlan(args)
    try:
        startup.plan(args, sp)
        if args.dry_run:
            print(startup_report.describe(sp))
            return 0
        chat = _Chat(sp, args)
    except BaseException as e:
        if isinstance(e, (SystemExit, KeyboardInterrupt)):
            raise
        return startup_report.fail(sp, e)
    if prompt:
        chat.ask(prompt)
        return 0
    return chat.interactive()


def _looks_like_model(text: str) -> bool:
    from pathlib import Path

    from kiln.resolve.registry import lookup

    return (" " not in text and ("/" in text or text.endswith(".gguf") or Path(text).exists()
                                 or lookup(text.split(":")[0]) is not None))


class _Chat:
    def __init__(self, sp: startup.StartupPlan, args: argparse.Namespace) -> None:
        src = sp.source
        assert src is not None
        print(msg("run.loading", name=src.name), file=sys.stderr, flush=True)
        self.tokenizer = startup.load_tokenizer(sp)
        self.engine = startup.build_engine(sp, self.tokenizer)
        self.args = args
        # A base model has no chat template: each prompt runs as a plain completion (what
        # /v1/completions would do), no history, and the user is told once.
        self.raw = not self.tokenizer.chat_template
        if self.raw:
            print(msg("run.no_template", name=src.name), file=sys.stderr, flush=True)
        self.history: list[dict[str, str]] = []
        if args.system:
            self.history.append({"role": "system", "content": args.system})
        self._n = 0

    def ask(self, text: str) -> str:
        from kiln.engine.output import RequestOutput
        from kiln.sampling_params import SamplingParams

        if self.raw:
            self.history = []  # a completion continues the prompt alone
            ids = self.tokenizer.encode(text)
        else:
            ids = self.tokenizer.apply_chat_template(
                [*self.history, {"role": "user", "content": text}], add_generation_prompt=True)
        budget = self.engine.max_model_len - len(ids) - 1
        if budget < 1:
            print(msg("run.too_long"))
            return ""
        self.history.append({"role": "user", "content": text})
        params = SamplingParams(temperature=self.args.temperature,
                                max_tokens=min(self.args.max_tokens, budget),
                                stop=self.args.stop or [])
        self._n += 1
        rid = f"run-{self._n}"
        self.engine.add_request(rid, ids, params)
        answer: list[str] = []

        def show(outputs: list[RequestOutput]) -> None:
            for out in outputs:  # DELTA: the one choice's new text
                for co in out.outputs:
                    answer.append(co.text)
                    sys.stdout.write(co.text)
            sys.stdout.flush()

        try:
            while self.engine.has_unfinished:
                show(self.engine.step())
        except KeyboardInterrupt:
            self.engine.abort(rid)
            show(self.engine.step())  # the abort's output: the text held back so far
        sys.stdout.write("\n")
        sys.stdout.flush()
        reply = "".join(answer)
        if not self.raw:
            self.history.append({"role": "assistant", "content": reply})
        return reply

    def interactive(self) -> int:
        print(msg("run.chat_intro"), file=sys.stderr)
        while True:
            try:
                line = input(">>> ")
            except (EOFError, KeyboardInterrupt):
                print()
                return 0
            line = line.strip()
            if not line:
                continue
            if line in ("/bye", "/exit", "/quit"):
                return 0
            if line == "/clear":
                self.history = [m for m in self.history if m["role"] == "system"]
                continue
            self.ask(line)
