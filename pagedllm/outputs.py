"""User-facing outputs (vLLM-compatible): RequestOutput, CompletionOutput, Logprob; the pooling runner's
PoolingRequestOutput and its embedding, classification and scoring forms."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Natural-log probability of one token at one position; ``rank`` 1 is the most likely."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# token id → Logprob (top-k plus the chosen token)
PositionLogprobs = dict[int, Logprob]


@dataclass
class RequestMetrics:
    """One request's timings (``time.time()`` seconds), cached prompt tokens and preemptions."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    preemption_modes: list[str] = field(default_factory=list)  # "recompute" / "swap", one per preemption
    # by the tier their K/V came from ("pool", "host", "disk"); sums to num_cached_tokens
    cached_tokens_by_tier: dict[str, int] | None = None
    # speculative decoding, all n sequences: draft tokens verified, and those accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None:
            return None
        return self.finished_time - self.first_token_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One generated sequence (index i of a request's n samples)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop token id or string that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The output of one request (all n samples), streamed or final."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the request failed inside the engine


@dataclass
class PoolingOutput:
    """``data``: the pooled vector (hidden_size,) or class scores (num_labels,), float32 on CPU."""

    data: object  # torch.Tensor; typed loosely so this module does not import torch


@dataclass
class PoolingRequestOutput:
    """The output of one pooling request (vLLM's name); ``error`` is set when it failed in the engine."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    error: str | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]  # softmax over the labels

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float  # a cross-encoder's sigmoid output, or the cosine similarity of two embeddings


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
