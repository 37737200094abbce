"""Paged attention: the backend interface, backends, and the attention layer models use.

- :func:`get_attention_backend` picks a backend for a device.
- :class:`Attention` is the ``nn.Module`` a model puts in each layer: it holds that layer's
  KV cache (bound by the model runner) and reads the step's
  :class:`~pagedllm.attention.backend.AttentionMetadata` from the forward context.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import nn

from pagedllm.attention.backend import (AttentionBackend, AttentionMetadata, ForwardContext, attention_mask,
                                        get_forward_context, masked_attention, set_forward_context)
from pagedllm.attention.cpu_paged import CpuPagedAttention
from pagedllm.attention.torch_paged import TorchPagedAttention
from pagedllm.ops import recording

__all__ = ["Attention", "AttentionBackend", "AttentionMetadata", "CpuPagedAttention", "ForwardContext",
           "TorchPagedAttention", "get_attention_backend", "get_forward_context", "set_forward_context"]

_BACKEND_ENV = "PAGEDLLM_ATTENTION_BACKEND"


_BACKENDS = ("auto", "torch", "cpu", "triton", "flashinfer")


def get_attention_backend(device: torch.device | str) -> AttentionBackend:
    """The attention backend for ``device`` (``"cpu"``, ``"cuda"``, ``torch.device``).

    By default CPU gets :class:`~pagedllm.attention.cpu_paged.CpuPagedAttention` (fused C
    decode kernel, compiled on first use) when the kernel builds, else
    :class:`TorchPagedAttention`; CUDA gets FlashInfer
    (:mod:`pagedllm.attention.flashinfer_paged`) when the ``flashinfer`` package is
    importable, else the Triton kernels (:mod:`pagedllm.attention.triton_paged`) when
    ``triton`` is, else :class:`TorchPagedAttention`. ``PAGEDLLM_ATTENTION_BACKEND``
    overrides: ``torch`` (the PyTorch reference, any device), ``cpu`` (the C kernel; falls
    back to torch with a warning if it does not build), ``triton`` (on CPU only under
    ``TRITON_INTERPRET=1``), ``flashinfer`` (CUDA only).
    Raises ValueError for an unknown device type or backend name, when ``triton`` or
    ``flashinfer`` is asked for but not installed, or a backend is asked for on a device it
    does not run on.
    """
    device = torch.device(device)
    choice = os.environ.get(_BACKEND_ENV, "auto").lower()
    if choice not in _BACKENDS:
        raise ValueError(f"{_BACKEND_ENV} must be one of {', '.join(_BACKENDS)}, got {choice!r}")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"no attention backend for device type {device.type!r} (supported: cpu, cuda)")
    if choice == "flashinfer" or (choice == "auto" and device.type == "cuda" and _importable("flashinfer")):
        if device.type != "cuda":
            raise ValueError(f"{_BACKEND_ENV}=flashinfer needs a CUDA device, got {device.type!r}")
        if not _importable("flashinfer"):
            raise ValueError(f"{_BACKEND_ENV}=flashinfer needs the flashinfer package (pip install pagedllm[flashinfer])")
        from pagedllm.attention.flashinfer_paged import FlashInferPagedAttention
        return FlashInferPagedAttention()
    if choice == "triton" or (choice == "auto" and device.type == "cuda" and _importable("triton")):
        try:
            from pagedllm.attention.triton_paged import TritonPagedAttention
        except ImportError as e:
            raise ValueError(f"{_BACKEND_ENV}=triton needs the triton package ({e})") from e
        return TritonPagedAttention()
    if choice == "cpu" and device.type != "cpu":
        raise ValueError(f"{_BACKEND_ENV}=cpu needs a CPU device, got {device.type!r}")
    if choice in ("auto", "cpu") and device.type == "cpu":
        backend = CpuPagedAttention()
        if backend.is_kernel_available:
            return backend
    return TorchPagedAttention()


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


class Attention(nn.Module):
    """Causal self-attention over the paged KV cache of one layer (no weights).

    Args:
        num_heads: query heads; num_kv_heads: key/value heads (divides ``num_heads``);
        head_dim: size of each head; scale: softmax scale;
        backend: shared :class:`AttentionBackend` (one per model is enough);
        sliding_window: W for a sliding-window layer (a token sees the W keys ending at
            itself), None for full attention;
        logit_soft_cap: c to cap scores as ``c * tanh(s / c)`` (Gemma 2), or None.

    ``kv_cache`` is ``None`` until the runner binds a
    ``(2, num_blocks, block_size, num_kv_heads, head_dim)`` tensor; an int8 cache comes with
    ``kv_scales`` ``(2, num_blocks, block_size, num_kv_heads)`` float32, passed to the backend.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend: AttentionBackend, sliding_window: int | None = None,
                 logit_soft_cap: float | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_soft_cap = logit_soft_cap or None
        self.backend = backend
        self.kv_cache: torch.Tensor | None = None
        self.kv_scales: torch.Tensor | None = None  # an int8 cache's per token-and-head scales
        # KV-cache group whose block tables this layer reads (set by the model runner
        # with the cache; see pagedllm.core.kv_cache_groups).
        self.kv_cache_group = 0
        # Set by pagedllm.compilation: the name torch.compile's graph calls this layer by
        # (one opaque op per layer); None = never compiled.
        self.compiled_op_name: str | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query: (T, num_heads, head_dim); key/value: (T, num_kv_heads, head_dim) -> (T, num_heads, head_dim).

        While torch.compile traces a registered layer, one opaque op
        (:mod:`pagedllm.compilation.attention_op`) that runs :meth:`forward_eager`; otherwise
        :meth:`forward_eager` itself. While a pass is recorded for replay
        (:mod:`pagedllm.ops.recording`), the call is recorded as a whole: attention reads the
        step's metadata, so each replay runs it again for its own step, into the same output.
        """
        if self.compiled_op_name is not None and torch.compiler.is_compiling():
            return torch.ops.pagedllm.paged_attention(query, key, value, self.compiled_op_name)
        rec = recording.current()
        if rec is not None:
            return self._record(rec, query, key, value)
        return self.forward_eager(query, key, value)

    def _record(self, rec: recording.Recording, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor) -> torch.Tensor:
        """:meth:`forward_eager`, recorded as a callable that writes each replay's result into
        this pass's output tensor (the later recorded calls read it there)."""
        with rec.allowed():
            result = self.forward_eager(query, key, value)
            out = rec.buffer_like(result)  # pool memory, reused once the pass is done with it
            out.copy_(result)
        q, k, v, o = (rec.alias(t) for t in (query, key, value, out))

        def replay() -> None:
            o.copy_(self.forward_eager(q, k, v))

        rec.add_python(replay)
        return out

    def forward_eager(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The attention itself, shapes as :meth:`forward`.

        With step metadata in the forward context, K/V are written to the bound cache and
        each request attends to its own cached context. With ``attn_metadata=None`` (memory
        profiling, quick checks) the T tokens are one causal sequence and no cache is touched.
        Raises RuntimeError when metadata is present but no cache is bound, or outside
        :func:`set_forward_context`.
        """
        metadata = get_forward_context().metadata_for(self.kv_cache_group)
        if metadata is None:
            positions = torch.arange(query.shape[0], device=query.device)
            mask = None if self.sliding_window is None else attention_mask(positions, positions, self.sliding_window)
            out = masked_attention(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), mask,
                                   self.scale, self.logit_soft_cap)
            return out.transpose(0, 1)  # (T, num_heads, head_dim)
        if self.kv_cache is None:
            raise RuntimeError("attention metadata given but no KV cache bound: call model.bind_kv_caches() first")
        options = {"sliding_window": self.sliding_window, "logit_soft_cap": self.logit_soft_cap}
        if self.kv_scales is not None:  # only backends that store int8 K/V take scales
            options["kv_scales"] = self.kv_scales
        return self.backend.forward(query, key, value, self.kv_cache, metadata, self.scale, **options)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"sliding_window={self.sliding_window}, logit_soft_cap={self.logit_soft_cap}")
