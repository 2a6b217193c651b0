"""POST /v1/embeddings and /v1/rerank (+ /rerank): what an embedding model (--kind embed) serves.

    input (text or token ids) --tokenize, check lengths--> EmbeddingEngine.embed (batched with
      other requests' inputs on the engine thread) --> [dimensions] --> float or base64

`dimensions` truncates only a Matryoshka model (its config.json lists `matryoshka_dimensions` or
sets `is_matryoshka`, as vLLM reads it); for another model it is a 400 unless it equals the
model's width. Rerank scores by the cosine similarity of the query's and each document's
embeddings (a bi-encoder; kiln runs no cross-encoder), and the response says so in `scoring`.
"""

from __future__ import annotations

import base64
import uuid
from typing import Any

import torch
from fastapi import APIRouter
from fastapi.responses import JSONResponse

from kiln.server.embeddings_protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
)
from kiln.server.errors import APIError, engine_error
from kiln.server.serving import Serving


def tokenize_inputs(sv: Serving, inputs: list[str | list[int]], param: str,
                    truncate: int | None = None) -> list[list[int]]:
    """Token ids of each input, checked against the vocabulary and the embedder's longest
    input (`truncate`: keep the last N tokens instead, vLLM's truncate_prompt_tokens)."""
    assert sv.embedder is not None
    limit = sv.embedder.wait_built().max_len
    if truncate is not None and truncate > limit:
        raise APIError(400, f"truncate_prompt_tokens is {truncate}; this model embeds at most "
                       f"{limit} tokens per input", param="truncate_prompt_tokens",
                       code="invalid_value")
    out: list[list[int]] = []
    for i, x in enumerate(inputs):
        if isinstance(x, str):
            ids = sv.tok.encode(x, add_special_tokens=True)
        else:
            bad = [t for t in x if not 0 <= t < sv.tok.vocab_size]
            if bad:
                raise APIError(400, f"token ids must be in [0, {sv.tok.vocab_size}), got "
                               f"{bad[:5]}", param=param, code="invalid_value")
            ids = list(x)
        if truncate is not None:
            ids = ids[-truncate:]
        elif len(ids) > limit:
            raise APIError(400, f"input {i} has {len(ids)} tokens; this model embeds at most "
                           f"{limit} tokens per input (its maximum context length). Shorten "
                           "it, or send truncate_prompt_tokens to keep its last tokens",
                           param=param, code="context_length_exceeded")
        if not ids:
            raise APIError(400, f"input {i} has no tokens", param=param, code="invalid_value")
        out.append(ids)
    return out


async def _embed(sv: Serving, ids: list[list[int]]) -> torch.Tensor:
    from kiln.kinds.embedding import EmbeddingOverloadedError

    assert sv.embedder is not None
    try:
        return await sv.embedder.embed(ids)
    except EmbeddingOverloadedError as e:
        raise APIError(503, e.message, code="overloaded") from e
    except Exception as e:
        raise engine_error(e) from e


def _dimensions(sv: Serving, vectors: torch.Tensor, dims: int | None) -> torch.Tensor:
    assert sv.embedder is not None
    emb = sv.embedder.wait_built()
    if dims is None or dims == emb.dim:
        return vectors
    p = emb.pooling
    allowed = dims < emb.dim and (p.any_dimensions or dims in (p.matryoshka or ()))
    if not allowed:
        which = (f"it supports {', '.join(map(str, p.matryoshka))}" if p.matryoshka else
                 "it is not a Matryoshka model (its config.json has no matryoshka_dimensions "
                 "nor is_matryoshka), so its vectors cannot be shortened")
        raise APIError(400, f"dimensions={dims}: this model's embeddings have {emb.dim} "
                       f"dimensions; {which}", param="dimensions", code="invalid_value")
    out = vectors[:, :dims]
    return torch.nn.functional.normalize(out, dim=-1) if p.normalize else out


def _encode(vec: torch.Tensor, fmt: str) -> list[float] | str:
    if fmt == "base64":  # OpenAI's: the little-endian float32 bytes, base64
        return base64.b64encode(vec.numpy().astype("<f4").tobytes()).decode("ascii")
    return vec.tolist()


def router(sv: Serving) -> APIRouter:
    """Under /v1, behind the API key."""
    r = APIRouter()

    @r.post("/embeddings")
    async def embeddings(req: EmbeddingRequest) -> Any:
        model = sv.check_model(req.model, kind="embed")
        ids = tokenize_inputs(sv, req.inputs(), "input", req.truncate_prompt_tokens)
        vectors = _dimensions(sv, await _embed(sv, ids), req.dimensions)
        n = sum(map(len, ids))
        resp = EmbeddingResponse(
            data=[EmbeddingData(index=i, embedding=_encode(v, req.encoding_format))
                  for i, v in enumerate(vectors)],
            model=model, usage=EmbeddingUsage(prompt_tokens=n, total_tokens=n))
        return JSONResponse(resp.model_dump(mode="json"))

    r.add_api_route("/rerank", rerank_endpoint(sv), methods=["POST"])
    return r


def rerank_endpoint(sv: Serving) -> Any:
    """POST /rerank: one handler, mounted under /v1 and at the root (vLLM serves both)."""

    async def rerank(req: RerankRequest) -> Any:
        model = sv.check_model(req.model, kind="embed")
        docs = req.texts()
        ids = tokenize_inputs(sv, [req.query, *docs], "documents")
        vectors = torch.nn.functional.normalize(await _embed(sv, ids), dim=-1)
        scores = (vectors[1:] @ vectors[0]).tolist()
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[:req.top_n or len(docs)]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=docs[i]) if req.return_documents
                                else None) for i in order]
        resp = RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=model, results=results,
                              usage=RerankUsage(total_tokens=sum(map(len, ids))))
        return JSONResponse(resp.model_dump(mode="json"))

    return rerank
