"""The quant-method seam (after vLLM's ``LinearMethodBase``): how a linear layer keeps W and computes ``x @ W.T``.

A weight's life: ``create_weights``, ``load_weights``, ``process_weights_after_loading``, ``apply``.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterator, Mapping

import torch
from torch import nn

logger = logging.getLogger("pagedllm")

# A float tile of this many bytes stays in L2 while the matmul reads it.
_TILE_BYTES = 256 * 1024


class LinearMethod:
    """How one ``nn.Linear`` keeps and applies its weight (out_features, in_features)."""

    def create_weights(self, layer: nn.Module) -> None:
        """Before loading: give ``layer`` the parameters the loader fills (default: the float weight)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """After loading: convert the weight into the kept format and free the original."""
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x: (T, in_features) float -> (T, out_features) in x's dtype (plus the layer's bias)."""
        raise NotImplementedError

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The float32 weight (out_features, in_features) the kept format represents."""
        raise NotImplementedError

    def tie(self, embedding: nn.Module) -> None:
        """Before loading, for the method of a head tied to ``embedding``: default nothing (a method that can
        serve the embedding's lookups from its own format may take them over after loading)."""


class QuantizationConfig:
    """Chooses a :class:`LinearMethod` per linear layer (None: keep it float)."""

    name: str = ""
    # whether an LM head tied to the embedding is quantized too (the embedding keeps its float rows)
    quantizes_tied_head = False

    def get_linear_method(self, prefix: str, layer: nn.Module) -> LinearMethod | None:
        raise NotImplementedError

    def get_tied_head_method(self, layer: nn.Module) -> LinearMethod | None:
        """The method of an LM head tied to the embedding (which keeps its float rows for the lookup), or
        None; by default the linear method of ``lm_head`` when ``quantizes_tied_head``."""
        return self.get_linear_method("lm_head", layer) if self.quantizes_tied_head else None

    def describe(self) -> str:
        """The format as the start-up line states it (after every layer's method was chosen)."""
        return self.name

    @property
    def packed_weight_names(self) -> Mapping[str, int] | frozenset[str]:
        """Checkpoint tensors the loader yields as stored: GGUF blocks (a mapping: -> the row width they
        are padded to), a pre-quantized checkpoint's tensors."""
        return frozenset()

    def convert_checkpoint(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The weight stream as ``load_weights`` takes it (default: unchanged)."""
        return weights


def quantizable_linears(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """Every ``nn.Linear`` but a head tied to the embedding (its lookup needs float rows)."""
    tied = tied_head(model)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module is not tied:
            yield name, module


def tied_head(model: nn.Module) -> nn.Linear | None:
    """The ``nn.Linear`` whose weight is the embedding's (``model.model.embed_tokens``), or None."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    tied_weight = getattr(embed, "weight", None)
    if tied_weight is None:
        return None
    # getattr: a quantized layer has no float weight any more
    return next((m for m in model.modules() if isinstance(m, nn.Linear)
                 and getattr(m, "weight", None) is tied_weight), None)


def create_quantized_weights(model: nn.Module, config: QuantizationConfig) -> int:
    """Set each ``layer.quant_method`` and create its weights (before ``load_weights``); returns the count."""
    count = 0
    for name, layer in list(quantizable_linears(model)):
        method = config.get_linear_method(name, layer)
        if method is None:
            continue
        method.create_weights(layer)
        layer.quant_method = method
        count += 1
    head = tied_head(model)
    method = config.get_tied_head_method(head) if head is not None else None
    if method is not None:
        method.create_weights(head)
        method.tie(model.model.embed_tokens)
        head.quant_method = method
        count += 1
    return count


def process_quantized_weights(model: nn.Module) -> None:
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)


def replace_weight(layer: nn.Module, weight: torch.Tensor | None) -> None:
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
    """``x @ W.T`` (T, out), W built a tile of rows at a time by ``dequantize_rows(start, end)``."""
    out_t = torch.empty(out_features, x.shape[0], dtype=x.dtype, device=x.device)  # (N, T): tiles are rows
    x_t = x.t()
    for start in range(0, out_features, rows_per_tile):
        end = min(start + rows_per_tile, out_features)
        torch.mm(dequantize_rows(start, end), x_t, out=out_t[start:end])
    return out_t.t().contiguous()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights: parameters (shared once), quantized layers' buffers and ``kernel_*`` copies."""
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
