"""Model implementations (one file per architecture family) and the architecture registry."""

from pagedllm.models.registry import get_model_class, supported_architectures

__all__ = ["get_model_class", "supported_architectures"]
