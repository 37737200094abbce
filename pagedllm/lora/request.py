"""``LoRARequest``: which adapter a request runs under (vLLM's type and field names). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a positive integer id unique per adapter, and its PEFT folder.

    ``lora_int_id`` names the adapter inside the engine (slots, prefix-cache keys); two requests with
    the same id must mean the same weights. Raises ValueError naming the field for a bad value."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_path must be a folder path, got {self.lora_path!r}")

    @property
    def cache_key(self) -> tuple:
        """What enters the first block's hash: different adapters never share prefix-cache blocks."""
        return ("lora", self.lora_int_id, self.lora_name, self.lora_path)


class LoRAError(ValueError):
    """An adapter that cannot be served (bad folder, config, tensors or shapes, unknown name); HTTP 400."""


class LoRAInUseError(RuntimeError):
    """An adapter that unfinished requests still run under cannot be unloaded; HTTP 409."""
