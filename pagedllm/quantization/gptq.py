"""GPTQ checkpoints (AutoGPTQ / GPTQModel) → pagedllm's int4 / int8 values, exactly.

Per projection (K inputs, N outputs, G groups): ``qweight`` (K * bits / 32, N) int32 packed along K,
``qzeros`` (G, N * bits / 32) int32 packed along N, ``scales`` (G, N) float16, ``g_idx`` (K,) the group
of each input. The weight is ``w[n, k] = scales[g, n] * (q[k, n] - z[g, n])``, ``g = g_idx[k]``, where
``checkpoint_format="gptq"`` (v1) stores ``z - 1`` (AutoGPTQ's ``pack``; its forward adds 1 back)
and ``gptq_v2`` stores ``z``. Act-order checkpoints (``desc_act``: ``g_idx`` any order of the groups)
are kept with their inputs permuted so that each group is contiguous (:func:`act_order_permutation`).
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
        raise ValueError(f"{name} is not input // group_size: the checkpoint uses act-order but its "
                         f"quantization_config says desc_act false (or actorder is not 'group')")


def act_order_permutation(g_idx: torch.Tensor, group_size: int | None, name: str) -> torch.Tensor:
    """perm (K,) int64 such that inputs ``perm[j]`` for j in each run of ``group_size`` share a group, in
    group order (x[:, perm] against the weight's columns permuted alike). Raises ValueError when the
    groups are not all ``group_size`` inputs."""
    g_idx = g_idx.to(torch.int64).flatten()
    k = g_idx.numel()
    size = group_size or k
    counts = torch.bincount(g_idx, minlength=k // size)
    if k % size or counts.numel() != k // size or not bool((counts == size).all()):
        raise ValueError(f"{name}: act-order groups must each hold group_size={size} of the {k} inputs")
    return torch.argsort(g_idx, stable=True)
