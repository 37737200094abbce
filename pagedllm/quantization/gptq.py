"""GPTQ checkpoints (AutoGPTQ / GPTQModel) → pagedllm's int4 / int8 values, exactly.

Per projection (K inputs, N outputs, G groups): ``qweight`` (K * bits / 32, N) int32 packed along K,
``qzeros`` (G, N * bits / 32) int32 packed along N, ``scales`` (G, N) float16, ``g_idx`` (K,) the group
of each input. The weight is ``w[n, k] = scales[g, n] * (q[k, n] - z[g, n])``, ``g = g_idx[k]``, where
``checkpoint_format="gptq"`` (v1) stores ``z - 1`` (AutoGPTQ's ``pack``; its forward adds 1 back)
and ``gptq_v2`` stores ``z``. Act-order checkpoints (``g_idx`` not ``k // group_size``) are refused.
"""

from __future__ import annotations

import torch

from pagedllm.loader.quantization_config import WeightScheme
from pagedllm.quantization.packed_ints import unpack_int32

SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
OPTIONAL_SUFFIXES = ("g_idx",)
REQUIRED_SUFFIXES = ("qweight", "qzeros", "scales")


def values_zeros_scales(tensors: dict[str, torch.Tensor], scheme: WeightScheme
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (N, K) int32 unsigned, zero points (N, G) int32, scales (N, G) float32."""
    bits = scheme.bits
    q = unpack_int32(tensors["qweight"], bits, dim=0).t()  # (N, K)
    zeros = unpack_int32(tensors["qzeros"], bits, dim=1)  # (G, N)
    if scheme.format == "gptq":
        zeros = zeros + 1
    scales = tensors["scales"].float()
    return q.contiguous(), zeros.t().contiguous(), scales.t().contiguous()


def check_group_order(g_idx: torch.Tensor, group_size: int | None, name: str) -> None:
    """Raise ValueError unless input k belongs to group ``k // group_size`` (no act-order)."""
    k = g_idx.numel()
    expected = torch.arange(k, device=g_idx.device) // (group_size or k)
    if not torch.equal(g_idx.to(torch.int64).flatten(), expected):
        raise ValueError(f"{name}: this GPTQ checkpoint uses act-order (quantization_config.desc_act: its g_idx "
                         f"is not input // group_size), which pagedllm does not load; use a checkpoint "
                         f"quantized with desc_act=false")
