"""``POST /v1/responses`` (OpenAI's Responses API) on the chat path: the request becomes a
:class:`ChatCompletionRequest` (``input`` items → messages, ``instructions`` → a system message,
``text.format`` → ``response_format``, flat function tools → chat tools), runs through
:meth:`OpenAIServingChat.start`, and its output comes back as output items (:mod:`output_parts`).
Stored responses (``store``) live in a :class:`ResponseStore`; ``previous_response_id`` continues one.
"""

from __future__ import annotations

import itertools
import json
import uuid
from typing import Any, AsyncIterator

from fastapi.responses import Response, StreamingResponse

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.output_parts import Part, PartEvent, PartStream, parts_of
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.protocol_responses import (
    FunctionCallItem, IncompleteDetails, InputTokensDetails, OutputMessage, OutputText, OutputTokensDetails,
    ReasoningItem, ReasoningText, ResponseError, ResponseObject, ResponsesRequest, ResponseUsage)
from pagedllm.entrypoints.openai.reasoning import ReasoningStream
from pagedllm.entrypoints.openai.response_store import ResponseStore
from pagedllm.entrypoints.openai.serving_base import guarded_sse, json_response, log_stream_error
from pagedllm.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat

# chat field -> the Responses field a 400 names
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text", "reasoning_effort": "reasoning"}
_TEXT_PART_TYPES = ("input_text", "output_text", "text")
_ROLES = ("user", "assistant", "system", "developer")
_REFUSED_INCLUDES = ("message.output_text.logprobs",)
_ITEM_PREFIXES = {"reasoning": "rs", "text": "msg", "call": "fc"}


class ResponseCancelled(Exception):
    """Put into a response's engine streams by ``POST /v1/responses/{id}/cancel``."""


