"""A small fake engine with LLMEngine's API (fast, deterministic), shared by the engine and server tests.

The fake generates letters: child ``i`` of a request starts at ``'a' + i`` and counts up the alphabet, one
token per step; it ends by length. Its prompts go through the real InputProcessor on a character-level
tokenizer. It accounts KV blocks (block size 4) so aborts and leaks are visible, and can fail a step or die
on demand.
"""

from __future__ import annotations

import math
import re
import threading
import time
from dataclasses import dataclass

from pagedllm.config import EngineConfig
from pagedllm.engine.front_end import FrontEnd
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 4


class FakeTokenizer:
    """Character-level: id = ord(c) for ASCII; 0, 1, 2 are special (<eos>, <bos>, <end>), and their
    texts encode to them as in a real tokenizer. The chat template renders ``<bos>[role]content...``."""

    specials = {0: "<eos>", 1: "<bos>", 2: "<end>"}
    _special_ids = {text: i for i, text in specials.items()}
    chat_template = "fake"

    def __init__(self) -> None:
        self.on_encode = None  # called with the text before encoding it (a test makes it slow)
        self.encode_threads: list[str] = []  # the thread that encoded each text
        self.last_chat_template: str | None = None
        self.last_continue_final_message: bool | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encode_threads.append(threading.current_thread().name)
        if self.on_encode is not None:
            self.on_encode(text)
        parts = re.split("(<eos>|<bos>|<end>)", text)
        return [t for part in parts for t in ([self._special_ids[part]] if part in self._special_ids else
                                              [ord(c) if 3 <= ord(c) < 128 else ord("?") for c in part])]

    def apply_chat_template(self, messages, tools=None, tokenize=False, chat_template=None,
                            continue_final_message=False, add_generation_prompt=True) -> str:
        self.last_chat_template, self.last_continue_final_message = chat_template, continue_final_message
        turns = "".join(f"[{m['role']}]{m['content']}" for m in messages)
        return "<bos>" + turns + ("[assistant]" if add_generation_prompt else "")

    added_tokens_decoder = specials

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out = []
        for t in ids:
            if t in self.specials:
                if not skip_special_tokens:
                    out.append(self.specials[t])
            else:
                out.append(chr(t))
        return "".join(out)


@dataclass
class FakeStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_used_blocks: int = 0
    num_free_blocks: int = 64
    num_total_blocks: int = 64
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_steps: int = 0


class _Seq:
    def __init__(self, index: int, prompt_ids: list[int]) -> None:
        self.index = index
        self.token_ids: list[int] = []
        self.next_id = ord("a") + index
        self.finish_reason: str | None = None
        self.prompt_len = len(prompt_ids)


class _Req:
    def __init__(self, request_id, prompt, prompt_ids, params, arrival) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.seqs = [_Seq(i, prompt_ids) for i in range(params.n)]
        self.metrics = RequestMetrics(arrival)
        self.max_tokens = params.max_tokens


