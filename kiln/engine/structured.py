"""Structured output: a grammar, enforced while sampling, on the rows that ask for one.

    StructuredOutputsParams --compile (LRU, per canonical value)--> pristine LLMatcher
        --deep_copy, per request (2 us)--> GrammarMatcher on Request.grammar
    each step, for the constrained rows only:
        fill_bitmasks (llguidance, without the GIL)              one bit per token
        apply_bitmasks (numpy unpack + one add of 0 / -inf)      on those rows of the logits
    each sampled token: GrammarMatcher.accept (Scheduler.update); once the grammar can take
        nothing more, the request ends there with finish_reason "stop".

The grammar engine is llguidance (PyPI `llguidance`), chosen over xgrammar after measuring both
on this CPU (2 cores) with SmolLM2's 49,152-token vocabulary (benchmarks/grammar_engines.py;
llguidance 1.9.1, xgrammar 0.2.9):

                                         llguidance          xgrammar
    tokenizer info, once                 0.25-0.42 s         0.20-0.26 s
    compile a JSON schema (4 schemas)    0.9-1.8 ms          1.0-23.6 ms (3 of 4: 7-24)
    compile json_object / a regex        0.5-0.9 / 1.0-1.6   6.8-10.3 / 0.6-0.9 ms
    mask fill per row, along valid       mean 0.08-0.13 ms   mean 0.006-0.009 ms
      documents (114 steps)              p99 0.5-0.7 ms      p99 0.04-0.08 ms
    mask fill per row, random walks      mean 0.06-0.17 ms   mean 0.012-0.07 ms
      through the schemas (~1,300 steps) p99 0.46-0.78 ms    p99 0.045-0.12 ms
    runtime dependencies                 none (abi3 wheel)   torch, triton, apache-tvm-ffi
    unsupported keyword ({"not": ...})   refused (a 400)     silently ignored

(Three runs, benchmarks/results/grammar_engines-20261204.jsonl, on a shared machine: the
ranges are its noise.) xgrammar fills a mask several times faster, but both are far below a
decode step (tens of ms at c=16 on this CPU; benchmarks/structured.py measures kiln's whole
per-row cost). What decided it: xgrammar declares triton as a dependency (a GPU compiler of over
100 MB that a CPU install would pull), its compile is up to ~10x slower on a cache miss
(a new schema is a new request's latency), and it accepted a schema keyword it does not
enforce, so its output could fail the user's own validation; llguidance installs alone and
refuses what it cannot enforce.

Choices, documented for users:
  * JSON comes out on one line, as `json.dumps` writes it (", " and ": ", no other whitespace):
    a small model given free whitespace can spend its tokens on newlines. A schema's own
    "x-guidance" options override this (llguidance's JSON options).
  * response_format json_schema with strict=true: an object schema that says nothing about
    additional properties gets "additionalProperties": false, as OpenAI's strict mode requires
    of the schema (server/request_params.py's strict_schema; the output still validates against the
    schema as sent).
  * Logprobs are those of the masked distribution (tokens the grammar forbids have -inf), as in
    vLLM, where the grammar bitmask is applied to the logits before the sampler computes them;
    forbidden tokens are not listed among top_logprobs (fewer than asked where fewer are
    allowed).
  * `guided_grammar` is Lark (llguidance's syntax) or GBNF (llama.cpp / vLLM's xgrammar EBNF,
    `root ::= ...`), converted to Lark.
  * When the grammar is complete (it can take no more bytes), the request finishes at once
    with "stop", without spending a step on the end-of-sequence token. When it is merely
    acceptable (a number that could go on), EOS is one of the allowed tokens.

For speculative decoding later: llguidance's matcher can roll back (LLMatcher.rollback) and
fill the masks of a row's draft tokens in one call; GrammarMatcher is where that would go.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kiln.sampling_params import SamplingParamsError, StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

    from kiln.tokenizer import Tokenizer

log = logging.getLogger("kiln.structured")

# llguidance's JSON options; a schema's "x-guidance" overrides them.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled grammars kept (each a few hundred KB at most)
_MAX_ERROR = 1000  # characters of an engine error message put in a 400
# -inf as the bits of a float32 (0xFF800000): a blocked token's bit times this is its bias.
_NEG_INF_BITS = -8388608


class StructuredOutputError(SamplingParamsError):
    """The schema, regex, choice list or grammar cannot be compiled; `param` names the request
    field it came from, `code` which kind of constraint failed (_CODES). A 400, never an engine
    failure."""


# The error code of a constraint that does not compile, by its kind: what a client (and a test)
# matches; the message carries the grammar compiler's own diagnosis.
_CODES = {"json": "invalid_json_schema", "json_object": "invalid_json_schema",
          "regex": "invalid_regex", "choice": "invalid_choice", "grammar": "invalid_grammar"}


def canonical(so: StructuredOutputsParams, param: str = "structured_outputs") -> tuple[str, str]:
    """(kind, text) identifying the constraint: the cache key. A schema given as text is parsed
    (so '{"a":1}' and {"a": 1} share an entry); key order is kept (it orders the output)."""
    kinds = so.kinds()
    if len(kinds) != 1:
        raise StructuredOutputError(param, "give exactly one of json, json_object, regex, choice, "
                                    f"grammar; got {kinds or 'none'}", "conflicting_constraints")
    kind = kinds[0]
    if kind == "json":
        schema: Any = so.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise StructuredOutputError(param, f"the JSON schema is not valid JSON: {e}",
                                            _CODES[kind]) from e
        if schema is True:
            schema = {}  # JSON Schema's "anything"
        elif schema is False:
            raise StructuredOutputError(param, "the JSON schema false allows no value",
                                        _CODES[kind])
        if not isinstance(schema, dict):
            raise StructuredOutputError(param, "the JSON schema must be an object, got "
                                        f"{type(schema).__name__}", _CODES[kind])
        return kind, json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    if kind == "json_object":
        return kind, ""
    if kind == "choice":
        choice = so.choice
        if (not isinstance(choice, list) or not choice
                or not all(isinstance(c, str) for c in choice)):
            raise StructuredOutputError(param, "choice must be a non-empty list of strings",
                                        _CODES[kind])
        return kind, json.dumps(choice, ensure_ascii=False)
    text = so.regex if kind == "regex" else so.grammar
    if not isinstance(text, str):
        raise StructuredOutputError(param, f"{kind} must be a string", _CODES[kind])
    return kind, text


def _grammar_text(kind: str, text: str) -> str:
    """The llguidance grammar (its JSON form) of a canonical constraint."""
    import llguidance as llg

    if kind == "json":
        return llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        # Each string a Lark literal (JSON string syntax), as llguidance.grammar_from does.
        choices = json.loads(text)
        return llg.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choices))
    from llguidance.gbnf_to_lark import any_to_lark

    return llg.LLMatcher.grammar_from_lark(any_to_lark(text))


_WHAT = {"json": "the JSON schema", "json_object": "the JSON object grammar",
         "regex": "the regex", "choice": "the choice list", "grammar": "the grammar"}


class StructuredOutputs:
    """Grammars for one tokenizer: its llguidance vocabulary (built on first use, ~0.5 s), the
    cache of compiled grammars, and the per-request matchers made from them. Thread-safe: the
    server compiles to validate a request, the engine thread compiles (a cache hit) to admit it.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, *,
                 cache_size: int = CACHE_SIZE) -> None:
        """`vocab_size`: the model's (the width of its logits), which may exceed the
        tokenizer's; ids past the tokenizer's are never allowed."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self.eos_token_ids = sorted(t for t in tokenizer.eos_token_ids if 0 <= t < vocab_size)
        # Counters (read by Engine.metrics and the benchmark).
        self.compiles = 0
        self.cache_hits = 0
        self.mask_rows = 0  # constrained rows masked
        self.seconds = 0.0  # grammar work: masks filled and applied, matchers advanced

    # ------------------------------------------------------------------ the vocabulary

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                t0 = time.perf_counter()
                self._ll_tokenizer = _build_ll_tokenizer(self.tokenizer, self.vocab_size,
                                                         self.eos_token_ids)
                log.info("grammar vocabulary built in %.2f s", time.perf_counter() - t0)
            return self._ll_tokenizer

    # ------------------------------------------------------------------ compiling

    def compile(self, so: StructuredOutputsParams, param: str = "structured_outputs"
                ) -> llguidance.LLMatcher:
        """The pristine matcher of `so` (compiled once per canonical value, LRU-cached).
        Raises StructuredOutputError naming `param` when it does not compile."""
        key = canonical(so, param)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return hit
        lt = self.ll_tokenizer()
        import llguidance as llg

        try:
            grammar = _grammar_text(*key)
        except Exception as e:  # bad input to llguidance's converters (GBNF, Lark, JSON)
            raise StructuredOutputError(param, f"{_WHAT[key[0]]} is invalid: {e}",
                                        _CODES[key[0]]) from e
        matcher = llg.LLMatcher(lt, grammar, log_level=0)
        if matcher.is_error():
            err = matcher.get_error().strip()
            if len(err) > _MAX_ERROR:
                err = err[:_MAX_ERROR] + " ..."
            raise StructuredOutputError(param, f"{_WHAT[key[0]]} is invalid or not supported: "
                                        f"{err}", _CODES[key[0]])
        with self._lock:
            self.compiles += 1
            self._cache[key] = matcher
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, so: StructuredOutputsParams, param: str = "structured_outputs"
                ) -> GrammarMatcher:
        """A fresh matcher for one request (one per choice of an n>1 request)."""
        pristine = self.compile(so, param)
        with self._lock:
            m = pristine.deep_copy()
        return GrammarMatcher(m, self)

    # ------------------------------------------------------------------ masking

    def mask_logits(self, logits: torch.Tensor, rows: list[int],
                    matchers: list[GrammarMatcher]) -> torch.Tensor:
        """`logits` [B, V] with the tokens that the grammar of `rows` (row i under matchers[i])
        does not allow next at -inf: a new tensor; the other rows are the same values."""
        t0 = time.perf_counter()
        out = apply_bitmasks(logits, fill_bitmasks(matchers, self.vocab_size), rows)
        self.mask_rows += len(rows)
        self.seconds += time.perf_counter() - t0
        return out

    def stats(self) -> dict[str, float]:
        return {"structured_rows": self.mask_rows, "structured_seconds": self.seconds,
                "structured_compiles": self.compiles}


class GrammarMatcher:
    """One request's position in its grammar. It follows the request's output tokens: each
    sampled token is accepted once (Scheduler.update), and preemption, which keeps the output
    tokens, leaves it where it is."""

    __slots__ = ("_m", "owner")

    def __init__(self, matcher: llguidance.LLMatcher, owner: StructuredOutputs) -> None:
        self._m = matcher
        self.owner = owner

    def accept(self, token_id: int) -> bool:
        """Advances past `token_id`; False (and the matcher stopped, in error) if the grammar
        does not allow it, which the mask should have prevented."""
        t0 = time.perf_counter()
        ok = self._m.consume_token(token_id)
        self.owner.seconds += time.perf_counter() - t0
        if not ok:
            log.warning("grammar refused sampled token %d: %s", token_id,
                        self._m.get_error()[:200])
        return ok

    @property
    def done(self) -> bool:
        """Nothing more can follow (the grammar is complete, or in error): end the request."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())


