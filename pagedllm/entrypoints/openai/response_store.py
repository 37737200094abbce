"""The in-memory store of ``/v1/responses`` (``store: true``): the last responses, bounded by count and bytes,
least recently used out first. Each entry keeps the response and the conversation that led to it (as chat
messages), which ``previous_response_id`` continues."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_COUNT = 1000
DEFAULT_MAX_BYTES = 64 << 20


@dataclass
class StoredResponse:
    response: Any  # protocol_responses.ResponseObject
    conversation: list[dict[str, Any]]  # the chat messages of input and output, instructions left out
    num_bytes: int


class ResponseStore:
    """LRU of responses by id, at most ``max_count`` entries and ``max_bytes`` of JSON (0 count: off).

    Raises ValueError for a negative limit.
    """

    def __init__(self, max_count: int = DEFAULT_MAX_COUNT, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_count < 0 or max_bytes < 0:
            raise ValueError(f"the response store's limits must be >= 0, got {max_count} responses, {max_bytes} bytes")
        self.max_count, self.max_bytes = max_count, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_bytes = 0

    @property
    def is_enabled(self) -> bool:
        return self.max_count > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: Any, conversation: list[dict[str, Any]], num_bytes: int) -> None:
        """Keep (or replace) ``response``; older entries leave until both limits hold. An entry larger than
        ``max_bytes`` alone is not kept."""
        self.pop(response.id)
        if not self.is_enabled or num_bytes > self.max_bytes:
            return
        self._entries[response.id] = StoredResponse(response, conversation, num_bytes)
        self.num_bytes += num_bytes
        while len(self._entries) > self.max_count or self.num_bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.num_bytes -= old.num_bytes

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def pop(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= entry.num_bytes
        return entry
