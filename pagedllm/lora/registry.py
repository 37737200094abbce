"""The engine's adapters by name (pure Python): what ``/v1/models`` lists and a request's ``model``
names. Ids are handed out here for adapters named without one (``lora_modules``, the load endpoint)."""

from __future__ import annotations

from pagedllm.lora.request import LoRAError, LoRARequest


class LoRARegistry:
    """Adapters known to the engine, by ``lora_name``; ids unique, never reused while the engine lives
    (a freed id's cached blocks must not match a new adapter)."""

    def __init__(self) -> None:
        self.by_name: dict[str, LoRARequest] = {}
        self._next_id = 1

    def new_request(self, name: str, path: str) -> LoRARequest:
        """A request with a fresh id for ``name`` at ``path``; LoRAError when the name is taken."""
        if name in self.by_name:
            raise LoRAError(f"an adapter named {name!r} is already loaded")
        request = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        return request

    def add(self, request: LoRARequest) -> None:
        """Record a loaded adapter; LoRAError when its name or id is another adapter's."""
        known = self.by_name.get(request.lora_name)
        if known is not None and known != request:
            raise LoRAError(f"an adapter named {request.lora_name!r} is already loaded (id {known.lora_int_id})")
        other = next((r for r in self.by_name.values() if r.lora_int_id == request.lora_int_id and r != request), None)
        if other is not None:
            raise LoRAError(f"lora_int_id {request.lora_int_id} is already adapter {other.lora_name!r}")
        self.by_name[request.lora_name] = request
        self._next_id = max(self._next_id, request.lora_int_id + 1)

    def get(self, name: str) -> LoRARequest | None:
        return self.by_name.get(name)

    def remove(self, name: str) -> LoRARequest:
        """Forget ``name``; LoRAError when unknown."""
        request = self.by_name.pop(name, None)
        if request is None:
            raise LoRAError(f"no adapter named {name!r} is loaded")
        return request

    def list(self) -> list[LoRARequest]:
        return list(self.by_name.values())
