"""Opt-in torch.compile of the model around the paged-attention op (vLLM's ``compilation_config``,
parsed torch-free by :class:`pagedllm.config.CompilationConfig`).

- :mod:`~pagedllm.compilation.attention_op`: the paged attention as one opaque
  ``torch.library`` custom op the compiled graph calls.
- :mod:`~pagedllm.compilation.compiled_model`: the compiled forward with its start-up
  warm-up, no recompilation per step, and the eager fallback.
"""
