"""GGUF blocks for kernel tests: random valid blocks of every type gguf_dot.c handles, and the activation rule."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# byte offsets of each block's f16 scales (set to sane values; the rest of a block is random)
_F16_OFFSETS = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q4_K: [0, 2],
                Q.Q5_K: [0, 2], Q.Q6_K: [208]}


def random_blocks(kind, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """(n, row bytes) uint8: random codes, scales and mins; f16 scales in +-0.02."""
    per, size = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(n, k // per, size), dtype=np.uint8)
    for off in _F16_OFFSETS[kind]:
        halves = rng.uniform(-0.02, 0.02, size=(n, k // per)).astype(np.float16)
        raw[:, :, off:off + 2] = halves.view(np.uint8).reshape(n, k // per, 2)
    return raw.reshape(n, -1)


def quantized_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The documented activation rule in float32 numpy: q (M, K) int8, d and s (M, K / 32)."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32).astype(np.float32)
    d = (np.abs(xb).max(axis=-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int8)
    s = (d * q.astype(np.int32).sum(axis=-1).astype(np.float32)).astype(np.float32)
    return q.reshape(m, k), d, s




def rounded_activations(x):
    """x (..., K) torch tensor as the repacked GEMM sees it: each block of 32 rounded by :func:`quantized_reference`
    to ``q * d`` (computed in float32), returned in x's dtype."""
    import torch

    flat = x.detach().reshape(-1, x.shape[-1]).float().numpy()
    q, d, _ = quantized_reference(flat)
    m, k = flat.shape
    values = q.reshape(m, k // 32, 32).astype(np.float64) * d[..., None].astype(np.float64)
    return torch.from_numpy(values.reshape(x.shape)).to(x.dtype)
