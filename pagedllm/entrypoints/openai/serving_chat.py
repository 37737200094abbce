"""``POST /v1/chat/completions`` with the model's chat template (or ``--chat-template FILE``).

The conversation is rendered and tokenized on the front-end thread, without adding special tokens again.
``max_completion_tokens`` wins over ``max_tokens``. Streaming follows OpenAI's delta protocol: a first chunk with
the role per choice, content deltas, one chunk with ``finish_reason`` per choice, the usage chunk with
``stream_options.include_usage``, then ``data: [DONE]``. :meth:`OpenAIServingChat.start` is the one door to the
engine for chat, Responses and Messages requests.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from pydantic import ValidationError

from fastapi.responses import Response, StreamingResponse

from pagedllm.entrypoints.openai.protocol import (
    ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
    ChatCompletionStreamResponse, ChatResponseMessage, ChatStreamChoice, ChatTokenLogprob, ChatTopLogprob,
    CompletionTokensDetails, DeltaMessage, UsageInfo, finite_logprob, make_prompt_logprobs, make_usage)
from pagedllm.entrypoints.openai.serving_base import (
    OpenAIServing, guarded_sse, json_response, raise_if_failed, sse)
from pagedllm.engine.async_engine import EngineInput
from pagedllm.engine.request_stream import RequestStream, merge_streams
from pagedllm.entrypoints.openai.errors import APIError, to_api_error, validation_message
from pagedllm.entrypoints.openai.generation_defaults import apply_generation_defaults
from pagedllm.entrypoints.openai.reasoning import (
    ReasoningPlan, ReasoningStream, plan_reasoning, resolve_reasoning_parser, split_reasoning)
from pagedllm.entrypoints.openai.tools import (
    ToolCallItem, ToolPlan, ToolStream, apply_tool_plan, message_parts, plan_tools)
from pagedllm.loader.tokenizer import chat_template_of
from pagedllm.outputs import CompletionOutput, PositionLogprobs, RequestOutput


class OpenAIServingChat(OpenAIServing):
    """Handler of ``/v1/chat/completions``.

    Args (beyond OpenAIServing's): chat_template: a Jinja template overriding the
    model's own (the contents of ``--chat-template FILE``), or None.
    """

    prompt_field = "messages"

    def __init__(self, *args, chat_template: str | None = None, tool_call_parser: str | None = None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.chat_template = chat_template
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = getattr(self.engine.config, "reasoning_parser", None)
        resolve_reasoning_parser(self.reasoning_parser, None)  # an unknown name fails at start-up
        structured = getattr(self.engine.config, "structured_outputs", None)
        self.enable_in_reasoning = bool(structured and structured.enable_in_reasoning)
        self.default_template_kwargs = template_kwargs_of(
            getattr(self.engine.config, "default_chat_template_kwargs", None))

    async def render(self, messages: list[dict], add_generation_prompt: bool = True,
                     continue_final_message: bool = False, chat_template: str | None = None,
                     tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        """Prompt token ids of a conversation (raises APIError 400 naming ``messages``, also on a pooling
        engine, or ``chat_template`` when the request's own template fails to render).

        ``chat_template``: a request's own template, over the server's and the model's;
        ``tools``, ``template_kwargs``: passed to the template.
        """
        if getattr(self.engine, "runner_type", "generate") == "pooling":  # no chat template on a pooling engine
            raise APIError(400, f"the model {self.model_name!r} runs with runner='pooling' (it serves "
                                f"{', '.join(self.engine.tasks)}): conversations (chat, /v1/responses, /v1/messages, "
                                f"messages in /tokenize) need a model served with runner='generate'", "messages")
        if chat_template is not None and not self.engine.config.trust_request_chat_template:
            raise APIError(400, "chat_template in a request is refused: the server runs it as code "
                           "(start it with --trust-request-chat-template to allow it)", "chat_template")
        template = chat_template or self.chat_template
        kwargs = {"continue_final_message": True} if continue_final_message else {}
        if tools:
            kwargs["tools"] = tools
        if template_kwargs:
            kwargs["template_kwargs"] = template_kwargs
        try:
            return await self.engine.call_front(lambda f: f.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, chat_template=template, **kwargs))
        except ValueError as e:
            own_template = chat_template is not None and str(e).startswith("chat_template")
            raise APIError(400, str(e), "chat_template" if own_template else "messages") from None

    def template(self, req: ChatCompletionRequest) -> str | None:
        return req.chat_template or self.chat_template or chat_template_of(self.engine.tokenizer)

    def template_kwargs(self, req) -> dict:
        """The request's template variables over the server's (APIError 400 naming ``chat_template_kwargs``)."""
        try:
            return req.template_kwargs(self.default_template_kwargs)
        except ValueError as e:
            raise APIError(400, str(e), "chat_template_kwargs") from None

    def plan_reasoning(self, req: ChatCompletionRequest, prompt_ids: list[int], params,
                       template_kwargs: dict) -> ReasoningPlan | None:
        """The reasoning split; under a constraint that starts after the reasoning, its boundary goes on ``params``."""
        parser_cls = resolve_reasoning_parser(self.reasoning_parser, self.template(req))
        plan = plan_reasoning(parser_cls, self.engine.tokenizer, prompt_ids, params.structured_outputs is not None,
                              template_kwargs, self.enable_in_reasoning)
        if plan is not None and plan.boundary is not None:
            params.structured_outputs = dataclasses.replace(params.structured_outputs, reasoning_boundary=plan.boundary)
        return plan

    def plan_tools(self, req: ChatCompletionRequest, params) -> ToolPlan | None:
        """Validate tools/tool_choice (APIError 400) and put their constraint on ``params``."""
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_call_parser,
                          self.template(req))
        apply_tool_plan(plan, params)
        return plan

    async def start(self, req: ChatCompletionRequest, request_id: str) -> ChatRun:
        """Validate ``req``, render its conversation and add it to the engine (raises APIError).
        The chat, Responses and Messages APIs all run through here."""
        self.check_model(req.model)
        self.check_n(req.n)
        apply_generation_defaults(req, self.sampling_defaults)
        params = self.params_for_model(req.to_sampling_params(), req.model)
        plan = self.plan_tools(req, params)
        template_kwargs = self.template_kwargs(req)
        prompt_ids = await self.render(req.conversation(), req.add_generation_prompt, req.continue_final_message,
                                       req.chat_template, plan.tools if plan else None, template_kwargs)
        reasoning = self.plan_reasoning(req, prompt_ids, params, template_kwargs)
        streams = await self.add_requests(self.label(request_id, req.user), [EngineInput(prompt_ids)], params,
                                          req.priority)
        return ChatRun(streams, plan, len(prompt_ids), reasoning)

    async def start_translated(self, build: Callable[[], ChatCompletionRequest], request_id: str,
                               params: dict[str, str]) -> ChatRun:
        """:meth:`start` for another API: ``build()`` makes its chat request; a 400 names the other
        API's field (``params``: chat field -> its name there)."""
        try:
            return await self.start(build(), request_id)
        except ValidationError as e:
            message, field = validation_message(e)
            raise APIError(400, message, params.get(field, field)) from None
        except (APIError, ValueError) as e:
            err = e if isinstance(e, APIError) else to_api_error(e, set(ChatCompletionRequest.model_fields))
            raise APIError(err.status, err.message, params.get(err.param, err.param)) from None

    async def create_chat_completion(self, req: ChatCompletionRequest) -> Response:
        """Validate, submit and answer one chat request (JSON or SSE). Raises APIError."""
        request_id = self.new_id("chatcmpl", req.request_id)
        run = await self.start(req, request_id)
        created = int(time.time())
        if req.stream:
            return StreamingResponse(guarded_sse(self._events(req, request_id, created, run), run.streams),
                                     media_type="text/event-stream")
        (final,) = await self.collect_final(run.streams)
        return json_response(self._response(req, request_id, created, final, run))

    def encode_text(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text, add_special_tokens=False)

    def _with_reasoning_tokens(self, usage: UsageInfo, num_reasoning: int | None) -> UsageInfo:
        if num_reasoning is not None:
            usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=num_reasoning)
        return usage

    def _choice_fields(self, req: ChatCompletionRequest, c, finish_reason: str | None) -> dict:
        """What a choice and a streamed choice share: index, logprobs, finish and stop reasons."""
        return {"index": c.index, "logprobs": self._logprobs(req, c) if req.logprobs else None,
                "finish_reason": finish_reason, "stop_reason": c.stop_reason}

    def _response(self, req: ChatCompletionRequest, request_id: str, created: int, out: RequestOutput,
                  run: ChatRun) -> ChatCompletionResponse:
        choices = []
        for c in out.outputs:
            reasoning = run.reasoning_of(c)
            content, tool_calls, finish_reason = run.parts(c)
            message = ChatResponseMessage(content=content, tool_calls=tool_calls, reasoning_content=reasoning,
                                          reasoning=reasoning)
            choices.append(ChatCompletionChoice(message=message, **self._choice_fields(req, c, finish_reason)))
        num_completion = sum(len(c.token_ids) for c in out.outputs)
        num_reasoning = None if run.reasoning is None else sum(
            run.reasoning.num_tokens(c.token_ids, c.text, self.encode_text) for c in out.outputs)
        usage = make_usage(len(out.prompt_token_ids), num_completion, self.cached_tokens(out.num_cached_tokens),
                           self.story(out))
        return ChatCompletionResponse(id=request_id, created=created, model=self.model_name, choices=choices,
                                      usage=self._with_reasoning_tokens(usage, num_reasoning),
                                      prompt_logprobs=make_prompt_logprobs(out.prompt_logprobs, self.token_text))

    def _logprobs(self, req: ChatCompletionRequest, c: CompletionOutput) -> ChatChoiceLogprobs:
        entries = c.logprobs or []
        content = []
        k = req.top_logprobs or 0
        as_ids = req.return_tokens_as_token_ids
        for j, tid in enumerate(c.token_ids):
            entry: PositionLogprobs = entries[j] if j < len(entries) else {}
            chosen = entry.get(tid)
            text = self.token_text(tid, as_ids)
            ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)
            top = [(t, l) for t, l in ranked if l.rank is None or l.rank <= k][:k]
            content.append(ChatTokenLogprob(
                token=text, logprob=finite_logprob(chosen.logprob) if chosen else finite_logprob(float("-inf")),
                bytes=self.token_bytes(tid, as_ids),
                top_logprobs=[ChatTopLogprob(token=self.token_text(t, as_ids), logprob=finite_logprob(l.logprob),
                                             bytes=self.token_bytes(t, as_ids))
                              for t, l in top]))
        return ChatChoiceLogprobs(content=content)

    async def _events(self, req: ChatCompletionRequest, request_id: str, created: int, run: ChatRun
                      ) -> AsyncIterator[str]:
        def chunk(choices: list[ChatStreamChoice], usage=None) -> str:
            return sse(ChatCompletionStreamResponse(id=request_id, created=created, model=self.model_name,
                                                    choices=choices, usage=usage).model_dump_json())

        num_completion = 0
        last = None
        reasoning_stream = ReasoningStream(run.reasoning)

        def usage(metrics=None) -> UsageInfo:
            num_prompt, num_cached = (len(last.prompt_token_ids), last.num_cached_tokens) if last else (0, 0)
            num_reasoning = None if run.reasoning is None else reasoning_stream.num_tokens(self.encode_text)
            counts = make_usage(num_prompt, num_completion, self.cached_tokens(num_cached), metrics)
            return self._with_reasoning_tokens(counts, num_reasoning)

        yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                     for i in range(req.n)])
        async for out, deltas in run.deltas(reasoning_stream):
            last = out
            choices = []
            for c, (reasoning, content, tool_calls, finish_reason) in zip(out.outputs, deltas):
                num_completion += len(c.token_ids)
                if (content is None and reasoning is None and not tool_calls and finish_reason is None
                        and not req.logprobs):
                    continue  # a parser holds this text back: nothing to send (as vLLM)
                delta = DeltaMessage(content=content, tool_calls=tool_calls, reasoning_content=reasoning,
                                     reasoning=reasoning)
                choices.append(ChatStreamChoice(delta=delta, **self._choice_fields(req, c, finish_reason)))
            if choices:
                yield chunk(choices, usage() if req.include_usage_in_every_chunk else None)
        if req.include_usage_in_stream:
            yield chunk([], usage(self.story(last)))


