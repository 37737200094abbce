"""PoolingEngine: prompt tokens in, one pooled vector (embedding) or class scores out (vLLM's
``runner="pooling"``).

An encoder sees each prompt whole, in one step, and keeps no KV cache: no blocks are allocated.
Requests wait in arrival order; each step packs as many as fit the scheduler's token budget
(``EngineConfig.token_budget``, at most ``max_num_seqs``) back to back without padding, runs
the model once and pools every request, so new requests join the next step (continuous batching).
A step that raises fails only its own requests.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedllm.config import EngineConfig
from pagedllm.models.pooler import Pooler
from pagedllm.outputs import PoolingOutput, PoolingRequestOutput

logger = logging.getLogger("pagedllm")

ENCODER_ARCHITECTURES = ("BertModel", "BertForSequenceClassification")
CLASSIFIER_ARCHITECTURES = ("BertForSequenceClassification",)


def select_runner(config: EngineConfig) -> str:
    """``config.runner`` resolved: ``pooling`` or ``generate``. Auto picks pooling for encoder-only
    architectures and sentence-transformers folders. Raises ValueError for a runner the model cannot run."""
    from pagedllm.loader import resolve_model
    from pagedllm.loader.sentence_transformers_config import is_sentence_transformers_folder

    resolved = resolve_model(config.model)
    arch = _architecture(resolved.path) if resolved.format == "hf" else None
    is_encoder = arch in ENCODER_ARCHITECTURES
    if config.runner == "auto":
        return "pooling" if is_encoder or (resolved.format == "hf" and is_sentence_transformers_folder(
            resolved.path)) else "generate"
    if config.runner == "generate" and is_encoder:
        raise ValueError(f"runner='generate': {arch} is an encoder-only architecture and cannot generate text; "
                         f"use runner='pooling'")
    return config.runner  # pooling on a decoder: its last token's hidden state (DecoderPoolingEngine)


def is_encoder_model(config: EngineConfig) -> bool:
    """Whether ``config.model`` is an encoder-only architecture (the pooling engine runs it whole)."""
    from pagedllm.loader import resolve_model

    resolved = resolve_model(config.model)
    return resolved.format == "hf" and _architecture(resolved.path) in ENCODER_ARCHITECTURES


def _architecture(folder: Path) -> str | None:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return (config.get("architectures") or [None])[0]


@dataclass
class _PoolingRequest:
    request_id: str
    token_ids: list[int]
    token_type_ids: list[int] | None
    task: str
    arrival_time: float = field(default_factory=time.time)


class PoolingEngine:
    """The pooling runner's engine. ``tasks``: ``("embed",)`` for an embedding model (a score is
    the cosine of two embeddings), ``("classify", "score")`` for a cross-encoder. Raises ValueError
    for a model or option it cannot run (tensor parallelism, quantization, a length past the model's)."""

    runner_type = "pooling"  # LLM checks it; an LLMEngine has none (generate)

    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.loader import load_model_files
        from pagedllm.models.registry import get_model_class
        from pagedllm.utils import resolve_device
        from pagedllm.worker.model_runner import resolve_dtype

        if config.tensor_parallel_size > 1 or config.data_parallel_size > 1 or config.quantization:
            raise ValueError("runner='pooling' runs one unquantized rank: tensor_parallel_size, "
                             "data_parallel_size and quantization must stay at their defaults")
        t0 = time.perf_counter()
        files = load_model_files(config.model, config.tokenizer)
        if files.checkpoint_quantization is not None:
            raise ValueError(f"runner='pooling' runs float weights; {config.model!r} is pre-quantized "
                             f"({files.checkpoint_quantization.describe()})")
        self.model_files, self.tokenizer, self.model_name = files, files.tokenizer, config.model
        self.pooler, st_max_len = self._pooler(Path(files.source), config.pooler_config)
        self.config = config = self._resolve_max_model_len(config, files.max_model_len, st_max_len)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        with torch.device(self.device):
            self.model = get_model_class(files.hf_config)(files.hf_config).to(self.dtype)
        self.model.load_weights(files.weights(self.dtype))
        self.model.eval()
        arch = files.hf_config.architectures[0]
        self.tasks = ("classify", "score") if arch in CLASSIFIER_ARCHITECTURES else ("embed",)
        self.num_labels = int(getattr(files.hf_config, "num_labels", 0) or 0)
        self.hidden_size = int(files.hf_config.hidden_size)
        self.vocab_size = int(files.hf_config.vocab_size)
        self.waiting: deque[_PoolingRequest] = deque()
        self._ids = itertools.count()
        self.num_steps = self.num_requests_total = self.prompt_tokens_total = 0
        logger.info("pooling engine ready: model %s (%s, %s on %s, %s) in %.1f s", config.model, arch,
                    str(self.dtype).replace("torch.", ""), self.device, ", ".join(self.tasks),
                    time.perf_counter() - t0)

    @staticmethod
    def _pooler(folder: Path, pooler_config: str | dict | None, default: str = "CLS") -> tuple[Pooler, int | None]:
        """The pooling of sentence-transformers' files, overridden by ``pooler_config``; else ``default``
        normalized (vLLM's defaults: CLS for BERT embedders, LAST for decoders)."""
        from pagedllm.loader.sentence_transformers_config import (is_sentence_transformers_folder,
                                                                  read_sentence_transformers_config)

        pooling_type, normalize, max_len = default, True, None
        if folder.is_dir() and is_sentence_transformers_folder(folder):
            st = read_sentence_transformers_config(folder)
            pooling_type, normalize, max_len = st.pooling_type, st.normalize, st.max_seq_length
        if pooler_config is not None:
            override = _parse_pooler_config(pooler_config)
            pooling_type = str(override.get("pooling_type", pooling_type)).upper()
            normalize = bool(override.get("normalize", normalize))
        return Pooler(pooling_type, normalize), max_len

    @staticmethod
    def _resolve_max_model_len(config: EngineConfig, model_len: int, st_len: int | None) -> EngineConfig:
        if config.max_model_len is None:
            return config.replace(max_model_len=min(model_len, st_len or model_len))
        if config.max_model_len > model_len:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context length {model_len}")
        return config

    # ------------------------------------------------------------------ inputs
    def encode_prompt(self, prompt: str | list[int], text_pair: str | None = None,
                      truncate_prompt_tokens: int | None = None) -> tuple[list[int], list[int] | None]:
        """(token ids, token type ids or None) of a text (or text pair), or of given token ids.

        ``truncate_prompt_tokens``: keep at most that many tokens (-1: ``max_model_len``); text is cut
        by the tokenizer (its special tokens kept), token ids keep their last ones. Without it, a
        prompt past ``max_model_len`` raises ValueError naming both lengths.
        """
        limit = self._truncation_limit(truncate_prompt_tokens)
        if isinstance(prompt, str):
            if not prompt and text_pair is None:
                raise ValueError("prompt must not be empty")
            enc = self.tokenizer(prompt, text_pair, truncation=limit is not None, max_length=limit)
            ids, types = list(enc["input_ids"]), enc.get("token_type_ids")
        else:
            ids = _token_ids(prompt, self.vocab_size)
            ids, types = (ids[-limit:] if limit is not None else ids), None
        if len(ids) > self.config.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than max_model_len={self.config.max_model_len}; "
                             f"shorten it or pass truncate_prompt_tokens")
        return ids, (list(types) if types is not None else None)

    def _truncation_limit(self, truncate_prompt_tokens: int | None) -> int | None:
        if truncate_prompt_tokens is None:
            return None
        if isinstance(truncate_prompt_tokens, bool) or not isinstance(truncate_prompt_tokens, int) \
                or truncate_prompt_tokens == 0 or truncate_prompt_tokens < -1:
            raise ValueError(f"truncate_prompt_tokens must be -1 or a positive integer, got {truncate_prompt_tokens!r}")
        return self.config.max_model_len if truncate_prompt_tokens == -1 else min(truncate_prompt_tokens,
                                                                                   self.config.max_model_len)

    def add_request(self, request_id: str | None, token_ids: list[int], task: str = "embed",
                    token_type_ids: list[int] | None = None) -> str:
        """Queue encoded tokens (see :meth:`encode_prompt`) for ``task``; returns the request id.
        Raises ValueError for a task this model does not serve, empty or too long token ids."""
        if task not in self.tasks:
            raise ValueError(f"task {task!r} is not served by {self.model_name!r} (it serves {', '.join(self.tasks)})")
        if not token_ids or len(token_ids) > self.config.max_model_len:
            raise ValueError(f"a request needs 1..{self.config.max_model_len} tokens, got {len(token_ids)}")
        if token_type_ids is not None and len(token_type_ids) != len(token_ids):
            raise ValueError("token_type_ids must have one entry per token")
        request_id = str(next(self._ids)) if request_id is None else request_id
        self.waiting.append(_PoolingRequest(request_id, list(token_ids), token_type_ids, task))
        return request_id

    def abort_request(self, request_ids) -> None:
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        self.waiting = deque(r for r in self.waiting if r.request_id not in ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    # ------------------------------------------------------------------ step
    def step(self) -> list[PoolingRequestOutput]:
        """Run the next batch; returns one finished output per request in it (``error`` set, no
        data, when the model raised)."""
        batch = self._next_batch()
        if not batch:
            return []
        try:
            data = self._run(batch)
            errors = [None] * len(batch)
        except Exception as e:  # noqa: BLE001  one failed step fails its requests only
            logger.exception("pooling step failed; failing its %d requests", len(batch))
            data, errors = [None] * len(batch), [f"{type(e).__name__}: {e}"] * len(batch)
        self.num_steps += 1
        self.num_requests_total += len(batch)
        self.prompt_tokens_total += sum(len(r.token_ids) for r in batch)
        return [PoolingRequestOutput(r.request_id, PoolingOutput(d), r.token_ids, True, error=err)
                for r, d, err in zip(batch, data, errors)]

    def _next_batch(self) -> list[_PoolingRequest]:
        budget, batch, tokens = self.config.token_budget, [], 0
        while self.waiting and len(batch) < self.config.max_num_seqs:
            n = len(self.waiting[0].token_ids)
            if batch and tokens + n > budget:
                break
            batch.append(self.waiting.popleft())
            tokens += n
        return batch

    @torch.inference_mode()
    def _run(self, batch: list[_PoolingRequest]) -> list[torch.Tensor]:
        seq_lens = [len(r.token_ids) for r in batch]
        dev = self.device
        input_ids = torch.tensor([t for r in batch for t in r.token_ids], dtype=torch.long, device=dev)
        positions = torch.cat([torch.arange(n, device=dev) for n in seq_lens])
        types = torch.tensor([t for r in batch for t in (r.token_type_ids or [0] * len(r.token_ids))],
                             dtype=torch.long, device=dev)
        hidden = self.model(input_ids, positions, seq_lens, types)
        if "embed" in self.tasks:
            return list(self.pooler(hidden, seq_lens).float().cpu())
        logits = self.model.classify(hidden, seq_lens).float().cpu()
        return [torch.sigmoid(row) if r.task == "score" and self.num_labels == 1 else row.softmax(-1)
                for r, row in zip(batch, logits)]

    def run_to_completion(self, request_ids: list[str]) -> list[PoolingRequestOutput]:
        """Step until every id in ``request_ids`` is done; outputs in their order. Raises ValueError
        for a failed request (the others are aborted)."""
        pending, done = set(request_ids), {}
        try:
            while pending and self.has_unfinished_requests():
                for out in self.step():
                    if out.request_id in pending:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
        finally:
            self.abort_request(pending)
        failed = [o for o in done.values() if o.error]
        if failed:
            raise ValueError(f"request {failed[0].request_id} failed: {failed[0].error}")
        return [done[i] for i in request_ids]

    def get_stats(self):
        """An ``EngineStats`` snapshot: waiting requests and prompt tokens; no KV cache (all zeros)."""
        from pagedllm.engine.llm_engine import EngineStats

        return EngineStats(num_running=0, num_waiting=len(self.waiting), kv_cache_usage=0.0, num_used_blocks=0,
                           num_free_blocks=0, num_total_blocks=0, prefix_cache_queries=0, prefix_cache_hits=0,
                           num_preemptions_total=0, prompt_tokens_total=self.prompt_tokens_total,
                           generation_tokens_total=0, num_steps=self.num_steps)

    def shutdown(self) -> None:
        pass


def _parse_pooler_config(value: str | dict) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"pooler_config must be a JSON object, got {value!r}: {e}") from None
    unknown = set(value) - {"pooling_type", "normalize"} if isinstance(value, dict) else None
    if unknown is None or unknown:
        raise ValueError(f"pooler_config takes pooling_type and normalize, got {value!r}")
    return value


def _token_ids(prompt, vocab_size: int) -> list[int]:
    if not isinstance(prompt, (list, tuple)) or not prompt or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise ValueError("a token prompt must be a non-empty list of integer token ids")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    return list(prompt)


def make_engine(config: EngineConfig):
    """The engine ``config`` asks for: a :class:`PoolingEngine` (encoders), a ``DecoderPoolingEngine``
    (a decoder with runner='pooling') or an ``LLMEngine`` (which refuses ``data_parallel_size > 1``
    before the model is looked up: one engine is one replica)."""
    if config.data_parallel_size == 1 and select_runner(config) == "pooling":
        if is_encoder_model(config):
            return PoolingEngine(config)
        from pagedllm.engine.decoder_pooling import DecoderPoolingEngine

        return DecoderPoolingEngine(config)
    from pagedllm.engine.llm_engine import LLMEngine

    return LLMEngine(config)
