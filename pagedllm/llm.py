"""LLM: the offline entry point (``generate`` and ``chat``), vLLM-compatible."""

from __future__ import annotations

import time
from typing import Iterable, Sequence

from pagedllm.config import DEFAULT_MODEL, EngineConfig, engine_arg_names
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

PromptInput = str | list[int] | dict


class LLM:
    """Generate text for many prompts at once; every keyword is an :class:`~pagedllm.config.EngineConfig` field.

    Raises TypeError for an unknown keyword; ValueError for a bad value, unknown model or too small a cache.
    """

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs) -> None:
        from pagedllm.engine.pooling_engine import make_engine

        unknown = sorted(set(kwargs) - set(engine_arg_names()))
        if unknown:
            raise TypeError(f"LLM() got unknown options {unknown}; valid options: {', '.join(engine_arg_names())}")
        self.llm_engine = make_engine(EngineConfig(model=model, **kwargs))
        self._next_id = 0

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        """vLLM's ``collective_rpc``: ``method`` (a name or a callable) on every rank's runner; results in rank order.

        Raises TensorParallelWorkerError when a rank fails."""
        return self.llm_engine.executor.collective_rpc(method, args, kwargs)

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in input order; ``sampling_params``: one, or one per prompt;
        ``lora_request``: the adapter of every prompt, or one per prompt (None: the base model; needs
        ``enable_lora``).

        Raises ValueError, before anything runs, for an invalid prompt, parameter or adapter.
        """
        self._require_runner("generate")
        prompt_list = self._as_prompt_list(prompts)
        params_list = self._as_params_list(sampling_params, len(prompt_list))
        if priority is not None and not (isinstance(priority, (list, tuple))
                                         and all(isinstance(p, int) and not isinstance(p, bool) for p in priority)):
            raise ValueError(f"priority must be a list of ints (one per prompt); got {priority!r}")
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompt_list)} prompts")
        loras = self._as_lora_list(lora_request, len(prompt_list))
        ids = self._add_all(prompt_list, params_list, priority, loras)
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for one conversation or a list of them through the chat template (``tools`` included),
        under ``lora_request`` as :meth:`generate`.

        Raises ValueError for an empty conversation or an unknown role.
        """
        self._require_runner("generate")
        if not isinstance(messages, (list, tuple)):
            raise ValueError(f"messages must be a list of message dicts, or a list of such lists; "
                             f"got {type(messages).__name__}")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not convs:
            raise ValueError("messages must not be empty")
        engine = self.llm_engine
        prompts = []
        for conv in convs:
            ids = engine.apply_chat_template(conv, add_generation_prompt, chat_template, continue_final_message,
                                             tools=tools)
            prompts.append({"prompt_token_ids": ids, "prompt": engine.tokenizer.decode(ids)})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def embed(self, prompts, truncate_prompt_tokens: int | None = None, use_tqdm: bool = False):
        """One ``EmbeddingRequestOutput`` per prompt (``.outputs.embedding``: list of floats), in order."""
        from pagedllm.engine import pooling_tasks

        return pooling_tasks.embed(self._require_runner("pooling"), prompts, truncate_prompt_tokens)

    def classify(self, prompts, truncate_prompt_tokens: int | None = None, use_tqdm: bool = False):
        """One ``ClassificationRequestOutput`` (``.outputs.probs``) per prompt, for a classifier model."""
        from pagedllm.engine import pooling_tasks

        return pooling_tasks.classify(self._require_runner("pooling"), prompts, truncate_prompt_tokens)

    def score(self, text_1, text_2, truncate_prompt_tokens: int | None = None, use_tqdm: bool = False):
        """One ``ScoringRequestOutput`` (``.outputs.score``) per (text_1, text_2) pair: 1 x 1, 1 x N or
        N x N; a cross-encoder's score, or the cosine similarity of an embedding model's vectors."""
        from pagedllm.engine import pooling_tasks

        return pooling_tasks.score(self._require_runner("pooling"), text_1, text_2, truncate_prompt_tokens)

    def _require_runner(self, runner: str):
        """The engine, if it is ``runner``'s; else ValueError naming both runners."""
        actual = getattr(self.llm_engine, "runner_type", "generate")
        if actual != runner:
            raise ValueError(f"this model runs with runner={actual!r}; this call needs runner={runner!r} "
                             f"(pass runner= to LLM, or use a model of that kind)")
        return self.llm_engine

    @staticmethod
    def _as_prompt_list(prompts) -> list[PromptInput]:
        if prompts is None or isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
            raise ValueError("prompts must be a string, a token prompt dict, or a list of them; "
                             f"got {type(prompts).__name__}")
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]  # one prompt given as bare token ids
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts must not be empty")
        return prompts

    @staticmethod
    def _as_params_list(sp, n: int) -> list[SamplingParams]:
        if sp is None:
            sp = SamplingParams()
        if isinstance(sp, SamplingParams):
            return [sp] * n
        given = type(sp).__name__
        sp = list(sp) if isinstance(sp, Iterable) and not isinstance(sp, (str, dict)) else None
        if sp is None or not all(isinstance(p, SamplingParams) for p in sp):
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them (one per prompt); got {given}")
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} sampling_params for {n} prompts")
        return sp

    @staticmethod
    def _as_lora_list(lora_request, n: int) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * n
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else None
        if loras is None or not all(r is None or isinstance(r, LoRARequest) for r in loras):
            raise ValueError(f"lora_request must be a LoRARequest or a list of them (one per prompt); "
                             f"got {type(lora_request).__name__}")
        if len(loras) != n:
            raise ValueError(f"got {len(loras)} lora_request entries for {n} prompts")
        return loras

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter now (vLLM's ``add_lora``); False when already loaded. Raises LoRAError."""
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_name: str) -> LoRARequest:
        """Unload an adapter by name; LoRAError when unknown."""
        return self.llm_engine.remove_lora(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        return self.llm_engine.list_loras()

    def _add_all(self, prompts, params_list, priority, loras) -> list[str]:
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params_list)):
                sp = sp.clone()
                sp.output_kind = RequestOutputKind.FINAL_ONLY
                rid = str(self._next_id)
                self._next_id += 1
                text = prompt.get("prompt") if isinstance(prompt, dict) else None
                engine.add_request(rid, prompt, sp, priority=priority[i] if priority else 0, prompt_text=text,
                                   lora_request=loras[i])
                ids.append(rid)
        except ValueError as e:
            engine.abort_request(ids)  # nothing half-submitted stays behind
            raise ValueError(f"prompt {len(ids)}: {e}") from None
        return ids

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(ids)) if use_tqdm else None
        t0, num_out = time.perf_counter(), 0
        try:
            while pending and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        num_out += sum(len(c.token_ids) for c in out.outputs)
                        if bar is not None:
                            bar.update(1)
                            bar.set_postfix_str(f"{num_out / (time.perf_counter() - t0):.1f} tok/s output")
        except BaseException:
            engine.abort_request(list(pending))  # Ctrl-C or a crash must not leak blocks
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids if i in done]


def _progress_bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)
