"""Fused CPU kernels for the elementwise work of a decoder layer (``cpu_ops.c``).

Each replaces a chain of small torch ops by one pass over the data, on torch's own OpenMP
threads, with the rounding points of the torch code it replaces (float32 agrees to a few ulp,
bfloat16 is equal but for values at a bfloat16 rounding boundary; the unit tests state the bounds):

- :mod:`~pagedllm.ops.norm`: RMSNorm, optionally after the residual add, in place, both weight
  conventions (Llama's ``w * cast(norm(x))``, Gemma's ``cast(norm(x) * (1 + w))``);
- :mod:`~pagedllm.ops.activation`: SiLU- and GELU(tanh)-and-multiply over the fused gate/up output;
- :mod:`~pagedllm.ops.rotary`: neox rotary embedding of the q and k heads, optionally after the
  per-head q/k RMSNorm (Qwen 3, Gemma 3);
- :mod:`~pagedllm.ops.library`: loading (through :mod:`pagedllm.native`) and the switch.

Every function returns None/False when it does not apply (CUDA tensors, float16, odd layouts,
``PAGEDLLM_CPU_FUSED_OPS=0`` or :func:`set_enabled`, a torch.compile trace, no C compiler) and
the layers in :mod:`pagedllm.models.layers` then run their torch code, so every model family
keeps working.
"""

from pagedllm.ops.activation import act_and_mul
from pagedllm.ops.library import cpu_ops, set_enabled
from pagedllm.ops.norm import fused_add_rms_norm_, rms_norm
from pagedllm.ops.rotary import rope_qk

__all__ = ["act_and_mul", "cpu_ops", "fused_add_rms_norm_", "rms_norm", "rope_qk", "set_enabled"]
