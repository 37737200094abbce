"""Building blocks shared by every model family, one concept per module (linear, norm, rotary,
activation and mlp, embedding, moe, tensor_parallel, attention)."""

from pagedllm.models.layers.attention import SelfAttention
from pagedllm.models.layers.embedding import LMHead, VocabEmbedding
from pagedllm.models.layers.linear import Linear, MergedLinear, pack_linears_for_cpu, unpack_linears
from pagedllm.models.layers.mlp import GatedMLP
from pagedllm.models.layers.norm import GemmaRMSNorm, RMSNorm
from pagedllm.models.layers.rotary import RotaryEmbedding, rope_inv_freq, rope_parameters
from pagedllm.models.layers.tensor_parallel import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                                                    RowParallelLinear, VocabParallelEmbedding)

__all__ = ["GatedMLP", "GemmaRMSNorm", "LMHead", "Linear", "MergedColumnParallelLinear", "MergedLinear",
           "ParallelLMHead", "QKVParallelLinear", "RMSNorm", "RotaryEmbedding", "RowParallelLinear",
           "SelfAttention", "VocabEmbedding", "VocabParallelEmbedding", "pack_linears_for_cpu", "rope_inv_freq",
           "rope_parameters", "unpack_linears"]
