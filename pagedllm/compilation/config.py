"""``compilation_config``: whether and how the model is compiled (vLLM's option, its names).

Accepted forms, as vLLM accepts them: ``None`` (eager), an int (the mode: ``0`` or ``3``),
a dict or a JSON object string (``'{"mode": 3}'``, the ``--compilation-config`` flag), or a
:class:`CompilationConfig`. Imports no torch: :class:`pagedllm.config.EngineConfig`
validates it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

BACKENDS = ("inductor", "aot_eager", "eager")
_FIELD = "compilation_config"


class CompilationMode(IntEnum):
    """vLLM's ``CompilationMode`` values this engine implements."""

    NONE = 0  # eager
    VLLM_COMPILE = 3  # the model compiled around the opaque paged-attention op


@dataclass(frozen=True)
class CompilationConfig:
    """How the model runner compiles the model's forward.

    Attributes:
        mode: 0 (eager, the default) or 3 (compiled: torch.compile of the whole forward
            with the paged attention as an opaque custom op; vLLM's ``VLLM_COMPILE``).
        backend: the torch.compile backend: ``inductor`` (generates fused C++ kernels;
            the point of compiling), or ``aot_eager`` / ``eager`` (trace only; debugging).
        dynamic: compile one graph with the token count symbolic (True, default), so every
            step size runs the same code; False compiles a graph per token count in
            ``compile_sizes`` only and runs other sizes eagerly.
        compile_sizes: token counts compiled (and warmed up) at start-up; with
            ``dynamic=True`` the sizes that specialise (1, and one size >= 2) are added.
            Each must be a positive integer.
        inductor_compile_config: inductor options (``torch._inductor.config`` names), applied
            while compiling; the defaults are ``{"freezing": True}`` (weights become
            constants: folded and prepacked for oneDNN).

    Raises ValueError naming the field (``compilation_config.<name>``) for a bad value.
    """

    mode: int = CompilationMode.NONE
    backend: str = "inductor"
    dynamic: bool = True
    compile_sizes: tuple[int, ...] = ()
    inductor_compile_config: dict[str, Any] = field(default_factory=lambda: {"freezing": True})

    def __post_init__(self) -> None:
        if isinstance(self.mode, bool) or not isinstance(self.mode, int) or self.mode not in tuple(CompilationMode):
            raise ValueError(f"{_FIELD}.mode must be 0 (eager) or 3 (compiled), got {self.mode!r}")
        object.__setattr__(self, "mode", CompilationMode(self.mode))
        if self.backend not in BACKENDS:
            raise ValueError(f"{_FIELD}.backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not isinstance(self.dynamic, bool):
            raise ValueError(f"{_FIELD}.dynamic must be true or false, got {self.dynamic!r}")
        sizes = self.compile_sizes
        if not isinstance(sizes, (list, tuple)) or any(
                isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"{_FIELD}.compile_sizes must be a list of positive integers, got {sizes!r}")
        object.__setattr__(self, "compile_sizes", tuple(sorted(set(sizes))))
        if not self.dynamic and not self.compile_sizes and self.is_compiled:
            raise ValueError(f"{_FIELD}.compile_sizes must not be empty when {_FIELD}.dynamic is false")
        if not isinstance(self.inductor_compile_config, dict) or not all(
                isinstance(k, str) for k in self.inductor_compile_config):
            raise ValueError(f"{_FIELD}.inductor_compile_config must be an object of inductor option names, "
                             f"got {self.inductor_compile_config!r}")

    @property
    def is_compiled(self) -> bool:
        return self.mode == CompilationMode.VLLM_COMPILE

    @classmethod
    def parse(cls, value: "CompilationConfig | dict | int | str | None") -> "CompilationConfig":
        """The config for any accepted form (see the module docstring). Raises ValueError
        naming ``compilation_config`` (or the bad key) for anything else."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            value = _parse_text(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(mode=value)
        if not isinstance(value, dict):
            raise ValueError(f"{_FIELD} must be a mode (0 or 3), an object or a JSON object string, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"{_FIELD} has unknown keys {unknown}; known: {', '.join(sorted(known))}")
        options = dict(value)
        if "inductor_compile_config" in options and isinstance(options["inductor_compile_config"], dict):
            options["inductor_compile_config"] = {"freezing": True, **options["inductor_compile_config"]}
        return cls(**options)


def _parse_text(text: str) -> Any:
    """A command-line value: a bare mode (``"3"``) or a JSON object."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{_FIELD} must be a mode (0 or 3) or a JSON object, got {text!r} ({e.msg})") from None
