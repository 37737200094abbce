"""The quant-method seam: how a linear layer stores its weight and computes ``x @ W.T``.

Modelled on vLLM's ``QuantizeMethodBase`` / ``LinearMethodBase``: a
:class:`QuantizationConfig` picks a :class:`LinearMethod` for each linear layer of a model
(or none: the layer stays a plain float matmul); the method then owns the layer's weight
for the rest of its life:

1. :meth:`LinearMethod.create_weights` runs after the model is built and before weights
   load. A method that receives its weight already quantized (GGUF blocks) replaces
   ``layer.weight`` with the storage the loader fills; others leave the float weight.
2. The model's ordinary ``load_weights`` copies checkpoint tensors in (fused q/k/v and
   gate/up shards are rows of the weight, so row-wise storage shards the same way).
3. :meth:`LinearMethod.process_weights_after_loading` turns what was loaded into the kept
   format (quantizing a float weight, or converting GGUF blocks) and frees the original.
4. ``Linear.forward`` calls :meth:`LinearMethod.apply` instead of ``F.linear``.

Model files never branch on the format. Matmuls run through torch's own CPU kernels where
they exist and are fast, else weights are dequantized one tile of output rows at a time
(:func:`tiled_linear`): the float copy of the whole matrix never exists.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterator

import torch
from torch import nn

logger = logging.getLogger("pagedllm")

# A float tile of this many bytes stays in L2 while the matmul reads it.
_TILE_BYTES = 256 * 1024


class LinearMethod:
    """How one linear layer keeps and applies its weight. Subclasses override all four calls.

    ``layer`` is an ``nn.Linear`` (``in_features``, ``out_features``, ``weight``
    (out_features, in_features), ``bias`` (out_features,) or None).
    """

    def create_weights(self, layer: nn.Module) -> None:
        """Before loading: give ``layer`` the parameters the loader fills. Default: keep the float weight."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """After loading: convert the loaded weight into the kept format, free the original."""
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x: (T, in_features) float -> (T, out_features) in x's dtype (plus the layer's bias)."""
        raise NotImplementedError

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The float32 weight (out_features, in_features) the kept format represents (tests, checks)."""
        raise NotImplementedError


class QuantizationConfig:
    """Chooses a :class:`LinearMethod` per linear layer (None = keep it float).

    ``name`` is the ``quantization`` value that selects it; ``packed_weight_names`` are the
    checkpoint tensors the loader must hand over still quantized (GGUF only).
    """

    name: str = ""

    def get_linear_method(self, prefix: str, layer: nn.Module) -> LinearMethod | None:
        """The method for the layer at ``prefix`` (module path, e.g. ``model.layers.0.mlp.down_proj``)."""
        raise NotImplementedError

    @property
    def packed_weight_names(self) -> frozenset[str]:
        return frozenset()


def quantizable_linears(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """The model's projection layers a weight format may replace: every ``nn.Linear`` except a
    LM head whose weight is the token embedding (tied: the embedding lookup needs float rows)."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    tied_weight = getattr(embed, "weight", None)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not (tied_weight is not None and module.weight is tied_weight):
            yield name, module


def create_quantized_weights(model: nn.Module, config: QuantizationConfig) -> int:
    """Attach each layer's method (``layer.quant_method``) and let it create its weights.

    Call after building the model, before ``load_weights``. Returns how many layers got a method.
    """
    count = 0
    for name, layer in list(quantizable_linears(model)):
        method = config.get_linear_method(name, layer)
        if method is None:
            continue
        method.create_weights(layer)
        layer.quant_method = method
        count += 1
    return count


def process_quantized_weights(model: nn.Module) -> None:
    """Convert every quantized layer's loaded weight into its kept format (after ``load_weights``)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)


def replace_weight(layer: nn.Module, weight: torch.Tensor | None) -> None:
    """Swap ``layer.weight`` for ``weight`` (a non-trainable parameter), or drop it when None."""
    if "weight" in layer._parameters:
        del layer._parameters["weight"]
    if weight is not None:
        layer.weight = nn.Parameter(weight, requires_grad=False)


def tile_rows(in_features: int, dtype: torch.dtype) -> int:
    """Output rows per dequantized tile: about ``_TILE_BYTES`` of ``dtype``, a multiple of 16."""
    rows = _TILE_BYTES // (in_features * torch.tensor([], dtype=dtype).element_size())
    return max(16, rows // 16 * 16)


def tiled_linear(x: torch.Tensor, out_features: int, dequantize_rows: Callable[[int, int], torch.Tensor],
                 rows_per_tile: int) -> torch.Tensor:
    """``x @ W.T`` with W built a tile of output rows at a time by ``dequantize_rows(start, end)``.

    Args:
        x: (T, in_features). dequantize_rows: returns rows ``[start, end)`` of W as
            (end - start, in_features) in x's dtype. rows_per_tile: tile height.
    Returns:
        (T, out_features) in x's dtype, contiguous.
    """
    out_t = torch.empty(out_features, x.shape[0], dtype=x.dtype, device=x.device)  # (N, T): tiles are rows
    x_t = x.t()
    for start in range(0, out_features, rows_per_tile):
        end = min(start + rows_per_tile, out_features)
        torch.mm(dequantize_rows(start, end), x_t, out=out_t[start:end])
    return out_t.t().contiguous()


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights take: every parameter (shared ones once) plus, for layers kept
    quantized, their stored buffers and any kernel-layout copy (``kernel_*`` attributes)."""
    seen, total = set(), 0
    tensors = list(model.parameters())
    for module in model.modules():
        if getattr(module, "quant_method", None) is not None:
            tensors += list(module.buffers(recurse=False))
            tensors += [v for k, v in vars(module).items() if k.startswith("kernel_") and isinstance(v, torch.Tensor)]
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
