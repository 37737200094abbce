"""LLMEngine: add requests, step, get outputs. Synchronous and single-threaded.

One step is three calls — ``Scheduler.schedule()`` → ``ModelRunner.execute_model()`` →
``Scheduler.update_from_output()`` — followed by detokenization in the OutputProcessor.
The engine knows nothing of HTTP; the async server front drives it from one thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, replace
from typing import Iterable

from pagedllm.config import EngineConfig
from pagedllm.core.kv_snapshot import KVCacheSnapshot
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.step_failure import StepFailure, positions_beyond
from pagedllm.engine.front_end import FrontEnd
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.step_failure import retry_output, without_requests
from pagedllm.lora.registry import LoRARegistry
from pagedllm.lora.request import LoRAError, LoRAInUseError, LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("pagedllm")


def child_request_id(request_id: str, index: int) -> str:
    """The scheduler's id of sample ``index`` of ``request_id``; injective, as the index follows
    the last ``#``."""
    return f"{request_id}#{index}"


@dataclass
class EngineStats:
    """A snapshot of the engine for metrics and status lines (counts; usage as a 0..1 fraction)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_used_blocks: int
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_preemptions_total: int
    prompt_tokens_total: int  # prompt tokens computed (excludes prefix-cache hits)
    generation_tokens_total: int
    num_steps: int
    kv_offload_io_errors_total: int = 0  # tier reads and writes that failed (each a miss)
    # speculative decoding (vLLM's spec_decode_* counters); per position: draft position 0 first
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()


class LLMEngine:
    """The synchronous engine. Raises ValueError when the model cannot be found or the KV cache
    cannot hold one sequence of ``max_model_len`` tokens."""

    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.executor import make_executor
        from pagedllm.loader import load_model_files

        if config.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size={config.data_parallel_size}: an LLMEngine (and LLM) is one replica; "
                             "replicas are served by `pagedllm serve --data-parallel-size N`")
        t0 = time.perf_counter()
        files = load_model_files(config.model, config.tokenizer)
        _check_generate_runner(config, files.hf_config)
        config = self._resolve_max_model_len(config, files.max_model_len)
        self.config = config
        self.model_files = files
        self.tokenizer = files.tokenizer
        self.model_name = config.model
        self.eos_token_id = files.eos_token_id
        self.extra_stop_token_ids = [t for t in files.stop_token_ids if t != files.eos_token_id]
        if config.tensor_parallel_size > 1:  # before any worker starts
            from pagedllm.distributed.parallel_state import heads_per_rank

            hf = files.hf_config
            heads_per_rank(hf.num_attention_heads, getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
                           config.tensor_parallel_size)
        # tensor_parallel_size > 1: worker processes hold the other shards; ``runner`` is rank 0's
        self.executor = make_executor(config, files)
        self.runner = self.executor.driver
        self.vocab_size = self.runner.vocab_size
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, config.max_model_len,
                                              config.max_logprobs, self.extra_stop_token_ids,
                                              config.chat_template_timeout_s)
        self.kv_cache_spec = self.executor.initialize_kv_cache()
        self.kv_offload_spec = self.executor.initialize_kv_offload()
        self.scheduler = Scheduler(config, self.kv_cache_spec.num_blocks,
                                   kv_cache_groups=self.kv_cache_spec.kv_cache_groups,
                                   kv_offload=self.kv_offload_spec, swap_space=self.executor.initialize_swap_space())
        self.output_processor = OutputProcessor(self.tokenizer)
        # scheduler request id -> the last prompt token's hidden state (return_hidden_states), until taken
        self.hidden_states: dict[str, list[float]] = {}
        self.structured_output = StructuredOutputManager(
            self.tokenizer, self.vocab_size, [t for t in [self.eos_token_id] if t is not None]
            + self.extra_stop_token_ids, config.max_num_seqs,
            compile_timeout_s=config.structured_outputs_compile_timeout_s,
            compile_memory_mb=config.structured_outputs_compile_memory_mb)
        self.drafter = self._make_drafter(config, self.vocab_size, self.kv_cache_spec.num_blocks)
        self._ids = itertools.count()
        self.lora_registry = LoRARegistry()
        for name, path in config.lora_module_paths().items():
            self.add_lora(self.lora_registry.new_request(name, path))
        self.num_steps = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        logger.info("engine ready: model %s (%s, %s on %s) in %.1f s; %s", config.model, files.format,
                    str(self.runner.dtype).replace("torch.", ""), self.runner.device, time.perf_counter() - t0,
                    self.kv_cache_spec.describe())

    @staticmethod
    def _make_drafter(config: EngineConfig, vocab_size: int, num_blocks: int):
        """The speculative-decoding drafter, or None when ``speculative_config`` is off; a draft
        model runs on this process's device (rank 0) with a cache sized from the target's ``num_blocks``."""
        spec = config.speculative
        if spec is None:
            return None
        from pagedllm.spec_decode.drafter import Drafter, make_proposer

        logger.info("speculative decoding: %s, up to %d draft tokens per step", spec.method,
                    spec.num_speculative_tokens)
        if spec.method == "draft_model":
            from pagedllm.worker.draft_model import DraftModelProposer

            return Drafter(spec, DraftModelProposer(config, spec, vocab_size, num_blocks))
        return Drafter(spec, make_proposer(spec))

    @staticmethod
    def _resolve_max_model_len(config: EngineConfig, model_len: int) -> EngineConfig:
        if config.max_model_len is None:
            return config.replace(max_model_len=model_len)
        if config.max_model_len > model_len:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context length {model_len}")
        return config

    # the front end's methods: they use only self.input_processor
    tokenize_prompt = FrontEnd.tokenize_prompt
    apply_chat_template = FrontEnd.apply_chat_template

    def front_end(self) -> FrontEnd:
        """This engine's tokenizer work, safe to use from one other thread while it steps (it
        shares only the tokenizer and the input processor's read-only checks)."""
        return FrontEnd(self.input_processor)

    def add_request(self, request_id: str | None, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0, prompt_text: str | None = None,
                    lora_request: LoRARequest | None = None) -> str:
        """Queue a request of ``params.n`` sequences; returns its id. A truncated prompt
        (``truncate_prompt_tokens``) is reported as the text kept. Raises ValueError, queueing
        nothing, for an empty prompt, a token id outside the vocabulary, a prompt (+ ``max_tokens``)
        past ``max_model_len``, a duplicate id, parameters the model cannot honour, or an adapter
        (``lora_request``, or ``params.lora_request``) that cannot be loaded (LoRAError).
        """
        params = self._with_lora(params or SamplingParams(), lora_request)
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.output_processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        processed = self.input_processor.process(prompt, params)
        ids, max_tokens, params = processed.token_ids, processed.max_tokens, processed.params
        if processed.is_truncated:  # the prompt reported is the one the model saw
            prompt_text = self.tokenizer.decode(ids, skip_special_tokens=False)
        elif prompt_text is None and isinstance(prompt, str):
            prompt_text = prompt
        spec = self.structured_output.validate(params) if params.structured_outputs is not None else None
        arrival = time.time() if arrival_time is None else arrival_time
        children = [
            Request(child_request_id(request_id, i), ids, params if params.n == 1 else params.child(i),
                    self.eos_token_id, arrival, priority, max_tokens=max_tokens,
                    parent_id=request_id if params.n > 1 else None)
            for i in range(params.n)
        ]
        for i, child in enumerate(children):
            try:
                self.scheduler.add_request(child)
            except ValueError:
                self.scheduler.abort_request([c.request_id for c in children[:i]])
                raise
        if spec is not None:
            for child in children:
                self.structured_output.add_request(child, spec)
        self.output_processor.add_request(request_id, prompt_text, children, params, arrival)
        return request_id

    def _with_lora(self, params: SamplingParams, lora_request: LoRARequest | None) -> SamplingParams:
        """``params`` carrying the request's adapter, loaded first if new (LoRAError when it cannot be)."""
        lora_request = lora_request or params.lora_request
        if lora_request is None:
            return params
        if not self.config.enable_lora:
            raise ValueError("lora_request needs an engine started with enable_lora")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        self.add_lora(lora_request)
        return params if params.lora_request is lora_request else replace(params, lora_request=lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter on every rank and name it; False when it is already loaded. Raises LoRAError
        naming the problem (nothing loaded), ValueError without ``enable_lora``."""
        if not self.config.enable_lora:
            raise ValueError("LoRA adapters need an engine started with enable_lora")
        if self.lora_registry.get(lora_request.lora_name) == lora_request:
            return False
        self.lora_registry.add(lora_request)  # checks the name and the id first
        try:
            self.executor.collective_rpc("add_lora", (lora_request,))
        except Exception:
            self.lora_registry.remove(lora_request.lora_name)
            self.executor.collective_rpc("remove_lora", (lora_request.lora_int_id,))
            raise
        return True

    def remove_lora(self, lora_name: str) -> LoRARequest:
        """Unload the adapter named ``lora_name``. Raises LoRAError when unknown, LoRAInUseError while
        unfinished requests run under it (nothing changes)."""
        lora_request = self.lora_registry.get(lora_name)
        if lora_request is None:
            raise LoRAError(f"no adapter named {lora_name!r} is loaded")
        users = [r.request_id for r in self.scheduler.requests.values()
                 if r.lora_int_id == lora_request.lora_int_id and not r.is_finished]
        if users:
            raise LoRAInUseError(f"adapter {lora_name!r} has {len(users)} unfinished requests; unload it when they end")
        self.lora_registry.remove(lora_name)
        self.executor.collective_rpc("remove_lora", (lora_request.lora_int_id,))
        return lora_request

    def list_loras(self) -> list[LoRARequest]:
        """The loaded adapters in load order."""
        return self.lora_registry.list()

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort user requests (unknown ids are ignored); their blocks are freed at once."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        child_ids = []
        for rid in request_ids:
            child_ids.extend(self.output_processor.remove_request(rid))
        if child_ids:
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            self.structured_output.remove_requests(child_ids)
            if self.drafter is not None:  # a draft model's cache blocks, at once too
                self.drafter.forget(child_ids)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of the requests it advanced."""
        grammar_failed = self._admit_compiled_grammars()
        t_step = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        bitmask = self.structured_output.grammar_bitmask(scheduler_output, self.scheduler.requests)
        t0 = time.perf_counter()
        runner_output = self._execute(scheduler_output, bitmask)
        self.hidden_states.update(runner_output.hidden_states)
        self._observe_prefill(scheduler_output, runner_output, time.perf_counter() - t0)
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        updated += self._advance_grammars(updated, runner_output, grammar_failed)
        processed = self.output_processor.process(updated, runner_output)
        if processed.stop_string_finished:
            self.scheduler.finish_requests(processed.stop_string_finished, RequestStatus.FINISHED_STOPPED)
            self.structured_output.remove_requests(processed.stop_string_finished)
        self._count(scheduler_output, runner_output)
        if self.drafter is not None:
            self.drafter.step(self.scheduler.running, [r for r in updated if r.is_finished], self.scheduler.step_cost)
            self.structured_output.validate_drafts(self.scheduler.running)
        # the step-cost model of the time-aware budget: the whole step, as a stream waits for it
        self.scheduler.observe_step_time(scheduler_output, time.perf_counter() - t_step)
        return processed.outputs

    def _admit_compiled_grammars(self) -> dict[str, str]:
        """Admit requests whose grammar compiled; returns failed compiles {id: error}. Waits briefly
        when nothing else is waiting, instead of spinning through empty steps."""
        so = self.structured_output
        if not so.has_pending():
            return {}
        sched = self.scheduler
        idle = not sched.running and all(r.status == RequestStatus.WAITING_FOR_GRAMMAR for r in sched.waiting)
        return so.update_ready(sched, block=idle)

    def _advance_grammars(self, updated: list[Request], ro: ModelRunnerOutput,
                          grammar_failed: dict[str, str]) -> list[Request]:
        """Advance matchers by this step's tokens; end requests whose grammar terminated (stop),
        was violated or failed to compile (error). Returns the ended ones ``updated`` lacks."""
        result = self.structured_output.accept_tokens(updated)
        if result.terminated:
            self.scheduler.finish_requests(result.terminated, RequestStatus.FINISHED_STOPPED)
        errors = {**grammar_failed, **result.rejected}
        if not errors:
            return []
        ro.failed.update(errors)
        ended = self.scheduler.finish_requests(list(errors), RequestStatus.FINISHED_ERROR)
        return [r for r in ended if r.request_id in grammar_failed]

    def _execute(self, so: SchedulerOutput, grammar_bitmask=None) -> ModelRunnerOutput:
        """Run the model; an exception fails only this step's requests, and the engine keeps serving.

        A tensor-parallel worker that died is fatal: every request is aborted (its blocks
        freed) and TensorParallelWorkerError propagates to the caller."""
        from pagedllm.errors import TensorParallelWorkerError

        num_computed = {r: self.scheduler.requests[r].num_computed_tokens for r in so.num_scheduled_tokens}
        culprits = positions_beyond(num_computed, so.num_scheduled_tokens, self.runner.model.max_positions)
        try:
            ro = self.executor.execute_model(without_requests(so, culprits) if culprits else so, grammar_bitmask)
        except TensorParallelWorkerError:
            self._abort_all()
            raise
        except StepFailure as f:
            logger.warning("%s; the other requests of the step run again", f)
            self._reset_runner()
            ro = retry_output(so, f.failed, self.scheduler.recompute_failed_loads(f.failed_loads))
        except Exception as e:  # noqa: BLE001
            logger.exception("step failed; failing its %d requests", len(so.num_scheduled_tokens))
            # runner state may be half-updated: drop it, the scheduler resends every request in full
            self._reset_runner()
            msg = f"{type(e).__name__}: {e}"
            return ModelRunnerOutput(failed={rid: msg for rid in so.num_scheduled_tokens})
        ro.failed.update(culprits)
        return ro

    def _reset_runner(self) -> None:
        from pagedllm.errors import TensorParallelWorkerError

        try:
            self.executor.reset_state()
        except TensorParallelWorkerError:
            self._abort_all()
            raise
        self.scheduler.reset_runner_state()

    def _observe_prefill(self, so: SchedulerOutput, ro: ModelRunnerOutput, seconds: float) -> None:
        """Feed the auto preemption mode the cost per token of prefill-heavy steps (>= 32 prompt
        tokens, so the per-step overhead does not dominate)."""
        num_drafts = sum(len(d) for d in so.scheduled_spec_decode_tokens.values())
        if so.total_num_scheduled_tokens - len(ro.req_ids) - num_drafts >= 32:
            self.scheduler.swap_space.observe_prefill(seconds, so.total_num_scheduled_tokens)

    def _abort_all(self) -> None:
        self.abort_request(list(self.output_processor.requests))

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any, and the grammar compile process (idempotent).
        The engine cannot step afterwards."""
        self.structured_output.shutdown()
        self.executor.shutdown()

    def _count(self, so: SchedulerOutput, ro: ModelRunnerOutput) -> None:
        self.num_steps += 1
        num_sampled = sum(len(t) for t in ro.sampled_token_ids)
        num_drafts = sum(len(so.scheduled_spec_decode_tokens.get(r, ())) for r in ro.req_ids)
        self.generation_tokens_total += num_sampled
        self.prompt_tokens_total += so.total_num_scheduled_tokens - len(ro.req_ids) - num_drafts
        if self.config.debug_integrity_checks:
            self.scheduler.check_integrity()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.output_processor.has_unfinished()

    def kv_cache_snapshot(self) -> KVCacheSnapshot:
        """The KV cache's blocks, block tables and recent events; engine thread, between steps."""
        return self.scheduler.kv_cache_snapshot(self.num_steps)

    def get_stats(self) -> EngineStats:
        s = self.scheduler.get_stats()
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting, kv_cache_usage=s.kv_cache_usage,
            num_used_blocks=s.num_used_blocks, num_free_blocks=s.num_free_blocks,
            num_total_blocks=self.kv_cache_spec.num_blocks,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions_total=s.num_preemptions, prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total, num_steps=self.num_steps,
            kv_offload_io_errors_total=self._kv_offload_io_errors(), **self._spec_decode_counts())

    def _spec_decode_counts(self) -> dict:
        spec = self.scheduler.spec_decoding_stats
        return dict(spec_decode_num_drafts=spec.num_drafts, spec_decode_num_draft_tokens=spec.num_draft_tokens,
                    spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
                    spec_decode_num_accepted_tokens_per_pos=tuple(spec.num_accepted_tokens_per_pos))

    def _kv_offload_io_errors(self) -> int:
        offload = self.scheduler.kv_cache_manager.offload
        return sum(offload.num_errors.values()) if offload is not None else 0


def _check_generate_runner(config: EngineConfig, hf_config) -> None:
    """An LLMEngine generates; an encoder-only model or ``runner='pooling'`` is a ValueError naming the
    runner (``make_engine`` / ``LLM`` / ``pagedllm serve`` build the pooling engine instead)."""
    from pagedllm.engine.pooling_engine import ENCODER_ARCHITECTURES

    arch = (getattr(hf_config, "architectures", None) or [None])[0]
    if arch in ENCODER_ARCHITECTURES:
        raise ValueError(f"runner: {config.model!r} is {arch}, an encoder-only architecture that cannot generate "
                         "text; an LLMEngine is runner='generate'. Use LLM(...) or make_engine(config), which pick "
                         "runner='pooling' for it, or PoolingEngine(config)")
    if config.runner == "pooling":
        raise ValueError("runner='pooling' is served by the pooling engine, not an LLMEngine: use LLM(...) or "
                         "make_engine(config)")
