"""Request and response bodies of the pooling routes: OpenAI's ``/v1/embeddings``, the Jina/Cohere
``/v1/rerank`` and vLLM's ``/score``."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import Field

from pagedllm.entrypoints.openai.protocol import OpenAIBase

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class PoolingUsage(OpenAIBase):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingRequest(OpenAIBase):
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = None


class EmbeddingData(OpenAIBase):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class _PoolingList(OpenAIBase):
    """The envelope of the embedding and score responses: ``data`` holds one entry per input."""
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: PoolingUsage


class EmbeddingResponse(_PoolingList):
    id: str = Field(default_factory=lambda: f"embd-{uuid.uuid4().hex}")
    data: list[EmbeddingData]


class RerankRequest(OpenAIBase):
    model: str | None = None
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None


class RerankDocument(OpenAIBase):
    text: str


class RerankResult(OpenAIBase):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(OpenAIBase):
    id: str = Field(default_factory=lambda: f"rerank-{uuid.uuid4().hex}")
    model: str
    results: list[RerankResult]
    usage: PoolingUsage


class ScoreRequest(OpenAIBase):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None


class ScoreData(OpenAIBase):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(_PoolingList):
    id: str = Field(default_factory=lambda: f"score-{uuid.uuid4().hex}")
    data: list[ScoreData]
