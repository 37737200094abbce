"""Paged attention: the backends, :func:`get_attention_backend`, and the :class:`Attention` layer."""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from pagedllm import envs
from pagedllm.attention.backend import (AttentionBackend, AttentionImpl, AttentionMetadata, ForwardContext,
                                        attention_mask, get_forward_context, masked_attention, set_forward_context)
from pagedllm.attention.cpu_paged import CpuPagedAttention
from pagedllm.attention.torch_paged import TorchPagedAttention
from pagedllm.ops import recording

__all__ = ["Attention", "AttentionBackend", "AttentionImpl", "AttentionMetadata", "CpuPagedAttention",
           "ForwardContext", "TorchPagedAttention", "get_attention_backend", "get_forward_context",
           "set_forward_context"]

BACKENDS = envs.ATTENTION_BACKEND.choices


def get_attention_backend(device: torch.device | str, choice: str = "auto") -> AttentionBackend:
    """The backend ``choice`` (``EngineConfig.attention_backend``) names for ``device``: ``auto`` is the C
    kernels on CPU when they build, else torch; FlashInfer, else Triton, else torch on CUDA. Raises
    ValueError naming ``attention_backend`` for an unknown name, a missing package or an unsupported device."""
    device = torch.device(device)
    if choice not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {choice!r}")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"no attention backend for device type {device.type!r} (supported: cpu, cuda)")
    is_auto_cuda = choice == "auto" and device.type == "cuda"
    if choice == "flashinfer" or (is_auto_cuda and _importable("flashinfer")):
        if device.type != "cuda":
            raise ValueError(f"attention_backend=flashinfer needs a CUDA device, got {device.type!r}")
        if not _importable("flashinfer"):
            raise ValueError("attention_backend=flashinfer needs the flashinfer package "
                             "(pip install pagedllm[flashinfer])")
        from pagedllm.attention.flashinfer_paged import FlashInferPagedAttention
        return FlashInferPagedAttention()
    if choice == "triton" or (is_auto_cuda and _importable("triton")):
        try:
            from pagedllm.attention.triton_paged import TritonPagedAttention
        except ImportError as e:
            raise ValueError(f"attention_backend=triton needs the triton package ({e})") from e
        return TritonPagedAttention()
    if choice == "cpu" and device.type != "cpu":
        raise ValueError(f"attention_backend=cpu needs a CPU device, got {device.type!r}")
    if choice in ("auto", "cpu") and device.type == "cpu":
        backend = CpuPagedAttention()
        if backend.is_kernel_available:
            return backend
    return TorchPagedAttention()


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


class Attention(nn.Module):
    """Causal self-attention over one layer's paged KV cache (no weights); ``num_heads`` a multiple of
    ``num_kv_heads`` (ValueError otherwise). The runner binds ``kv_cache`` (2, num_blocks, block_size,
    num_kv_heads, head_dim), an int8 cache's ``kv_scales`` (2, num_blocks, block_size, num_kv_heads) float32
    and ``kv_cache_group``."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend: AttentionBackend, sliding_window: int | None = None,
                 logit_soft_cap: float | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.impl = backend.make_impl(scale, sliding_window, logit_soft_cap)
        self.kv_cache: torch.Tensor | None = None
        self.kv_scales: torch.Tensor | None = None
        self.kv_cache_group = 0
        # set by pagedllm.compilation: the name the compiled graph's opaque op calls this layer by
        self.compiled_op_name: str | None = None

    @property
    def backend(self) -> AttentionBackend:
        return self.impl.backend

    @backend.setter
    def backend(self, backend: AttentionBackend) -> None:
        self.impl = backend.make_impl(*self.impl.options)

    @property
    def sliding_window(self) -> int | None:
        return self.impl.sliding_window

    @property
    def logit_soft_cap(self) -> float | None:
        return self.impl.logit_soft_cap

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query (T, num_heads, head_dim), key/value (T, num_kv_heads, head_dim) -> (T, num_heads, head_dim).
        An opaque op under torch.compile; one recorded call while a pass is recorded."""
        if self.compiled_op_name is not None and torch.compiler.is_compiling():
            return torch.ops.pagedllm.paged_attention(query, key, value, self.compiled_op_name)
        rec = recording.current()
        if rec is not None:
            return self._record(rec, query, key, value)
        return self.forward_eager(query, key, value)

    def _record(self, rec: recording.Recording, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor) -> torch.Tensor:
        """:meth:`forward_eager`, recorded as a callable writing each replay's result into this pass's output."""
        with rec.allowed():
            result = self.forward_eager(query, key, value)
            out = rec.buffer_like(result)
            out.copy_(result)
        q, k, v, o = (rec.alias(t) for t in (query, key, value, out))

        def replay() -> None:
            o.copy_(self.forward_eager(q, k, v))

        group = self.kv_cache_group
        metadata = get_forward_context().metadata_for(group)
        native = None
        if metadata is not None and self.kv_cache is not None:
            native = self.impl.decode_tasks(q, k, v, self.kv_cache, self.kv_scales, o, metadata)
        if native is None:
            rec.add_python(replay)
            return out
        tasks, refresh = native
        rec.keep.append(self.kv_cache)  # the tasks hold its address (the runner drops the graphs on a rebind)
        rec.add_python(replay, tasks, ((id(self.impl.backend), group, tuple(self.kv_cache.shape)),
                                       lambda: refresh(get_forward_context().metadata_for(group))))
        return out

    def forward_eager(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The attention itself; without step metadata (profiling) the T tokens are one causal sequence.
        Raises RuntimeError when metadata comes without a bound cache, or outside :func:`set_forward_context`."""
        metadata = get_forward_context().metadata_for(self.kv_cache_group)
        impl = self.impl
        if metadata is None:
            positions = torch.arange(query.shape[0], device=query.device)
            mask = None if impl.sliding_window is None else attention_mask(positions, positions, impl.sliding_window)
            out = masked_attention(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), mask,
                                   impl.scale, impl.logit_soft_cap)
            return out.transpose(0, 1)  # (T, num_heads, head_dim)
        if self.kv_cache is None:
            raise RuntimeError("attention metadata given but no KV cache bound: call model.bind_kv_caches() first")
        return impl.forward(query, key, value, self.kv_cache, metadata, self.kv_scales)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"sliding_window={self.sliding_window}, logit_soft_cap={self.logit_soft_cap}")
