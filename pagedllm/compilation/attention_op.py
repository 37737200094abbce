"""The paged attention as one opaque op of the compiled graph, ``torch.ops.pagedllm.paged_attention`` (vLLM's
``unified_attention``). The KV-cache write is a side effect the graph does not see; each op depends on the
previous layer's output, so the calls keep their order."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from pagedllm.attention import Attention

_LAYERS: "weakref.WeakValueDictionary[str, Attention]" = weakref.WeakValueDictionary()


@torch.library.custom_op("pagedllm::paged_attention", mutates_args=())
def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_name: str) -> torch.Tensor:
    """query (T, num_heads, head_dim), key/value (T, num_kv_heads, head_dim) -> (T, num_heads, head_dim)
    contiguous. Raises KeyError for a name :func:`register_attention_layers` never gave."""
    return _LAYERS[layer_name].forward_eager(query, key, value).contiguous()


@paged_attention.register_fake
def _paged_attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          layer_name: str) -> torch.Tensor:
    return query.new_empty(query.shape)


def register_attention_layers(model: nn.Module) -> list[str]:
    """Give every :class:`Attention` of ``model`` a process-unique name routed through the op while
    torch.compile traces; returns the names in layer order."""
    names = []
    for i, layer in enumerate(m for m in model.modules() if isinstance(m, Attention)):
        name = f"{id(model):x}.{i}"
        _LAYERS[name] = layer
        layer.compiled_op_name = name
        names.append(name)
    return names
