"""``POST /v1/completions``: prompts as text, texts, token ids or lists of token ids.

Every check (model, parameters, prompt length, token ids) and the engine's admission happen before the first
streamed byte, so a bad streamed request is a plain 400. Choices are numbered ``prompt_index * n + sample_index``;
``echo`` leads each choice with the prompt (and its logprobs, ``token_logprobs[0]`` null); ``text_offset`` comes
from the concatenated token texts (as vLLM and OpenAI).
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from fastapi.responses import Response, StreamingResponse

from pagedllm.engine.async_engine import EngineInput
from pagedllm.engine.request_stream import merge_streams
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.generation_defaults import apply_generation_defaults
from pagedllm.entrypoints.openai.protocol import (
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, CompletionStreamResponse,
    finite_logprob, make_prompt_logprobs, make_usage)
from pagedllm.entrypoints.openai.serving_base import (
    OpenAIServing, guarded_sse, json_response, raise_if_failed, sse)
from pagedllm.outputs import CompletionOutput, PositionLogprobs, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    """Handler of ``/v1/completions``.

    Args (beyond OpenAIServing's): max_prompts: most prompts in one request (400 beyond).
    """

    def __init__(self, *args: Any, max_prompts: int = 1024, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_prompts = max_prompts

    async def create_completion(self, req: CompletionRequest) -> Response:
        """Validate, submit and answer one completions request (JSON or SSE).

        Raises APIError (404 unknown model, 400 invalid input, 503 overloaded or engine
        down, 500 failure inside the engine) before any streamed byte.
        """
        self.check_model(req.model)
        self.check_n(req.n)
        apply_generation_defaults(req, self.sampling_defaults)
        params = self.params_for_model(req.to_sampling_params(), req.model)
        prompts = await self._engine_prompts(req)
        request_id = self.new_id("cmpl", req.request_id)
        streams = await self.add_requests(self.label(request_id, req.user), prompts, params, req.priority)
        created = int(time.time())
        if req.stream:
            return StreamingResponse(guarded_sse(self._events(req, request_id, created, streams, prompts), streams),
                                     media_type="text/event-stream")
        finals = await self.collect_final(streams)
        return json_response(self._response(req, request_id, created, finals, prompts))

    async def _engine_prompts(self, req: CompletionRequest) -> list[EngineInput]:
        """One engine input per prompt of the request (text prompts are tokenized on the front-end
        thread: here in one call when special tokens must not be added, else by ``add_requests``)."""
        p = req.prompt
        if not p:
            raise APIError(400, "prompt must not be empty", "prompt")
        items: list[Any] = [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)
        if len(items) > self.max_prompts:
            raise APIError(400, f"prompt has {len(items)} prompts; at most {self.max_prompts} per request "
                                "(server option --max-prompts-per-request)", "prompt")
        if not req.add_special_tokens:
            texts = [item for item in items if isinstance(item, str)]
            encoded = iter(await self.engine.call_front(
                lambda f: [f.tokenize_prompt(t, add_special_tokens=False) for t in texts]))
            return [EngineInput({"prompt_token_ids": next(encoded)}, item) if isinstance(item, str)
                    else EngineInput(list(item)) for item in items]
        return [EngineInput(item, item) if isinstance(item, str) else EngineInput(list(item)) for item in items]

    # ------------------------------------------------------------------ non-streaming
    def _response(self, req: CompletionRequest, request_id: str, created: int, finals: list[RequestOutput],
                  prompts: list[EngineInput]) -> CompletionResponse:
        choices = []
        num_prompt = num_completion = num_cached = 0
        for i, out in enumerate(finals):
            prompt_text = self._prompt_text(out, prompts[i].prompt_text)
            num_prompt += len(out.prompt_token_ids)
            num_cached += out.num_cached_tokens
            for c in self._visible(req, out.outputs):
                num_completion += len(c.token_ids)
                text = (prompt_text + c.text) if req.echo else c.text
                logprobs = None
                if req.logprobs is not None:
                    logprobs = CompletionLogprobs()
                    if req.echo:
                        self._add_prompt_logprobs(logprobs, out, req)
                    self._add_logprobs(logprobs, c.token_ids, c.logprobs, req)
                prompt_logprobs = None
                if req.prompt_logprobs is not None:
                    prompt_logprobs = make_prompt_logprobs(out.prompt_logprobs, self.token_text)
                choices.append(CompletionChoice(index=i * req.n + c.index, text=text, logprobs=logprobs,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                prompt_logprobs=prompt_logprobs))
        choices.sort(key=lambda ch: ch.index)
        return CompletionResponse(id=request_id, created=created, model=self.model_name, choices=choices,
                                  usage=make_usage(num_prompt, num_completion, self.cached_tokens(num_cached),
                                                   self.story(*finals)))

    @staticmethod
    def _visible(req: CompletionRequest, outputs: list[CompletionOutput]) -> list[CompletionOutput]:
        """The completions to report: without their generated token when the request is prompt-only."""
        if not req.is_prompt_only:
            return outputs
        return [CompletionOutput(c.index, "", [], None, [], "length" if c.finished() else None) for c in outputs]

    def _prompt_text(self, out: RequestOutput, given: str | None) -> str:
        """The prompt as the model saw it: the engine's (after ``truncate_prompt_tokens``), else the text given."""
        if out.prompt is not None:
            return out.prompt
        if given is not None:
            return given
        return self.engine.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)

    # ------------------------------------------------------------------ logprobs
    def _add_prompt_logprobs(self, lp: CompletionLogprobs, out: RequestOutput, req: CompletionRequest) -> None:
        entries = out.prompt_logprobs or []
        for j, tid in enumerate(out.prompt_token_ids):
            entry = entries[j] if j < len(entries) else None
            chosen = entry.get(tid) if entry else None
            self._append(lp, tid, None if chosen is None else chosen.logprob, entry, req)

    def _add_logprobs(self, lp: CompletionLogprobs, token_ids: list[int], entries: list[PositionLogprobs] | None,
                      req: CompletionRequest) -> None:
        entries = entries or []
        for k, tid in enumerate(token_ids):
            entry = entries[k] if k < len(entries) else None
            chosen = entry.get(tid) if entry else None
            self._append(lp, tid, None if chosen is None else chosen.logprob, entry, req)

    def _append(self, lp: CompletionLogprobs, tid: int, logprob: float | None, entry: PositionLogprobs | None,
                req: CompletionRequest) -> None:
        as_ids = req.return_tokens_as_token_ids
        text = self.token_text(tid, as_ids)
        offset = lp.text_offset[-1] + len(lp.tokens[-1]) if lp.tokens else 0
        lp.tokens.append(text)
        lp.text_offset.append(offset)
        lp.token_logprobs.append(finite_logprob(logprob))
        if entry is None:
            lp.top_logprobs.append(None)
            return
        top: dict[str, float] = {}
        for t, l in sorted(entry.items(), key=lambda kv: -kv[1].logprob):
            key = self.token_text(t, as_ids)
            if key not in top:  # two ids may decode to the same text: keep the likelier
                top[key] = finite_logprob(l.logprob)
        lp.top_logprobs.append(top)

    # ------------------------------------------------------------------ streaming
    async def _events(self, req: CompletionRequest, request_id: str, created: int, streams: list,
                      prompts: list[EngineInput]) -> AsyncIterator[str]:
        n = req.n
        num_prompt = [0] * len(streams)
        num_cached = [0] * len(streams)
        last: list = [None] * len(streams)
        num_completion = 0
        offsets: dict[int, int] = {}  # choice index -> text offset of the next token
        started: set[int] = set()
        async for i, out in merge_streams(streams):
            raise_if_failed(out)
            num_prompt[i] = len(out.prompt_token_ids)
            num_cached[i], last[i] = out.num_cached_tokens, out
            choices = []
            for c in self._visible(req, out.outputs):
                index = i * n + c.index
                num_completion += len(c.token_ids)
                choices.append(self._stream_choice(req, out, c, index, prompts[i].prompt_text, started, offsets))
            if choices:
                usage = (make_usage(sum(num_prompt), num_completion, self.cached_tokens(sum(num_cached)))
                         if req.include_usage_in_every_chunk else None)
                chunk = CompletionStreamResponse(id=request_id, created=created, model=self.model_name,
                                                 choices=choices, usage=usage)
                yield sse(chunk.model_dump_json())
        if req.include_usage_in_stream:
            chunk = CompletionStreamResponse(id=request_id, created=created, model=self.model_name, choices=[],
                                             usage=make_usage(sum(num_prompt), num_completion,
                                                              self.cached_tokens(sum(num_cached)), self.story(*last)))
            yield sse(chunk.model_dump_json())

    def _stream_choice(self, req: CompletionRequest, out: RequestOutput, c: CompletionOutput, index: int,
                       prompt_text: str | None, started: set[int], offsets: dict[int, int]) -> CompletionChoice:
        text = c.text
        logprobs = None
        first = index not in started
        started.add(index)
        if req.logprobs is not None:
            logprobs = CompletionLogprobs()
            base = offsets.get(index, 0)
            if first and req.echo:
                self._add_prompt_logprobs(logprobs, out, req)
            self._add_logprobs(logprobs, c.token_ids, c.logprobs, req)
            logprobs.text_offset = [o + base for o in logprobs.text_offset]
            if logprobs.tokens:
                offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        if first and req.echo:
            text = self._prompt_text(out, prompt_text) + text
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason)
