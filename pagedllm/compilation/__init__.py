"""Opt-in torch.compile of the model around the paged-attention op (vLLM's ``compilation_config``).

- :mod:`~pagedllm.compilation.config`: :class:`CompilationConfig`, parsed and validated
  without torch (``EngineConfig`` reads it).
- :mod:`~pagedllm.compilation.attention_op`: the paged attention as one opaque
  ``torch.library`` custom op the compiled graph calls.
- :mod:`~pagedllm.compilation.compiled_model`: the compiled forward with its start-up
  warm-up, no recompilation per step, and the eager fallback.

This ``__init__`` imports no torch.
"""

from pagedllm.compilation.config import CompilationConfig, CompilationMode

__all__ = ["CompilationConfig", "CompilationMode"]
