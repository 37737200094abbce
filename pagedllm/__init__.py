"""pagedllm: LLM inference and serving with a paged KV-cache.

Public API (imported lazily so ``import pagedllm.core`` needs no torch)::

    from pagedllm import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct", enable_prefix_caching=True)
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0.7, top_p=0.9))
"""

from __future__ import annotations

import importlib
from typing import Any

# OpenMP's wait policy is left to the runtime (libgomp: spin briefly between parallel regions,
# then sleep). A decode step is hundreds of short torch/C parallel regions separated by Python;
# waking a sleeping team (OMP_WAIT_POLICY=PASSIVE) for each costs more than the spin, measured
# on 2 cores in benchmarks/results/omp_wait_policy_*.json. Users and the test suite (Makefile)
# may still set it.

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
