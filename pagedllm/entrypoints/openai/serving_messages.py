"""Anthropic's ``POST /v1/messages`` and ``/v1/messages/count_tokens`` on the chat path: the request becomes a
:class:`ChatCompletionRequest` (``system`` → a system message, ``tool_use`` / ``tool_result`` blocks → tool calls
and tool messages, ``input_schema`` tools → function tools, ``tool_choice`` any → required), runs through
:meth:`OpenAIServingChat.start`, and its output comes back as content blocks (:mod:`output_parts`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from fastapi.responses import Response, StreamingResponse

from pagedllm.entrypoints.openai.errors import APIError, anthropic_error_body
from pagedllm.entrypoints.openai.output_parts import Part, PartEvent, PartStream, parts_of
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.protocol_messages import (
    AnthropicUsage, CountTokensRequest, CountTokensResponse, MessagesRequest, MessagesResponse, TextBlock,
    ThinkingBlock, ToolUseBlock)
from pagedllm.entrypoints.openai.reasoning import ReasoningStream
from pagedllm.entrypoints.openai.serving_base import guarded_sse, json_response, log_stream_error
from pagedllm.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat

# chat field -> the Messages field a 400 names
_PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "response_format": "output_config",
           "user": "metadata"}
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_DELTAS = {"reasoning": lambda d: {"type": "thinking_delta", "thinking": d},
           "text": lambda d: {"type": "text_delta", "text": d},
           "call": lambda d: {"type": "input_json_delta", "partial_json": d}}


def _text(block: dict[str, Any], where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise APIError(400, f"{where}: a text block needs text", "messages")
    return block["text"]


def _result_text(content: Any, where: str) -> str:
    if isinstance(content, str) or content is None:
        return content or ""
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of text blocks", "messages")
    return "\n".join(_text(b, f"{where}.content") if isinstance(b, dict) and b.get("type") == "text"
                     else _refuse(b, where) for b in content)


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    """The chat tool call of a ``tool_use`` block: ``id`` and ``name`` strings, ``input`` an object (as Anthropic)."""
    if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
            and isinstance(block.get("input", {}), dict)):
        raise APIError(400, f"{where}: a tool_use block needs id and name (strings) and input (an object)", "messages")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}}


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    """The chat tool message of a ``tool_result`` block, which names its call by ``tool_use_id``."""
    if not isinstance(block.get("tool_use_id"), str):
        raise APIError(400, f"{where}: a tool_result block needs tool_use_id (a string)", "messages")
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": _result_text(block.get("content"), where)}


def _refuse(block: Any, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in ("image", "document"):
        raise APIError(400, f"{where}: {kind} blocks are not supported (this server's models read text only)",
                       "messages")
    raise APIError(400, f"{where}: block type {kind!r} is not supported (text, tool_use, tool_result)", "messages")


def _turn(i: int, role: str, content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of one Anthropic turn: tool results become tool messages."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        where, kind = f"messages[{i}].content[{j}]", block.get("type")
        if kind == "text":
            texts.append(_text(block, where))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, where))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, where))
        elif kind not in ("thinking", "redacted_thinking"):  # a thinking model's blocks, sent back
            _refuse(block, where)
    text = {"role": role, "content": "\n".join(texts) or None, **({"tool_calls": calls} if calls else {})}
    return results + ([text] if texts or calls else [])


def _system(system: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if not system:
        return []
    text = system if isinstance(system, str) else "\n".join(_text(b, "system") for b in system)
    return [{"role": "system", "content": text}]


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type", "custom") != "custom" or "input_schema" not in tool:
            raise APIError(400, f"tools[{i}]: only custom tools with an input_schema are supported", "tools")
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """Chat's ``(tool_choice, parallel_tool_calls)`` of Anthropic's ``tool_choice``."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    if kind not in _CHOICES:
        raise APIError(400, "tool_choice.type must be 'auto', 'any', 'tool' (with name) or 'none'", "tool_choice")
    return _CHOICES[kind], parallel


