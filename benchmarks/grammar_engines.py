"""llguidance vs xgrammar on this CPU, for SmolLM2's 49,152-token vocabulary: how kiln chose its
grammar engine (kiln/engine/structured.py records the numbers).

    .venv/bin/python benchmarks/grammar_engines.py
    # xgrammar is not a kiln dependency; to compare, install it beside (it declares torch and
    # triton; neither is needed on CPU):
    .venv/bin/pip install --no-deps xgrammar apache-tvm-ffi

For each engine: building its tokenizer info once; compiling four JSON schemas, json_object and
a regex (cold: caches off); then filling the next-token mask along two kinds of path:

  * a document: the tokens of a valid instance of each schema, mask before each token;
  * a random walk: 5 walks per schema of up to 80 tokens, each a uniform pick among the tokens
    the mask allows (strings of odd tokens, long numbers: the states a real model wanders
    into), the same seed for both engines.

JSON is compiled the way kiln compiles it: one line, ", " and ": " separators, no free
whitespace. Prints one JSON object per engine.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEMAS = {
    "flat": ({"type": "object", "properties": {"name": {"type": "string"},
              "age": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["name", "age", "ok"]},
             {"name": "Ada Lovelace", "age": 36, "ok": True}),
    "nested": ({"type": "object", "properties": {"user": {"type": "object", "properties": {
                "id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
                "required": ["id", "tags"]}, "score": {"type": "number"}},
                "required": ["user", "score"]},
               {"user": {"id": 7, "tags": ["a", "bc", "def"]}, "score": 3.25}),
    "enum_array": ({"type": "object", "properties": {
                    "color": {"enum": ["red", "green", "blue"]},
                    "sizes": {"type": "array", "items": {"type": "integer", "minimum": 0},
                              "minItems": 1, "maxItems": 5}}, "required": ["color", "sizes"]},
                   {"color": "green", "sizes": [1, 2, 3]}),
    "deep": ({"type": "object", "properties": {"a": {"type": "object", "properties": {
              "b": {"type": "object", "properties": {"c": {"type": "array", "items": {
                  "type": "object", "properties": {"x": {"type": "number"},
                                                   "y": {"type": "string", "maxLength": 10}},
                  "required": ["x", "y"]}}}, "required": ["c"]}}, "required": ["b"]},
              "d": {"type": ["string", "null"]}}, "required": ["a", "d"]},
             {"a": {"b": {"c": [{"x": 1.5, "y": "hi"}, {"x": -2, "y": "there"}]}}, "d": None}),
}
REGEX = r"[0-9]{3}-[a-z]+"


class LLG:
    name = "llguidance"

    def __init__(self, tok, vocab: int) -> None:
        from kiln.engine.structured import StructuredOutputs

        self.so = StructuredOutputs(tok, vocab, cache_size=0)
        t = time.perf_counter()
        self.so.ll_tokenizer()
        self.tokinfo_s = time.perf_counter() - t

    def compile(self, kind: str, value):
        from kiln.sampling_params import StructuredOutputsParams as SO

        so = {"json": SO(json=value), "json_object": SO(json_object=True),
              "regex": SO(regex=value)}[kind]
        return self.so.compile(so)

    def matcher(self, compiled):
        from kiln.engine.structured import GrammarMatcher

        return GrammarMatcher(compiled.deep_copy(), self.so)

    def fill(self, m, bitmask) -> None:
        m.fill(bitmask, 0)

    def accept(self, m, t: int) -> bool:
        return m.accept(t)

    def done(self, m) -> bool:
        return m.done


class XGR:
    name = "xgrammar"

    def __init__(self, tok, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        t = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=vocab,
                                                  stop_token_ids=sorted(tok.eos_token_ids))
        self.tokinfo_s = time.perf_counter() - t
        self.compiler = xgr.GrammarCompiler(info, max_threads=torch.get_num_threads(),
                                            cache_enabled=False)

    def compile(self, kind: str, value):
        if kind == "json":
            return self.compiler.compile_json_schema(json.dumps(value), any_whitespace=False)
        if kind == "json_object":
            return self.compiler.compile_builtin_json_grammar()
        return self.compiler.compile_regex(value)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask) -> None:
        m.fill_next_token_bitmask(bitmask, 0)

    def accept(self, m, t: int) -> bool:
        return m.accept_token(t)

    def done(self, m) -> bool:
        return m.is_terminated()


def allowed_ids(bitmask: torch.Tensor, vocab: int) -> list[int]:
    bits = (bitmask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return torch.nonzero(bits.flatten()[:vocab]).flatten().tolist()


def measure(engine, tok, vocab: int) -> dict:
    bitmask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    res: dict = {"engine": engine.name, "tokenizer_info_s": round(engine.tokinfo_s, 3)}
    compiled = {}
    for name, (schema, _) in SCHEMAS.items():
        t = time.perf_counter()
        compiled[name] = engine.compile("json", schema)
        res[f"compile_ms_{name}"] = round(1e3 * (time.perf_counter() - t), 2)
    for kind, value in (("json_object", None), ("regex", REGEX)):
        t = time.perf_counter()
        engine.compile(kind, value)
        res[f"compile_ms_{kind}"] = round(1e3 * (time.perf_counter() - t), 2)
    doc_fills: list[float] = []
    for name, (_, instance) in SCHEMAS.items():
        m = engine.matcher(compiled[name])
        for t_ in tok.encode(json.dumps(instance), add_special_tokens=False):
            t = time.perf_counter()
            engine.fill(m, bitmask)
            doc_fills.append(time.perf_counter() - t)
            assert engine.accept(m, t_), (engine.name, name)
    rng = random.Random(0)
    walk_fills: list[float] = []
    for name in SCHEMAS:
        for _ in range(5):
            m = engine.matcher(compiled[name])
            for _ in range(80):
                t = time.perf_counter()
                engine.fill(m, bitmask)
                walk_fills.append(time.perf_counter() - t)
                pick = rng.choice(allowed_ids(bitmask, vocab))
                assert engine.accept(m, pick)
                if pick in tok.eos_token_ids or engine.done(m):
                    break
    for label, xs in (("document", doc_fills), ("walk", walk_fills)):
        xs.sort()
        res[f"fill_ms_{label}"] = {
            "n": len(xs), "mean": round(1e3 * statistics.mean(xs), 4),
            "p50": round(1e3 * xs[len(xs) // 2], 4), "p99": round(1e3 * xs[int(.99 * len(xs))], 4),
            "max": round(1e3 * xs[-1], 3)}
    return res


def main() -> None:
    from kiln.tokenizer import default_gguf_path, load_tokenizer

    tok = load_tokenizer(default_gguf_path())
    vocab = tok.vocab_size
    for cls in (LLG, XGR):
        try:
            engine = cls(tok, vocab)
        except ImportError as e:
            print(json.dumps({"engine": cls.name, "skipped": str(e)}))
            continue
        print(json.dumps(measure(engine, tok, vocab)), flush=True)


if __name__ == "__main__":
    main()
