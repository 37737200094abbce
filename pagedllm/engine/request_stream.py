"""The asyncio side of requests: one :class:`RequestStream` per engine request. The engine
always runs DELTA outputs (cheap to hand over); a stream rebuilds the kind its caller asked
for. Event-loop thread only."""

from __future__ import annotations

import asyncio
import copy
from typing import AsyncIterator, Callable

from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import RequestOutputKind

__all__ = ["RequestStream", "merge_request_output", "merge_streams"]


def merge_request_output(acc: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Fold a DELTA ``RequestOutput`` into ``acc`` (in place; a copy when None) and return it:
    completions matched by ``index``, text and ids appended, the rest replaced."""
    if acc is None:
        acc = copy.copy(delta)
        acc.outputs = [_copy_completion(c) for c in delta.outputs]
        acc.prompt_token_ids = list(delta.prompt_token_ids)
    else:
        acc.finished = delta.finished
        acc.error = delta.error or acc.error
        acc.num_cached_tokens = delta.num_cached_tokens
        acc.metrics = delta.metrics
        by_index = {c.index: c for c in acc.outputs}
        for c in delta.outputs:
            have = by_index.get(c.index)
            if have is None:
                acc.outputs.append(_copy_completion(c))
                continue
            have.text += c.text
            have.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                have.logprobs = (have.logprobs or []) + list(c.logprobs)
            have.cumulative_logprob = c.cumulative_logprob
            have.finish_reason = c.finish_reason
            have.stop_reason = c.stop_reason
        acc.outputs.sort(key=lambda c: c.index)
    if delta.prompt_logprobs is not None:
        acc.prompt_logprobs = list(delta.prompt_logprobs)
    return acc


def _copy_completion(c: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                            None if c.logprobs is None else list(c.logprobs), c.finish_reason, c.stop_reason)


class RequestStream:
    """An async iterator of one engine request's ``RequestOutput``s (``request_id`` internal and
    unique, ``label`` the caller's). Iteration ends after the finished output, or raises the
    error put in (EngineDeadError when the engine dies first); :meth:`abort` or leaving early
    calls ``on_abort(request_id)``."""

    def __init__(self, request_id: str, label: str, output_kind: RequestOutputKind,
                 on_abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self.label = label
        self.output_kind = output_kind
        self.finished = False  # the final output (or an error) has been received
        self._on_abort = on_abort
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._acc: RequestOutput | None = None
        self._done = False  # iteration is over

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException) or item.finished:
            self.finished = True
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while not self._done:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self._done = True
                raise item
            self._done = item.finished
            out = self._shape(item)
            if out is not None:
                return out
        raise StopAsyncIteration

    def _shape(self, delta: RequestOutput) -> RequestOutput | None:
        if self.output_kind == RequestOutputKind.DELTA:
            return delta
        self._acc = merge_request_output(self._acc, delta)
        if self.output_kind == RequestOutputKind.FINAL_ONLY:
            return self._acc if delta.finished else None
        snapshot = copy.copy(self._acc)  # CUMULATIVE: a fresh object per yield
        snapshot.outputs = [_copy_completion(c) for c in self._acc.outputs]
        return snapshot

    def abort(self) -> None:
        """Abort the request in the engine unless it already finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self._on_abort(self.request_id)
        self._done = True

    async def aclose(self) -> None:
        self.abort()


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave streams as ``(stream index, output)`` in arrival order; leaving early (or an
    error in one) aborts every stream."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].abort()
        return
    q: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                q.put_nowait((i, out))
            q.put_nowait((i, end))
        except Exception as e:  # noqa: BLE001 - forwarded to the consumer
            q.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await q.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()