def _response_format(config: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise APIError(400, "output_config.format must be {'type': 'json_schema', 'schema': {...}}", "output_config")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def check_thinking(thinking: dict[str, Any] | None) -> None:
    if thinking is not None and thinking.get("type") not in ("enabled", "disabled", "adaptive"):
        raise APIError(400, "thinking.type must be 'enabled', 'disabled' or 'adaptive'", "thinking")


def shows_thinking(req: MessagesRequest) -> bool:
    """Whether the reasoning comes back as a thinking block (``thinking`` enabled or adaptive)."""
    return (req.thinking or {}).get("type") in ("enabled", "adaptive")


def to_chat_request(req: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    check_thinking(req.thinking)
    messages = _system(req.system) + [m for i, turn in enumerate(req.messages) for m in _turn(i, turn.role,
                                                                                             turn.content)]
    tool_choice, parallel = _tool_choice(req.tool_choice)
    fields: dict[str, Any] = dict(model=req.model, messages=messages, tools=_tools(req.tools), tool_choice=tool_choice,
                                  parallel_tool_calls=parallel)
    if isinstance(req, MessagesRequest):
        user = (req.metadata or {}).get("user_id")
        fields.update(max_completion_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                      top_p=req.top_p, top_k=req.top_k, stream=req.stream, user=user if isinstance(user, str) else None,
                      response_format=_response_format(req.output_config), cache_salt=req.cache_salt)
    return ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:  # cut off by max_tokens
        return {}
    return value if isinstance(value, dict) else {}


def content_block(part: Part) -> ThinkingBlock | TextBlock | ToolUseBlock:
    if part.kind == "reasoning":
        return ThinkingBlock(thinking=part.text)
    if part.kind == "text":
        return TextBlock(text=part.text)
    return ToolUseBlock(id=part.call_id, name=part.name, input=_tool_input(part.text))


def stop_reason(parts: list[Part], finish_reason: str | None, stop: Any) -> tuple[str, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)``; ``stop``: the engine's matched stop string or token."""
    if finish_reason == "length":
        return "max_tokens", None
    if any(p.kind == "call" for p in parts):
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def usage(num_prompt: int, num_cached: int, num_output: int) -> AnthropicUsage:
    return AnthropicUsage(input_tokens=num_prompt - num_cached, output_tokens=num_output,
                          cache_read_input_tokens=num_cached)


class ServingMessages:
    """Handler of ``/v1/messages`` and ``/v1/messages/count_tokens``, on ``chat``'s engine path."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create(self, req: MessagesRequest) -> Response:
        message_id = f"msg_{uuid.uuid4().hex}"
        run = await self.chat.start_translated(lambda: to_chat_request(req), message_id, _PARAMS)
        if req.stream:
            events = MessageEvents(self.chat.model_name, message_id, run, shows_thinking(req), self.chat.cached_tokens)
            return StreamingResponse(guarded_sse(events.stream(), run.streams, events.failed, done=""),
                                     media_type="text/event-stream")
        out = await run.final()
        c = out.outputs[0]
        content, tool_calls, finish_reason = run.parts(c)
        parts = parts_of(content, tool_calls, run.reasoning_of(c) if shows_thinking(req) else None)
        reason, sequence = stop_reason(parts, finish_reason, c.stop_reason)
        return json_response(MessagesResponse(
            id=message_id, model=self.chat.model_name, content=[content_block(p) for p in parts], stop_reason=reason,
            stop_sequence=sequence, usage=usage(len(out.prompt_token_ids), self.chat.cached_tokens(out.num_cached_tokens) or 0, len(c.token_ids))))

    async def count_tokens(self, req: CountTokensRequest) -> Response:
        chat_req = to_chat_request(req)
        self.chat.check_model(chat_req.model)
        plan = self.chat.plan_tools(chat_req, chat_req.to_sampling_params())
        ids = await self.chat.render(chat_req.conversation(), tools=plan.tools if plan else None)
        return json_response(CountTokensResponse(input_tokens=len(ids)))


class MessageEvents:
    """Anthropic's SSE events of one streamed message."""

    def __init__(self, model: str, message_id: str, run: ChatRun, shows_thinking: bool,
                 cached_tokens: Any = lambda n: n) -> None:
        self.cached_tokens = cached_tokens  # None when usage leaves cached counts out
        self.model, self.message_id, self.run, self.shows_thinking = model, message_id, run, shows_thinking

    @staticmethod
    def event(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"

    async def stream(self) -> AsyncIterator[str]:
        start = MessagesResponse(id=self.message_id, model=self.model, content=[],
                                 usage=usage(self.run.num_prompt_tokens, 0, 0))
        yield self.event("message_start", message=start.model_dump())
        yield self.event("ping")
        parts, finish_reason, stop, counts = PartStream(), None, None, [self.run.num_prompt_tokens, 0, 0]
        async for out, deltas in self.run.deltas(ReasoningStream(self.run.reasoning)):
            reasoning, content, tool_calls, finish_reason = deltas[0]
            stop = out.outputs[0].stop_reason if out.outputs else stop
            counts = [len(out.prompt_token_ids), self.cached_tokens(out.num_cached_tokens) or 0, counts[2] + len(out.outputs[0].token_ids)]
            for ev in parts.feed(content, tool_calls, reasoning if self.shows_thinking else None):
                yield self.block_event(ev)
        for ev in parts.finish():
            yield self.block_event(ev)
        reason, sequence = stop_reason(parts.parts, finish_reason, stop)
        yield self.event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                         usage=usage(*counts).model_dump())
        yield self.event("message_stop")

    def block_event(self, ev: PartEvent) -> str:
        if ev.kind == "open":
            block = content_block(Part(ev.part.kind, "", ev.part.call_id, ev.part.name)).model_dump()
            return self.event("content_block_start", index=ev.index, content_block=block)
        if ev.kind == "delta":
            delta = _DELTAS[ev.part.kind](ev.delta)
            return self.event("content_block_delta", index=ev.index, delta=delta)
        return self.event("content_block_stop", index=ev.index)

    def failed(self, exc: BaseException) -> list[str]:
        err = log_stream_error(exc)
        return [f"event: error\ndata: {json.dumps(anthropic_error_body(err.status, err.message))}\n\n"]
