"""AWQ checkpoints (AutoAWQ's GEMM packing) → pagedllm's int4 values, exactly.

Per projection (K inputs, N outputs, G groups): ``qweight`` (K, N / 8) int32 and ``qzeros`` (G, N / 8)
int32, both packed along N in AutoAWQ's order (word element j holds output ``8 c + AWQ_ORDER[j]``),
``scales`` (G, N) float16. The weight is ``w[n, k] = scales[g, n] * (q[k, n] - z[g, n])``,
``g = k // group_size`` (AutoAWQ's ``dequantize_gemm``); without zero points ``z = 8``.
"""

from __future__ import annotations

import torch

from pagedllm.quantization.packed_ints import unpack_int32

SUFFIXES = ("qweight", "qzeros", "scales")
OPTIONAL_SUFFIXES = ()
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# position of output j's value among its word's elements
_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def required_suffixes(has_zero_points: bool) -> tuple[str, ...]:
    return ("qweight", "scales") + (("qzeros",) if has_zero_points else ())


def _unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """(R, N / 8) int32 in AWQ order → (R, N) int32 in output order."""
    values = unpack_int32(packed, 4, dim=1)  # (R, N): word element order
    order = torch.tensor(_REVERSE_ORDER, device=packed.device)
    index = (torch.arange(0, values.shape[1], 8, device=packed.device).view(-1, 1) + order).flatten()
    return values[:, index]


def values_zeros_scales(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (N, K) int32 in [0, 15], zero points (N, G) int32, scales (N, G) float32."""
    q = _unpack_columns(tensors["qweight"]).t()
    scales = tensors["scales"].float().t()
    qzeros = tensors.get("qzeros")
    zeros = torch.full_like(scales, 8, dtype=torch.int32) if qzeros is None else _unpack_columns(qzeros).t()
    return q.contiguous(), zeros.contiguous(), scales.contiguous()
