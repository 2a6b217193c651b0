"""Prompt generation for the serving benchmark.

A workload is a list of sessions; a session is one or more user turns. `fixed` and
`shared-prefix` sessions have one turn, `multi-turn` sessions several (the client resends the
history each turn). Text is made of varied common English words, which most BPE vocabularies
(Llama, SmolLM, Qwen, GPT) encode as one token each, so `n` words is about `n` tokens; pass a
token counter to hit lengths exactly.

Freshness: every generated text draws its words from an RNG seeded with a random per-run salt,
so the first tokens of each unique part differ between requests and between runs, and no
server-side prefix or response cache can help across runs. In `shared-prefix` the prefix is
shared by all requests of one level (that is the point of the workload) but is itself salted,
so a second run starts cold too.
"""

from __future__ import annotations

import math
import random
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.errors import ConfigError

WORKLOADS = ("fixed", "shared-prefix", "multi-turn")
ENDPOINTS = ("completions", "chat")

# Common English words that the SmolLM2 tokenizer (and most BPE vocabularies) encode as a single
# token with a leading space; checked with the SmolLM2 GGUF tokenizer: 500 words -> 501 tokens.
_WORDS_TEXT = """
able about above accept across act action active actual add address admit adult affect after
again against age agency agent agree ahead air airport allow almost alone along already also
always amount anchor animal answer anyone appear apple apply approach area argue arm army
around arrive art article artist ask attack attention author avoid away baby back bad bag ball
bank bar barley base basket battery beat beautiful become bed before begin behind believe best
better between beyond big bill bird black blanket blood blue board boat body book born both
bottle box boy bread break bridge bring brother budget build building business butter buy cabin
call camera campaign cancer candle canvas capital car card care career carrot carry case castle
catch cause cell center central century certain chair chance change charge check cheese cherry
child choice choose church circuit city civil claim class clear close coach coffee cold
collection college color come comet common community company compare compass computer concern
condition consider contain continue control copper cost cottage cotton could country couple
course court cover create crime cultural culture cup current customer cut dark data daughter
day dead deal death debate decade decide deep defense degree describe desert design detail
develop die difference different difficult dinner direction discover discuss disease doctor dog
door down draw dream drive drop drug during early east easy economic edge education effect
effort eight either election else employee end energy engine enjoy enough enter entire
environment especially evening event every evidence exactly example exist expect experience
expert explain eye face fact factor fail fall family far farm fast father fear federal feel few
field fight figure fill film final finally find fine finger finish fire firm first fish five
floor fly focus follow food foot force foreign forest forget form former forward four free
friend front full fund future galaxy game garden garlic gas general generation ginger girl give
glass goal golden good government grape great green ground group grow growth guess gun guy hair
half hammer hand hang happen happy harbor hard head health hear heart heat heavy helmet help
here herself high himself history hit hold home honey hope hospital hot hotel hour house
however huge human hundred husband idea identify image imagine impact important improve include
increase indeed indicate industry information inside instead interest interview into investment
island issue item itself jacket job join just keep key kid kill kind kitchen know knowledge
ladder land language lantern large last late later laugh law lawyer lay lead leader learn least
leave left leg legal lemon less letter level library life light like likely line list listen
little live local long look lose loss love low machine magazine main maintain major make manage
manager many marble market marriage material matter maybe meadow measure media medical meet
meeting member memory mention message method middle might military million mind minute mirror
miss mission model modern moment money month more morning most mother mountain mouth move
movement movie much museum music must myself name nation national natural nature near nearly
necessary need needle network never news newspaper next nice night none north note nothing
notice number occur ocean offer office officer official often olive once onion only onto open
operation orange orbit orchard order other others outside over own owner page pain painting
palace paper parent part party pass past patient pattern pay peace peach people pepper perform
perhaps period person phone physical pick picture piece pillow place plan planet plant play
player point police policy political poor popular population position positive possible potato
power practice prepare present president pressure pretty prevent price private probably problem
process produce product program project property protect prove provide public pull purpose push
quality question quickly quite race radio raise range rate rather reach read ready real reality
realize really reason receive recent recently record red reduce reflect region relate remain
remember remove report represent require research resource respond response rest result return
reveal rich right rise risk river road rock rocket role room rule run saddle safe salt same
save say scene school science sea season seat second section security see seek seem sell send
senior sense series serious serve service set seven several shake share she shoot short shot
should shoulder show side sign signal silver similar simple simply since sing single sister sit
site situation six size skill skin small smile social society soldier some someone something
sometimes son song soon sort sound source south space speak special specific speech spend sport
spring staff stage stand standard star start state statement station stay step still stock stop
store story strategy street strong structure student study stuff style subject success suddenly
suffer sugar suggest summer support sure surface system table take talk task tax teach teacher
team technology television tell temple ten tend term test than thank that theater their them
themselves then theory there these they thing think third this those though thought thousand
threat three through throughout throw thus time today together tomato tonight too top total
tough toward tower town trade traditional training travel treat treatment tree trial trip
trouble true truth try tunnel turn type under understand unit until upon usually valley value
various velvet very victim view village vineyard violence visit voice vote wagon wait walk wall
want war watch water way weapon wear week weight well west western what whatever wheat when
where whether which while white whole whom whose why wide wife will win wind window wish with
within without woman wonder word work worker world worry would write writer wrong yard yeah
year yellow young yourself"""
WORDS: tuple[str, ...] = tuple(_WORDS_TEXT.split())

TokenCounter = Callable[[str], int]


