"""The pooling runner's tasks on a :class:`~pagedllm.engine.pooling_engine.PoolingEngine`, as vLLM's
``LLM.embed`` / ``classify`` / ``score`` define them.

``score(text_1, text_2)`` pairs one with many or many with as many; with a cross-encoder each pair
is one input (``text_1 [SEP] text_2`` with token types), its score the classifier's sigmoid; with an
embedding model the score is the cosine similarity of the two texts' embeddings.
"""

from __future__ import annotations

import itertools

import torch.nn.functional as F

from pagedllm.outputs import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput,
                              EmbeddingRequestOutput, PoolingRequestOutput, ScoringOutput, ScoringRequestOutput)

_ids = itertools.count()


def as_prompt_list(prompts) -> list:
    """A string, token-id list or ``{"prompt_token_ids": [...]}`` -> a list of prompts (str or ids)."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and all(isinstance(t, int) for t in prompts)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty string, token-id list, or a list of them")
    return [p["prompt_token_ids"] if isinstance(p, dict) and "prompt_token_ids" in p else p for p in prompts]


def run_pooling(engine, task: str, encoded: list[tuple[list[int], list[int] | None]]) -> list[PoolingRequestOutput]:
    """Queue every encoded prompt for ``task`` and step until all are pooled, in order."""
    ids = [f"pool-{next(_ids)}" for _ in encoded]
    try:
        for rid, (tokens, types) in zip(ids, encoded):
            engine.add_request(rid, tokens, task, types)
    except ValueError:
        engine.abort_request(ids)
        raise
    return engine.run_to_completion(ids)


def embed(engine, prompts, truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
    encoded = [engine.encode_prompt(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in as_prompt_list(prompts)]
    return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.outputs.data.tolist()), o.prompt_token_ids)
            for o in run_pooling(engine, "embed", encoded)]


def classify(engine, prompts, truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
    encoded = [engine.encode_prompt(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in as_prompt_list(prompts)]
    return [ClassificationRequestOutput(o.request_id, ClassificationOutput(o.outputs.data.tolist()),
                                        o.prompt_token_ids) for o in run_pooling(engine, "classify", encoded)]


def score_pairs(text_1, text_2) -> list[tuple[str, str]]:
    """vLLM's pairing: 1 x 1, 1 x N, or N x N. Raises ValueError for other shapes."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second or not all(isinstance(t, str) for t in first + second):
        raise ValueError("text_1 and text_2 must be non-empty strings or lists of strings")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"text_1 has {len(first)} entries and text_2 {len(second)}: pass one text_1, "
                         f"or as many as text_2")
    return list(zip(first, second))


def score_plan(engine, text_1, text_2, truncate_prompt_tokens: int | None = None):
    """(task, encoded prompts, a function of their outputs in order -> one score per pair): a
    cross-encoder encodes each pair; an embedding model each distinct text once, scored by cosine."""
    pairs = score_pairs(text_1, text_2)
    if "score" in engine.tasks:
        encoded = [engine.encode_prompt(a, b, truncate_prompt_tokens) for a, b in pairs]
        return "score", encoded, lambda outs: [float(o.outputs.data[0]) for o in outs]
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    encoded = [engine.encode_prompt(t, truncate_prompt_tokens=truncate_prompt_tokens) for t in texts]

    def cosines(outs: list[PoolingRequestOutput]) -> list[float]:
        vectors = {t: o.outputs.data for t, o in zip(texts, outs)}
        return [float(F.cosine_similarity(vectors[a], vectors[b], dim=0)) for a, b in pairs]
    return "embed", encoded, cosines


def score(engine, text_1, text_2, truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
    task, encoded, combine = score_plan(engine, text_1, text_2, truncate_prompt_tokens)
    outs = run_pooling(engine, task, encoded)
    token_ids = [o.prompt_token_ids for o in outs] if task == "score" else [[] for _ in combine(outs)]
    return [ScoringRequestOutput(f"score-{next(_ids)}", ScoringOutput(s), ids)
            for s, ids in zip(combine(outs), token_ids)]
