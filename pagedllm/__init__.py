"""pagedllm: LLM inference and serving with a paged KV-cache. Names import lazily: ``pagedllm.core`` needs no torch."""

from __future__ import annotations

import importlib
import os
from typing import Any

from pagedllm import runtime_env

# A decode step is hundreds of short parallel regions; on shared cores a spinning team waits at every
# barrier for a descheduled thread (benchmarks/omp_wait_policy.py). Read when torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
runtime_env.apply(os.environ)

__version__ = "0.1.0"

_LAZY = {
    "LLM": "pagedllm.llm",
    "SamplingParams": "pagedllm.sampling_params",
    "RequestOutputKind": "pagedllm.sampling_params",
    "RequestOutput": "pagedllm.outputs",
    "CompletionOutput": "pagedllm.outputs",
    "Logprob": "pagedllm.outputs",
    "EngineConfig": "pagedllm.config",
    "LLMEngine": "pagedllm.engine.llm_engine",
    "plan": "pagedllm.planner",
    "LoRARequest": "pagedllm.lora.request",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
