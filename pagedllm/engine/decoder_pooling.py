"""DecoderPoolingEngine: a decoder (Llama, Qwen, Mistral... families) as an embedder (vLLM's
``runner="pooling"`` on a causal LM, as Qwen3-Embedding and e5-mistral): the embedding is the final
hidden state of the prompt's last token (LAST pooling), normalized by default.

It runs on an ``LLMEngine``: each request is a prompt with ``max_tokens=1`` whose runner returns that
hidden state at the first sample, so it shares the paged KV cache, continuous batching, chunked prefill
and the prefix cache (a repeated prefix is not recomputed) with generation. One position of
``max_model_len`` stays for the sampled token the generation path needs, so prompts are at most
``max_model_len - 1`` tokens.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.pooling_engine import PoolingEngine
from pagedllm.outputs import PoolingOutput, PoolingRequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("pagedllm")


class DecoderPoolingEngine(PoolingEngine):
    """:class:`PoolingEngine`'s API (``encode_prompt``, ``add_request``, ``step``, ``run_to_completion``)
    over an ``LLMEngine``; ``tasks`` is ``("embed",)``. Raises ValueError for a pooling other than LAST."""

    def __init__(self, config: EngineConfig) -> None:
        if config.data_parallel_size > 1:
            raise ValueError("runner='pooling' runs one replica: data_parallel_size must stay 1")
        self.pooler, _ = self._pooler(_folder(config.model), config.pooler_config, default="LAST")
        if self.pooler.pooling_type != "LAST":
            raise ValueError(f"pooler_config: a decoder embedder pools its last token (LAST); "
                             f"{self.pooler.pooling_type} needs every token's hidden state")
        self.engine = LLMEngine(config.replace(runner="generate"))
        self.model_files, self.tokenizer, self.model_name = self.engine.model_files, self.engine.tokenizer, config.model
        self.config = self.engine.config.replace(max_model_len=self.engine.config.max_model_len - 1)
        self.tasks = ("embed",)
        self.num_labels = 0
        self.hidden_size = int(self.model_files.hf_config.hidden_size)
        self.vocab_size = self.engine.vocab_size
        self._prompts: dict[str, list[int]] = {}
        self.num_steps = self.num_requests_total = self.prompt_tokens_total = 0
        logger.info("pooling runner on the decoder %s: LAST pooling%s", config.model,
                    ", normalized" if self.pooler.normalize else "")

    def add_request(self, request_id: str | None, token_ids: list[int], task: str = "embed",
                    token_type_ids: list[int] | None = None) -> str:
        if task not in self.tasks:
            raise ValueError(f"task {task!r} is not served by {self.model_name!r} (it serves embed)")
        if not token_ids or len(token_ids) > self.config.max_model_len:
            raise ValueError(f"a request needs 1..{self.config.max_model_len} tokens, got {len(token_ids)}")
        params = SamplingParams(max_tokens=1, temperature=0.0, return_hidden_states=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        request_id = self.engine.add_request(request_id, {"prompt_token_ids": list(token_ids)}, params)
        self._prompts[request_id] = list(token_ids)
        return request_id

    def abort_request(self, request_ids) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.engine.abort_request(ids)
        for rid in ids:
            if self._prompts.pop(rid, None) is not None:
                self.engine.hidden_states.pop(f"{rid}#0", None)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> list[PoolingRequestOutput]:
        """One engine step; the requests whose prompt finished, pooled (``error`` set when one failed)."""
        outputs = []
        for out in self.engine.step():
            if not out.finished or out.request_id not in self._prompts:
                continue
            tokens = self._prompts.pop(out.request_id)
            hidden = self.engine.hidden_states.pop(f"{out.request_id}#0", None)
            if hidden is None:
                reason = out.outputs[0].finish_reason if out.outputs else None
                outputs.append(PoolingRequestOutput(out.request_id, PoolingOutput(None), tokens, True,
                                                    error=f"the request ended without its hidden state ({reason})"))
                continue
            vector = torch.tensor(hidden, dtype=torch.float32)
            outputs.append(PoolingRequestOutput(out.request_id, PoolingOutput(
                F.normalize(vector, dim=0) if self.pooler.normalize else vector), tokens))
        if outputs:
            self.num_steps += 1
            self.num_requests_total += len(outputs)
            self.prompt_tokens_total += sum(len(o.prompt_token_ids) for o in outputs)
        return outputs

    def get_stats(self):
        """The LLMEngine's stats (its KV cache, prefix-cache hits)."""
        return self.engine.get_stats()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _folder(model: str) -> Path:
    from pagedllm.loader import resolve_model

    resolved = resolve_model(model)
    return Path(resolved.path) if resolved.format == "hf" else Path(resolved.path).parent
