"""What the completions and chat handlers share: model check, request ids, stream merging,
token strings for logprobs, SSE framing, and collecting final outputs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any, Awaitable

from fastapi import Request
from fastapi.responses import Response

from pagedllm.engine.async_engine import AsyncLLMEngine, EngineInput
from pagedllm.engine.detokenizer import token_bytes, token_text
from pagedllm.errors import ContextLengthError
from pagedllm.core.step_failure import InputError
from pagedllm.entrypoints.openai.tenant_salt import salted
from pagedllm.engine.request_stream import RequestStream, merge_streams
from pagedllm.entrypoints.openai.generation_defaults import generation_defaults
from pagedllm.entrypoints.openai.errors import APIError, to_api_error
from pagedllm.entrypoints.openai.serving_lora import adapter_named, lora_registry, with_adapter
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm.server")

_DISCONNECT_POLL_S = 0.5


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


class OpenAIServing:
    """Base of the endpoint handlers: ``served_model_names`` are accepted as ``model`` (the first is reported),
    ``n`` beyond ``max_n`` is a 400."""

    # The request field holding the prompt, which a context-length 400 names (as OpenAI does).
    prompt_field = "prompt"

    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str], max_n: int = 16) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.max_n = max_n
        config = engine.config
        self.sampling_defaults = generation_defaults(config.model, getattr(config, "generation_config", "vllm"))
        self.lora_registry = lora_registry(engine)  # adapters a request's model may name

    def story(self, *outputs) -> list | None:
        """The outputs' RequestMetrics for ``usage.metrics``, or None when ``usage_metrics`` is off."""
        if not self.engine.config.usage_metrics:
            return None
        return [o.metrics for o in outputs if o is not None and o.metrics is not None]

    def cached_tokens(self, num_cached: int) -> int | None:
        """``num_cached`` for ``usage``, or None when ``usage_cached_tokens`` is off."""
        return num_cached if self.engine.config.usage_cached_tokens else None

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        """Raise a 404 APIError naming the served models when ``model`` is not one of them."""
        if model is None or model in self.served_model_names or adapter_named(self.lora_registry, model):
            return
        served = ", ".join(self.served_model_names + [r.lora_name for r in self.adapters()])
        raise APIError(404, f"The model `{model}` does not exist. Served models: {served}", "model")

    def adapters(self) -> list:
        """The loaded LoRA adapters (pagedllm.lora.LoRARequest), in load order."""
        return [] if self.lora_registry is None else self.lora_registry.list()

    def params_for_model(self, params: SamplingParams, model: str | None) -> SamplingParams:
        """``params`` under the adapter ``model`` names (unchanged for the base model's names)."""
        return with_adapter(params, adapter_named(self.lora_registry, model))

    def check_n(self, n: int) -> None:
        if isinstance(n, int) and n > self.max_n:
            raise APIError(400, f"n must be <= {self.max_n} (server option --max-n), got {n}", "n")

    @staticmethod
    def new_id(prefix: str, requested: str | None = None) -> str:
        return requested or f"{prefix}-{uuid.uuid4().hex}"

    @staticmethod
    def label(request_id: str, user: str | None) -> str:
        """The engine's label of a request: its id, and the client's ``user`` when given (for logs)."""
        return request_id if not user else f"{request_id} (user {user!r})"

    def token_text(self, token_id: int, as_token_id: bool = False) -> str:
        """The text of one token for logprobs (``token_id:N`` when asked for ids), as the engine
        reports it in ``Logprob.decoded_token``."""
        return f"token_id:{token_id}" if as_token_id else token_text(self.engine.tokenizer, token_id)

    def token_bytes(self, token_id: int, as_token_id: bool = False) -> list[int]:
        """The raw bytes of one token (OpenAI's ``logprobs[].bytes``)."""
        if as_token_id:
            return list(self.token_text(token_id, True).encode())
        return list(token_bytes(self.engine.tokenizer, token_id))

    async def add_requests(self, label: str, prompts: list[EngineInput], params: SamplingParams,
                           priority: int = 0) -> list[RequestStream]:
        """Add one engine request per prompt, all admitted together or none (a prompt too long for
        ``max_model_len`` is an APIError(400) naming ``prompt_field``)."""
        params = salted(params)  # the API key's cache namespace under --kv-cache-isolation api-key
        try:
            return await self.engine.add_requests(label, prompts, params, priority=priority)
        except ContextLengthError as e:
            raise APIError(400, str(e), self.prompt_field) from None

    @staticmethod
    async def collect_final(streams: list[RequestStream]) -> list[RequestOutput]:
        """The final output of every stream (all aborted if cancelled). Raises EngineDeadError, or
        APIError(500) when a request failed inside the engine."""
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for i, out in merge_streams(streams):
            finals[i] = out
        for out in finals:
            if out is not None:
                raise_if_failed(out)
        return [out for out in finals if out is not None]


async def until_disconnected(coro: Awaitable[Response], raw_request: Request | None) -> Response:
    """Await ``coro``, cancelling it (and so aborting its engine requests) when the HTTP client goes away,
    checked every 0.5 s; raises ClientDisconnected then."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if raw_request is not None and await raw_request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


def sse(payload: str) -> str:
    """One server-sent event carrying a JSON payload."""
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def json_response(model: Any, status_code: int = 200) -> Response:
    """A JSON response from a pydantic model (non-finite floats serialize as null)."""
    return Response(content=model.model_dump_json(), status_code=status_code, media_type="application/json")


def raise_if_failed(out: Any) -> None:
    """Raise APIError when a RequestOutput reports a failure inside the engine: 400 for an InputError, else 500."""
    if out.error is not None:
        status = 400 if isinstance(out.error, InputError) else 500
        raise APIError(status, f"the request failed inside the engine: {out.error}")


async def guarded_sse(events: Any, streams: list, error_events: Any = None, done: str | None = None) -> Any:
    """Yield the SSE ``events``; a failure after the headers went out is reported in-band
    (``error_events(exc)``: the events that say so, default OpenAI's error event), every engine
    stream is aborted on any exit (client gone included), and the stream ends with ``done``
    (default ``data: [DONE]``; "" for none)."""
    try:
        async for event in events:
            yield event
    except Exception as e:  # noqa: BLE001 - reported in-band: the headers are gone
        for event in (error_events or _error_events)(e):
            yield event
    finally:
        for s in streams:
            s.abort()
    end = SSE_DONE if done is None else done
    if end:
        yield end


def _error_events(exc: BaseException) -> list[str]:
    return [stream_error_event(exc)]


def log_stream_error(exc: BaseException) -> APIError:
    """The APIError of a failure after a stream started, logged by its severity."""
    err = to_api_error(exc)
    if err.status == 500:
        logger.error("stream failed: %s", exc, exc_info=exc)
    elif err.status > 500:
        logger.warning("stream ended: %s", err.message)
    return err


def stream_error_event(exc: BaseException) -> str:
    """The SSE error event for a failure after the stream started."""
    from pagedllm.entrypoints.openai.errors import sse_error

    err = log_stream_error(exc)
    return sse_error(err.status, err.message, err.param)
