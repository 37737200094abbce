"""Building blocks shared by every model family (one concept per module).

- :mod:`~pagedllm.models.layers.linear`: ``Linear`` (oneDNN-prepacked on CPU), ``MergedLinear``
  (q/k/v or gate/up in one matmul);
- :mod:`~pagedllm.models.layers.norm`: ``RMSNorm`` and Gemma's ``(1 + w)`` ``GemmaRMSNorm``;
- :mod:`~pagedllm.models.layers.rotary`: rotary embeddings with the scaling variants;
- :mod:`~pagedllm.models.layers.activation`, :mod:`~pagedllm.models.layers.mlp`: gated MLP
  (SwiGLU, GeGLU);
- :mod:`~pagedllm.models.layers.embedding`: scaled token embedding, soft-capped LM head;
- :mod:`~pagedllm.models.layers.moe`: mixture-of-experts block (router + experts run on
  their routed tokens) and its weight loading;
- :mod:`~pagedllm.models.layers.tensor_parallel`: column-/row-parallel linears and the
  vocabulary-parallel embedding and LM head (the plain layers with one rank);
- :mod:`~pagedllm.models.layers.attention`: the self-attention block (window, soft cap and
  scale passed to the attention backend).
"""

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