def _content(content: Any, where: str) -> str | list[dict[str, str]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of text parts", "input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PART_TYPES or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}.content[{j}]: only text parts are supported (type input_text or "
                                f"output_text), got type {kind!r}", "input")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _call(item: dict[str, Any], where: str) -> dict[str, Any]:
    if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
        raise APIError(400, f"{where}: a function_call needs call_id, name and arguments (strings)", "input")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def input_messages(items: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Chat messages of ``input`` (raises APIError(400) naming ``input``)."""
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "message":
            if item.get("role") not in _ROLES:
                raise APIError(400, f"{where}.role must be one of {', '.join(_ROLES)}, got {item.get('role')!r}",
                               "input")
            out.append({"role": item.get("role"), "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(_call(item, where))
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [_call(item, where)]})
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning: templates leave it out of the history (as vLLM skips it)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, (str, list)):
                raise APIError(400, f"{where}: a function_call_output needs call_id and output", "input")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _content(output, where)})
        else:
            raise APIError(400, f"{where}.type {kind!r} is not supported (message, function_call, "
                                "function_call_output, reasoning)", "input")
    return out


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(400, f"tools[{i}].type {tool.get('type')!r} is not supported: only function tools", "tools")
        if not isinstance(tool.get("name"), str):  # chat would name its own tools[i].function.name
            raise APIError(400, f"tools[{i}].name is required (a string): a function tool needs a name", "tools")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                       "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, "text.format.type must be 'text', 'json_object' or 'json_schema'", "text")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema"),
                                                   "strict": fmt.get("strict")}}


def to_chat_request(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that runs ``req`` after ``conversation`` (its instructions first)."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    fields = dict(model=req.model, messages=system + conversation, max_completion_tokens=req.max_output_tokens,
                  temperature=req.temperature, top_p=req.top_p, stop=req.stop, tools=_chat_tools(req.tools),
                  tool_choice=_chat_tool_choice(req.tool_choice), parallel_tool_calls=req.parallel_tool_calls,
                  response_format=_response_format(req.text), stream=req.stream,
                  user=req.user or req.safety_identifier, cache_salt=req.cache_salt,
                  reasoning_effort=(req.reasoning or {}).get("effort"))
    return ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})


def check_refused(req: ResponsesRequest) -> None:
    """Raise APIError(400) naming a field this server cannot honour."""
    for name, off_values in req._REFUSED.items():
        value = getattr(req, name)
        if value is not None and value not in off_values:
            raise APIError(400, f"{name} is not supported by this server; got {value!r}", name)
    bad = [x for x in req.include or () if x in _REFUSED_INCLUDES]
    if bad:
        raise APIError(400, f"include {bad[0]!r} is not supported by this server", "include")
    if req.input is None and req.previous_response_id is None:
        raise APIError(400, "input is required (unless previous_response_id is given)", "input")


def assistant_message(parts: list[Part]) -> dict[str, Any]:
    """The chat message of an output (what a continuation sees of it)."""
    text = "".join(p.text for p in parts if p.kind == "text")
    calls = [{"id": p.call_id, "type": "function", "function": {"name": p.name, "arguments": p.text}}
             for p in parts if p.kind == "call"]
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


class ServingResponses:
    """Handler of ``/v1/responses`` and its ``{id}`` routes, on ``chat``'s engine path."""

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store
        self._running: dict[str, ChatRun] = {}

    async def create(self, req: ResponsesRequest) -> Response:
        check_refused(req)
        conversation = self._previous(req.previous_response_id) + input_messages(req.input)
        response = self._skeleton(req)
        run = await self.chat.start_translated(lambda: to_chat_request(req, conversation), response.id, _PARAMS)
        self._running[response.id] = run
        if req.stream:
            events = ResponseEvents(self, req, response, run, conversation)
            return StreamingResponse(guarded_sse(events.stream(), run.streams, events.failed, done=""),
                                     media_type="text/event-stream")
        try:
            out = await run.final()
        except ResponseCancelled:
            return json_response(response.model_copy(update={"status": "cancelled"}))
        finally:
            self._running.pop(response.id, None)
        c = out.outputs[0]
        content, tool_calls, finish_reason = run.parts(c)
        parts = parts_of(content, tool_calls, run.reasoning_of(c))
        num_reasoning = run.reasoning.num_tokens(c.token_ids, c.text, self.chat.encode_text) if run.reasoning else 0
        return json_response(self.finish(req, response, conversation, parts, finish_reason,
                                         (len(out.prompt_token_ids), self.chat.cached_tokens(out.num_cached_tokens) or 0, len(c.token_ids),
                                          num_reasoning)))

    def _skeleton(self, req: ResponsesRequest) -> ResponseObject:
        return ResponseObject(
            id=f"resp_{uuid.uuid4().hex}", model=self.chat.model_name, status="in_progress",
            instructions=req.instructions, previous_response_id=req.previous_response_id,
            max_output_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
            tools=req.tools or [], tool_choice=req.tool_choice or "auto", parallel_tool_calls=req.parallel_tool_calls
            is not False, text=req.text or {"format": {"type": "text"}}, metadata=req.metadata or {},
            user=req.user, store=req.store and self.store.is_enabled)

    def _previous(self, response_id: str | None) -> list[dict[str, Any]]:
        if response_id is None:
            return []
        entry = self.store.get(response_id)
        if entry is None:
            raise APIError(404 if self.store.is_enabled else 400, f"previous_response_id: no stored response "
                           f"{response_id!r}" + ("" if self.store.is_enabled else " (the response store is off)"),
                           "previous_response_id")
        return list(entry.conversation)

    def finish(self, req: ResponsesRequest, response: ResponseObject, conversation: list[dict[str, Any]],
               parts: list[Part], finish_reason: str | None, counts: tuple[int, int, int, int]) -> ResponseObject:
        """The finished response (stored when asked): items of ``parts``, status and usage.
        ``counts``: prompt, cached, output and reasoning tokens."""
        is_cut = finish_reason == "length"
        status = "incomplete" if is_cut else "completed"
        num_prompt, num_cached, num_output, num_reasoning = counts
        done = response.model_copy(update=dict(
            status=status, output=[output_item(response.id, i, p, status) for i, p in enumerate(parts)],
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if is_cut else None,
            usage=ResponseUsage(input_tokens=num_prompt, input_tokens_details=InputTokensDetails(
                cached_tokens=num_cached), output_tokens=num_output, total_tokens=num_prompt + num_output,
                output_tokens_details=OutputTokensDetails(reasoning_tokens=num_reasoning))))
        if done.store:
            kept = conversation + [assistant_message(parts)]
            self.store.put(done, kept, len(done.model_dump_json()) + len(json.dumps(kept)))
        return done

    def retrieve(self, response_id: str) -> ResponseObject:
        entry = self.store.get(response_id)
        if entry is None:
            raise APIError(404, f"no stored response {response_id!r}", "response_id")
        return entry.response

    def delete(self, response_id: str) -> dict[str, Any]:
        if self.store.pop(response_id) is None:
            raise APIError(404, f"no stored response {response_id!r}", "response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    async def cancel(self, response_id: str) -> ResponseObject:
        """Abort a response in progress (its blocks are freed); a finished one is a 400."""
        run = self._running.pop(response_id, None)
        if run is None:
            if self.store.get(response_id) is not None:
                raise APIError(400, f"response {response_id!r} is not in progress: only a response in progress "
                                    "can be cancelled", "response_id")
            raise APIError(404, f"no response {response_id!r} in progress", "response_id")
        for stream in run.streams:
            stream.abort()  # frees its blocks
            stream.put(ResponseCancelled())  # ends a wait on it
        return ResponseObject(id=response_id, model=self.chat.model_name, status="cancelled")


def output_item(response_id: str, index: int, part: Part, status: str
                ) -> ReasoningItem | OutputMessage | FunctionCallItem:
    item_id = f"{_ITEM_PREFIXES[part.kind]}_{response_id[5:]}_{index}"
    if part.kind == "reasoning":
        return ReasoningItem(id=item_id, status=status, content=[ReasoningText(text=part.text)])
    if part.kind == "text":
        return OutputMessage(id=item_id, status=status, content=[OutputText(text=part.text)])
    return FunctionCallItem(id=item_id, call_id=part.call_id, name=part.name, arguments=part.text, status=status)


class ResponseEvents:
    """The typed SSE events of one streamed response, each with its ``sequence_number``."""

    def __init__(self, serving: ServingResponses, req: ResponsesRequest, response: ResponseObject, run: ChatRun,
                 conversation: list[dict[str, Any]]) -> None:
        self.serving, self.req, self.response, self.run, self.conversation = serving, req, response, run, conversation
        self._seq = itertools.count()

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": next(self._seq), **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    async def stream(self) -> AsyncIterator[str]:
        rid = self.response.id
        yield self.event("response.created", response=self.response.model_dump())
        yield self.event("response.in_progress", response=self.response.model_dump())
        parts, finish_reason, counts = PartStream(), None, [0, 0, 0]
        reasoning_stream = ReasoningStream(self.run.reasoning)
        try:
            async for out, deltas in self.run.deltas(reasoning_stream):
                reasoning, content, tool_calls, finish_reason = deltas[0]
                counts = [len(out.prompt_token_ids), self.serving.chat.cached_tokens(out.num_cached_tokens) or 0, counts[2] + len(out.outputs[0].token_ids)]
                for ev in parts.feed(content, tool_calls, reasoning):
                    for text in self.part_events(ev):
                        yield text
        except ResponseCancelled:
            return
        finally:
            self.serving._running.pop(rid, None)
        for ev in parts.finish():
            for text in self.part_events(ev):
                yield text
        done = self.serving.finish(self.req, self.response, self.conversation, parts.parts, finish_reason,
                                   (*counts, reasoning_stream.num_tokens(self.serving.chat.encode_text)))
        kind = "response.incomplete" if done.status == "incomplete" else "response.completed"
        yield self.event(kind, response=done.model_dump())

    def part_events(self, ev: PartEvent) -> list[str]:
        status = "completed" if ev.kind == "close" else "in_progress"
        item = output_item(self.response.id, ev.index, ev.part, status).model_dump()
        at = {"item_id": item["id"], "output_index": ev.index}
        if ev.part.kind == "reasoning":
            return self.reasoning_events(ev, item, {**at, "content_index": 0})
        if ev.part.kind == "text":
            text_at = {**at, "content_index": 0}
            part = {"type": "output_text", "text": ev.part.text, "annotations": []}
            if ev.kind == "open":
                return [self.event("response.output_item.added", output_index=ev.index, item={**item, "content": []}),
                        self.event("response.content_part.added", **text_at, part={**part, "text": ""})]
            if ev.kind == "delta":
                return [self.event("response.output_text.delta", **text_at, delta=ev.delta, logprobs=[])]
            return [self.event("response.output_text.done", **text_at, text=ev.part.text, logprobs=[]),
                    self.event("response.content_part.done", **text_at, part=part),
                    self.event("response.output_item.done", output_index=ev.index, item=item)]
        if ev.kind == "open":
            return [self.event("response.output_item.added", output_index=ev.index, item={**item, "arguments": ""})]
        if ev.kind == "delta":
            return [self.event("response.function_call_arguments.delta", **at, delta=ev.delta)]
        return [self.event("response.function_call_arguments.done", **at, name=ev.part.name, arguments=ev.part.text),
                self.event("response.output_item.done", output_index=ev.index, item=item)]

    def reasoning_events(self, ev: PartEvent, item: dict[str, Any], text_at: dict[str, Any]) -> list[str]:
        if ev.kind == "open":
            return [self.event("response.output_item.added", output_index=ev.index, item={**item, "content": []})]
        if ev.kind == "delta":
            return [self.event("response.reasoning_text.delta", **text_at, delta=ev.delta)]
        return [self.event("response.reasoning_text.done", **text_at, text=ev.part.text),
                self.event("response.output_item.done", output_index=ev.index, item=item)]

    def failed(self, exc: BaseException) -> list[str]:
        """The ``error`` and ``response.failed`` events of a failure after the stream started."""
        err = log_stream_error(exc)
        failed = self.response.model_copy(update=dict(status="failed", error=ResponseError(
            code="server_error" if err.status >= 500 else "invalid_request", message=err.message)))
        return [self.event("error", code=str(err.status), message=err.message, param=err.param),
                self.event("response.failed", response=failed.model_dump())]