def fill_bitmasks(matchers: list[GrammarMatcher], vocab_size: int) -> torch.Tensor:
    """[len(matchers), ceil(vocab/32)] int32: bit t of row i set when matchers[i] allows token
    t. A matcher in error allows only EOS (llguidance's choice), so no row is ever empty. One
    row after another: llguidance's thread pool (LLExecutor) filled 16 rows no faster on 2
    cores (0.080-0.094 ms a row against 0.070-0.085), and slower on a loaded machine."""
    bitmask = torch.zeros((len(matchers), (vocab_size + 31) // 32), dtype=torch.int32)
    for i, m in enumerate(matchers):
        m.fill(bitmask, i)
    return bitmask


def apply_bitmasks(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]
                   ) -> torch.Tensor:
    """`logits` [B, V] plus -inf at the blocked tokens of `rows`, 0 elsewhere, as a new tensor
    (the caller's is left as it was): logit + 0 is the logit, so allowed tokens and other rows
    keep their exact values. A bias added is ~5x cheaper than a masked_fill (whose cost is
    branch misses on an irregular mask: 1.7 ms vs 0.3 ms for 16 rows of 49k), and done out of
    place it is the copy too. Bitmask row i belongs to logits row rows[i]."""
    V = logits.shape[1]
    blocked = np.unpackbits((~bitmask.numpy()).view(np.uint8), axis=1, bitorder="little",
                            count=V)
    bias = torch.from_numpy(blocked).to(torch.int32).mul_(_NEG_INF_BITS).view(torch.float32)
    bias = bias.to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        return logits + bias
    return logits.index_add(0, torch.tensor(rows, device=logits.device), bias)


def _build_ll_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos: list[int]
                        ) -> llguidance.LLTokenizer:
    """llguidance's view of the vocabulary: each id's bytes (Tokenizer.token_bytes, the bytes
    kiln itself decodes them to), which ids are special (never matched as text), the EOS ids."""
    import llguidance as llg

    return llg.LLTokenizer(llg.TokenizerWrapper(_Vocab(tokenizer, vocab_size, eos)),
                           n_vocab=vocab_size, eos_token=eos or None)


class _Vocab:
    """What llguidance.TokenizerWrapper reads of a tokenizer."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos: list[int]) -> None:
        n = tokenizer.vocab_size
        self.tokenizer = tokenizer
        self.eos_token_id = eos[0] if eos else tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        # Ids past the tokenizer's (a padded model vocabulary) are empty: never allowed.
        self.tokens = [tokenizer.token_bytes(i) if i < n else b"" for i in range(vocab_size)]
        self.special_token_ids = sorted(t for t in tokenizer.all_special_ids if t < vocab_size)

    def __call__(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)
