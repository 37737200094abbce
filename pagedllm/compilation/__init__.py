"""Opt-in torch.compile of the model around the paged-attention op (vLLM's ``compilation_config``).
Imports no torch."""

from pagedllm.compilation.config import CompilationConfig, CompilationMode

__all__ = ["CompilationConfig", "CompilationMode"]
