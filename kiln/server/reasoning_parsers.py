"""Reasoning out of generated text: `<think>...</think>` into `reasoning_content` (vLLM's field),
chosen by `--reasoning-parser` (auto: from the chat template).

    qwen3        the reasoning is there when the output opens <think> (or the prompt already did)
    deepseek_r1  the output starts inside the reasoning (DeepSeek-R1's template opens <think> in
                 the prompt; older ones let the model write it): everything before </think> is
                 reasoning

Like the tool parsers (kiln/server/tool_parsers.py), a parser is one pure function of the text so
far, `parse(text, final) -> (reasoning, content)`, whose results for a prefix are prefixes of the
results for the whole; streaming sends the differences. A partial tag at the end is held back.
Reasoning is stripped of the whitespace around it, and so is the start of the content after it.
A prompt that already closed the reasoning (`enable_thinking=False` renders an empty
<think></think>) leaves none to find. Reasoning never closed (max_tokens ran out) stays reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


@dataclass
class Reasoned:
    reasoning: str
    content: str


def _held(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    name = ""
    starts_inside = False  # deepseek_r1: the output begins in the reasoning

    def __init__(self, prompt_text: str = "") -> None:
        # Where the prompt left off: a template that opened <think> (and did not close it)
        # makes the output start inside the reasoning; one that closed it leaves none.
        tail = prompt_text.rstrip()
        self.opened = tail.endswith(OPEN)
        self.closed = tail.endswith(CLOSE)

    def parse(self, text: str, final: bool) -> Reasoned:
        if self.closed:
            return Reasoned("", text)
        start = 0
        if not (self.opened or self.starts_inside):
            lead = text.lstrip()
            if not final and OPEN.startswith(lead):
                return Reasoned("", "")  # may still become <think>: undecided
            if not lead.startswith(OPEN):
                return Reasoned("", text)
            start = len(text) - len(lead) + len(OPEN)
        elif text.lstrip().startswith(OPEN):
            start = len(text) - len(text.lstrip()) + len(OPEN)  # the model opened it anyway
        elif not final and OPEN.startswith(text.lstrip()) and text.strip():
            return Reasoned("", "")
        end = text.find(CLOSE, start)
        if end < 0:
            body = text[start:]
            if not final:
                body = body[:len(body) - _held(body, CLOSE)]
            return Reasoned(body.strip(), "")
        return Reasoned(text[start:end].strip(), text[end + len(CLOSE):].lstrip())


class Qwen3Parser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    starts_inside = True


PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (Qwen3Parser, DeepSeekR1Parser)}


def choose_for_template(template: str | None) -> tuple[str, str]:
    """`--reasoning-parser auto`: (parser name or "none", why), from the chat template text."""
    if not template or CLOSE not in template:
        return "none", "the chat template shows no <think> reasoning"
    if "Assistant" in template and "｜" in template:
        return "deepseek_r1", "a DeepSeek chat template with <think> reasoning"
    return "qwen3", "the chat template knows <think> reasoning (Qwen3 style)"