class FakeEngine:
    """LLMEngine's API on a letter generator. Not thread-safe, like the real one."""

    def __init__(self, max_model_len: int = 64, num_blocks: int = 64, max_num_seqs: int = 64,
                 step_s: float = 0.0, max_waiting_requests: int | None = None, max_logprobs: int = 5) -> None:
        self.config = EngineConfig(model="fake-model", max_model_len=max_model_len, num_kv_blocks=num_blocks,
                                   block_size=BLOCK_SIZE, max_num_seqs=max_num_seqs,
                                   max_waiting_requests=max_waiting_requests, max_logprobs=max_logprobs)
        self.tokenizer = FakeTokenizer()
        self.model_name = "fake-model"
        self.vocab_size = 128
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, max_model_len, max_logprobs, [])
        self.num_blocks = num_blocks
        self.step_s = step_s
        self.requests: dict[str, _Req] = {}
        self.order: list[str] = []
        self.fail_steps = 0  # the next N steps fail every request in them
        self.step_error = "RuntimeError: injected step failure"  # the failed requests' error
        self.die = False  # the next step raises
        self.step_thread: threading.Thread | None = None
        self.stats = FakeStats(num_total_blocks=num_blocks, num_free_blocks=num_blocks)
        self.prompt_seen: list[list[int]] = []
        self.added_at_step: list[int] = []  # engine steps run before each add_request

    # ---- prompts: the real input processor, as LLMEngine's
    def front_end(self) -> FrontEnd:
        return FrontEnd(self.input_processor)

    def tokenize_prompt(self, prompt, add_special_tokens: bool = True) -> list[int]:
        return self.input_processor.tokenize(prompt, add_special_tokens)

    def apply_chat_template(self, conversation, add_generation_prompt=True, chat_template=None,
                            continue_final_message=False, tools=None, template_kwargs=None) -> list[int]:
        return self.input_processor.render_chat(conversation, add_generation_prompt, chat_template,
                                                continue_final_message, tools, template_kwargs)

    @property
    def last_chat_template(self) -> str | None:
        return self.tokenizer.last_chat_template

    @property
    def last_continue_final_message(self) -> bool | None:
        return self.tokenizer.last_continue_final_message

    # ---- requests
    def add_request(self, request_id, prompt, params=None, arrival_time=None, priority=0, prompt_text=None):
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        processed = self.input_processor.process(prompt, params)
        ids, params = processed.token_ids, processed.params
        if processed.is_truncated:  # as LLMEngine: the prompt reported is the one the model saw
            prompt_text = self.tokenizer.decode(ids, skip_special_tokens=False)
        req = _Req(request_id, prompt_text if prompt_text is not None else (prompt if isinstance(prompt, str) else None),
                   ids, params, time.time() if arrival_time is None else arrival_time)
        req.max_tokens = processed.max_tokens
        self.requests[request_id] = req
        self.order.append(request_id)
        self.prompt_seen.append(ids)
        self.added_at_step.append(self.stats.num_steps)
        self.last_params, self.last_priority = params, priority
        return request_id

    def abort_request(self, request_ids) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            if self.requests.pop(rid, None) is not None:
                self.order.remove(rid)
        self._update_stats()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.step_thread = threading.current_thread()
        if self.die:
            raise RuntimeError("injected engine death")
        if self.step_s:
            time.sleep(self.step_s)
        running = self.order[:self.config.max_num_seqs]
        outputs = []
        failing = self.fail_steps > 0
        self.fail_steps = max(0, self.fail_steps - 1)
        now = time.time()
        for rid in list(running):
            req = self.requests[rid]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            if failing:
                outs = [CompletionOutput(s.index, "", [], None, None, "error") for s in req.seqs]
                outputs.append(RequestOutput(rid, req.prompt, req.prompt_ids, outs, True, metrics=req.metrics,
                                             error=self.step_error))
                self._remove(rid)
                continue
            outs = []
            for s in req.seqs:
                if s.finish_reason is not None:
                    continue
                tid = s.next_id
                s.next_id = ord("a") + (tid - ord("a") + 1) % 26
                s.token_ids.append(tid)
                self.stats.generation_tokens_total += 1
                if len(s.token_ids) >= req.max_tokens:
                    s.finish_reason = "length"
                lp = None
                if req.params.logprobs is not None:
                    lp = [{tid: Logprob(-0.25, 1, chr(tid)), ord("Z"): Logprob(-1.5, 2, "Z")}]
                outs.append(CompletionOutput(s.index, chr(tid), [tid], None, lp, s.finish_reason))
            finished = all(s.finish_reason is not None for s in req.seqs)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            prompt_lps = None
            if req.params.prompt_logprobs is not None:
                prompt_lps = [None] + [{t: Logprob(-2.0, 1, chr(t))} for t in req.prompt_ids[1:]]
            outputs.append(RequestOutput(rid, req.prompt, req.prompt_ids, outs, finished, prompt_lps,
                                         metrics=req.metrics))
            if finished:
                req.metrics.finished_time = now
                self._remove(rid)
        self.stats.num_steps += 1
        self._update_stats()
        return outputs

    def _remove(self, rid: str) -> None:
        self.requests.pop(rid)
        self.order.remove(rid)

    def used_blocks(self) -> int:
        return sum(math.ceil((len(r.prompt_ids) + len(s.token_ids)) / BLOCK_SIZE)
                   for r in self.requests.values() for s in r.seqs)

    def _update_stats(self) -> None:
        used = self.used_blocks()
        s = self.stats
        s.num_running = min(len(self.order), self.config.max_num_seqs)
        s.num_waiting = max(0, len(self.order) - self.config.max_num_seqs)
        s.num_used_blocks, s.num_free_blocks = used, self.num_blocks - used
        s.kv_cache_usage = used / self.num_blocks

    def get_stats(self) -> FakeStats:
        self._update_stats()
        return FakeStats(**vars(self.stats))
