"""pagedllm: LLM inference and serving with a paged KV-cache.

Public API (imported lazily so ``import pagedllm.core`` needs no torch)::

    from pagedllm import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct", enable_prefix_caching=True)
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0.7, top_p=0.9))
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from pagedllm import runtime_env

# Idle OpenMP threads sleep (PASSIVE) unless the user sets OMP_WAIT_POLICY: a decode step is
# hundreds of short parallel regions, and on a machine where other processes compete for the
# cores a spinning team waits at every barrier for a descheduled thread, many times slower.
# On a dedicated machine spinning is faster: set OMP_WAIT_POLICY=ACTIVE (both measured by
# benchmarks/omp_wait_policy.py). Only effective before torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# LRU_CACHE_CAPACITY=0 crashes oneDNN on the first linear layer: replaced, with a warning.
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
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
