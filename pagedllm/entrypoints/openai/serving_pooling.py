"""The pooling routes: ``POST /v1/embeddings`` (OpenAI), ``POST /v1/rerank`` and ``/rerank``
(Jina/Cohere), ``POST /score`` (vLLM), on an :class:`~pagedllm.engine.async_pooling_engine.AsyncPoolingEngine`.

With a cross-encoder a score is its classifier's sigmoid; with an embedding model the cosine
similarity of the two pooled vectors. Against a generation model every route is a 400 naming the
runner; errors are OpenAI's error shape.
"""

from __future__ import annotations

import base64
import itertools

import numpy as np
import torch.nn.functional as F
from fastapi import APIRouter
from fastapi.responses import Response

from pagedllm.engine.pooling_tasks import score_plan
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol_pooling import (
    EmbeddingData, EmbeddingRequest, EmbeddingResponse, PoolingUsage, RerankDocument, RerankRequest, RerankResponse,
    RerankResult, ScoreData, ScoreRequest, ScoreResponse)
from pagedllm.entrypoints.openai.serving_base import OpenAIServing, json_response


class OpenAIServingPooling(OpenAIServing):
    _labels = itertools.count()

    def _pooling_engine(self, route: str, task: str):
        """The PoolingEngine behind the async front, or a 400 naming the runner / the tasks served."""
        if getattr(self.engine, "runner_type", "generate") != "pooling":
            raise APIError(400, f"{route}: the model {self.model_name!r} runs with runner='generate'; serve an "
                                f"embedding or cross-encoder model (runner='pooling'), e.g. all-minilm-l6-v2")
        if task not in self.engine.tasks and not (task == "score" and "embed" in self.engine.tasks):
            raise APIError(400, f"{route}: the model {self.model_name!r} serves {', '.join(self.engine.tasks)}, "
                                f"not {task}")
        return self.engine.engine

    async def embed(self, body: EmbeddingRequest) -> EmbeddingResponse:
        self.check_model(body.model)
        engine = self._pooling_engine("/v1/embeddings", "embed")
        dims = self._check_dimensions(engine, body.dimensions)
        inputs = _as_inputs(body.input)
        try:
            encoded = [engine.encode_prompt(p, truncate_prompt_tokens=body.truncate_prompt_tokens) for p in inputs]
        except ValueError as e:
            raise APIError(400, str(e), "input") from None
        outs = await self.engine.encode(f"embd-{next(self._labels)}", "embed", encoded)
        data = []
        for i, out in enumerate(outs):
            vector = out.outputs.data
            if dims is not None:
                vector = F.normalize(vector[:dims], dim=0) if engine.pooler.normalize else vector[:dims]
            data.append(EmbeddingData(index=i, embedding=_encode(vector.numpy(), body.encoding_format)))
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        return EmbeddingResponse(model=self.model_name, data=data,
                                 usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens))

    @staticmethod
    def _check_dimensions(engine, dimensions: int | None) -> int | None:
        if dimensions is None:
            return None
        config = engine.model_files.hf_config
        if not (getattr(config, "is_matryoshka", False) or getattr(config, "matryoshka_dimensions", None)):
            raise APIError(400, f"dimensions: the model does not support Matryoshka truncation; leave dimensions "
                                f"unset (it returns {engine.hidden_size})", "dimensions")
        allowed = getattr(config, "matryoshka_dimensions", None)
        if dimensions > engine.hidden_size or (allowed and dimensions not in allowed):
            raise APIError(400, f"dimensions must be one of {allowed or f'1..{engine.hidden_size}'}, got {dimensions}",
                           "dimensions")
        return dimensions

    async def scores(self, route: str, text_1, text_2, truncate: int | None) -> tuple[list[float], int]:
        """One score per (text_1, text_2) pair, and the prompt tokens computed."""
        engine = self._pooling_engine(route, "score")
        try:
            task, encoded, combine = score_plan(engine, text_1, text_2, truncate)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        outs = await self.engine.encode(f"score-{next(self._labels)}", task, encoded)
        return combine(outs), sum(len(o.prompt_token_ids) for o in outs)

    async def rerank(self, body: RerankRequest, route: str) -> RerankResponse:
        self.check_model(body.model)
        scores, tokens = await self.scores(route, body.query, body.documents, body.truncate_prompt_tokens)
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=body.documents[i]) if body.return_documents else None)
                   for i in ranked]
        return RerankResponse(model=self.model_name, results=results,
                              usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens))

    async def score(self, body: ScoreRequest) -> ScoreResponse:
        self.check_model(body.model)
        scores, tokens = await self.scores("/score", body.text_1, body.text_2, body.truncate_prompt_tokens)
        return ScoreResponse(model=self.model_name, data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens))


def _as_inputs(value) -> list:
    """OpenAI's ``input``: a string, strings, token ids, or lists of token ids -> a list of prompts."""
    if isinstance(value, str) or (value and all(isinstance(t, int) for t in value)):
        return [value]
    if not value:
        raise APIError(400, "input must not be empty", "input")
    return list(value)


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def pooling_router(engine, served_model_names: list[str], error_responses: dict) -> APIRouter:
    """The pooling routes for ``engine``, to include in the app; ``error_responses``: the error
    statuses the document lists for each (``openapi.errors(...)``)."""
    serving = OpenAIServingPooling(engine, served_model_names)
    router = APIRouter(tags=["pooling"])

    @router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=error_responses)
    async def create_embedding(body: EmbeddingRequest) -> Response:
        return json_response(await serving.embed(body))

    @router.post("/v1/rerank", response_model=RerankResponse, responses=error_responses)
    async def rerank_v1(body: RerankRequest) -> Response:
        return json_response(await serving.rerank(body, "/v1/rerank"))

    @router.post("/rerank", response_model=RerankResponse, responses=error_responses)
    async def rerank(body: RerankRequest) -> Response:
        return json_response(await serving.rerank(body, "/rerank"))

    @router.post("/score", response_model=ScoreResponse, responses=error_responses)
    async def score(body: ScoreRequest) -> Response:
        return json_response(await serving.score(body))

    return router