@dataclass
class WorkloadConfig:
    kind: str = "fixed"
    endpoint: str = "completions"
    input_len: int = 128  # tokens of the unique part of each user turn
    output_len: int = 128  # max_tokens of each request
    prefix_len: int = 512  # shared-prefix only
    turns: int = 3  # multi-turn only

    def validate(self) -> None:
        if self.kind not in WORKLOADS:
            raise ConfigError(
                f"unknown workload {self.kind!r}", hint=f"use one of {', '.join(WORKLOADS)}"
            )
        if self.endpoint not in ENDPOINTS:
            raise ConfigError(
                f"unknown endpoint {self.endpoint!r}", hint=f"use one of {', '.join(ENDPOINTS)}"
            )
        for name in ("input_len", "output_len", "prefix_len", "turns"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")


@dataclass
class Session:
    """One conversation: `turns` user messages sent one after another, `prefix` shared."""

    id: int
    turns: list[str]
    max_tokens: int
    prefix: str | None = None  # shared-prefix: the common system text
    salt: str = ""
    # Approximate token lengths (exact when a counter was given) of prefix and each turn.
    prefix_tokens: int = 0
    turn_tokens: list[int] = field(default_factory=list)


def new_salt() -> str:
    """A random salt; fresh for every run unless the user pins `--seed`."""
    return secrets.token_hex(8)


def _rng(salt: str, *parts: object) -> random.Random:
    # str seeds are hashed with SHA-512 by random.Random, so different salts give unrelated
    # streams and the same salt reproduces the same words.
    return random.Random(":".join([salt, *map(str, parts)]))


def make_text(rng: random.Random, n_tokens: int, counter: TokenCounter | None = None) -> str:
    """About `n_tokens` tokens of random words; exactly as counted by `counter` when given."""
    words = [rng.choice(WORDS) for _ in range(max(1, n_tokens))]
    if counter is None:
        return " ".join(words)
    # Words are ~1 token each, so a few corrections converge; the loop is bounded.
    for _ in range(8):
        got = counter(" ".join(words))
        if got == n_tokens:
            break
        if got < n_tokens:
            words.extend(rng.choice(WORDS) for _ in range(n_tokens - got))
        else:
            drop = max(1, got - n_tokens)
            if drop >= len(words):
                break
            del words[-drop:]
    return " ".join(words)


def make_sessions(
    cfg: WorkloadConfig,
    num_requests: int,
    salt: str,
    counter: TokenCounter | None = None,
    tag: str = "measure",
) -> list[Session]:
    """Sessions whose turns add up to exactly `num_requests` requests.

    All sessions made with one salt share the same prefix (shared-prefix), whatever the `tag`;
    each session's turns are unique to (salt, tag, session, turn). Warmup uses the level's salt
    with another tag, so it primes the shared prefix but none of the measured turns.
    """
    cfg.validate()
    if num_requests < 0:
        raise ConfigError("--num-requests must not be negative")
    prefix: str | None = None
    prefix_tokens = 0
    if cfg.kind == "shared-prefix":
        prefix = make_text(_rng(salt, "prefix"), cfg.prefix_len, counter)
        prefix_tokens = counter(prefix) if counter else cfg.prefix_len
    turns_per_session = cfg.turns if cfg.kind == "multi-turn" else 1
    n_sessions = math.ceil(num_requests / turns_per_session) if num_requests else 0
    sessions: list[Session] = []
    remaining = num_requests
    for sid in range(n_sessions):
        n_turns = min(turns_per_session, remaining)
        remaining -= n_turns
        turns = [make_text(_rng(salt, tag, sid, t), cfg.input_len, counter) for t in range(n_turns)]
        sessions.append(
            Session(
                id=sid,
                turns=turns,
                max_tokens=cfg.output_len,
                prefix=prefix,
                salt=salt,
                prefix_tokens=prefix_tokens,
                turn_tokens=[counter(t) if counter else cfg.input_len for t in turns],
            )
        )
    return sessions


def completion_prompt(session: Session, turn: int, replies: list[str]) -> str:
    """The /v1/completions prompt for `turn`, given the replies to the earlier turns."""
    if len(session.turns) == 1 and turn == 0:
        return f"{session.prefix}\n\n{session.turns[0]}" if session.prefix else session.turns[0]
    # Multi-turn over the completions endpoint: a plain transcript the model continues.
    lines: list[str] = [session.prefix] if session.prefix else []
    for i in range(turn):
        lines += [f"User: {session.turns[i]}", f"Assistant: {replies[i]}"]
    lines += [f"User: {session.turns[turn]}", "Assistant:"]
    return "\n".join(lines)


def chat_messages(session: Session, turn: int, replies: list[str]) -> list[dict[str, str]]:
    """The /v1/chat/completions messages for `turn`, resending the whole history."""
    msgs: list[dict[str, str]] = []
    if session.prefix:
        msgs.append({"role": "system", "content": session.prefix})
    for i in range(turn):
        msgs.append({"role": "user", "content": session.turns[i]})
        msgs.append({"role": "assistant", "content": replies[i]})
    msgs.append({"role": "user", "content": session.turns[turn]})
    return msgs


def hf_token_counter(tokenizer_ref: str) -> TokenCounter:
    """A counter from a Hugging Face tokenizer: an HF id or folder, or a .gguf file."""
    from pathlib import Path

    try:
        from transformers import AutoTokenizer
    except ImportError as err:  # pragma: no cover - transformers is a kiln dependency
        raise ConfigError("--tokenizer needs the transformers package") from err
    path = Path(tokenizer_ref)
    try:
        if path.suffix == ".gguf":
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        else:
            tok = AutoTokenizer.from_pretrained(tokenizer_ref)
    except Exception as err:  # any loader failure means the same thing to the user
        raise ConfigError(
            f"cannot load tokenizer {tokenizer_ref!r}: {err}",
            hint="pass a local folder, an HF id that is cached, or a .gguf file",
        ) from err

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    return count
