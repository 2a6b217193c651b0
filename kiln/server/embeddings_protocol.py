"""Pydantic models of /v1/embeddings (OpenAI's shape) and /v1/rerank, /rerank (Jina / Cohere's)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from kiln.server.protocol import _Request, refusal

# OpenAI's cap on the inputs of one embeddings request.
MAX_EMBEDDING_INPUTS = 2048
EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(_Request):
    """POST /v1/embeddings (OpenAI's shape; `truncate_prompt_tokens` is vLLM's extra)."""

    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # Keep only the last N tokens of a longer input (vLLM's); without it a long input is a 400.
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)

    @field_validator("input")
    @classmethod
    def _non_empty(cls, v: EmbeddingInput) -> EmbeddingInput:
        items = [v] if isinstance(v, str) else v
        if not items or any(not x for x in items if isinstance(x, str | list)):
            raise refusal("empty_input", "input must not be empty (nor hold an empty string or list)")
        if len(items) > MAX_EMBEDDING_INPUTS and not all(isinstance(x, int) for x in items):
            raise refusal("request_limit_exceeded",
                          f"at most {MAX_EMBEDDING_INPUTS} inputs per request")
        return v

    def inputs(self) -> list[str | list[int]]:
        """Each input: a string, or a list of token ids."""
        v = self.input
        if isinstance(v, str):
            return [v]
        if all(isinstance(x, int) for x in v):
            return [list(v)]  # type: ignore[arg-type]
        return list(v)  # type: ignore[arg-type]


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    # float: the vector; base64: its little-endian float32 bytes (OpenAI's encoding).
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class RerankDocument(BaseModel):
    text: str


class RerankRequest(_Request):
    """POST /v1/rerank, /rerank (Jina / Cohere shape, as vLLM and llama-server take it)."""

    model: str | None = None
    query: str = Field(min_length=1)
    documents: list[str | RerankDocument] = Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int = 0


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage
    # How the scores were made: kiln ranks by the cosine similarity of embeddings (a
    # bi-encoder), not with a cross-encoder.
    scoring: str = "cosine similarity of the query's and each document's embeddings"