@dataclass
class ChatRun:
    """A chat request in the engine: its streams (one per prompt), its tool plan, prompt length and
    reasoning split (tool parsing and every API's content see only the answer)."""

    streams: list[RequestStream]
    plan: ToolPlan | None
    num_prompt_tokens: int
    reasoning: ReasoningPlan | None = None

    async def final(self) -> RequestOutput | None:
        """The finished output, None when aborted (raises APIError(500) when the engine failed it)."""
        finals = await OpenAIServing.collect_final(self.streams)
        return finals[0] if finals else None

    def reasoning_of(self, c: CompletionOutput) -> str | None:
        return split_reasoning(self.reasoning, c.text)[0]

    def parts(self, c: CompletionOutput) -> tuple[str | None, list[ToolCallItem], str | None]:
        """``(content, tool_calls, finish_reason)`` of a finished choice's answer."""
        return message_parts(self.plan, split_reasoning(self.reasoning, c.text)[1], c.finish_reason)

    async def deltas(self, reasoning_stream: ReasoningStream) -> AsyncIterator[tuple[RequestOutput, list[tuple]]]:
        """Each engine output with, per choice, ``(reasoning, content, delta tool calls, finish_reason)``;
        ``reasoning_stream`` (of this run's plan) counts the reasoning tokens. Raises APIError(500) when the
        engine failed the request."""
        tool_stream = ToolStream(self.plan)
        async for _, out in merge_streams(self.streams):
            raise_if_failed(out)
            deltas = []
            for c in out.outputs:
                thought, answer = reasoning_stream.delta(c.index, c.text, c.token_ids, c.finish_reason)
                content, tool_calls, finish_reason = tool_stream.delta(c.index, answer, c.finish_reason)
                content = (content or None) if self.reasoning is not None else content
                deltas.append((thought, content, tool_calls, finish_reason))
            yield out, deltas


def template_kwargs_of(value: str | dict | None) -> dict:
    """``--default-chat-template-kwargs`` as a dict (a JSON object). Raises ValueError naming the flag."""
    if value is None or isinstance(value, dict):
        return dict(value or {})
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"default_chat_template_kwargs is not valid JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"default_chat_template_kwargs must be a JSON object, got {value!r}")
    return parsed
