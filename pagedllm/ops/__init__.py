"""Fused CPU kernels for the elementwise work of a decoder layer (``native/cpu_ops.c``). Every function
returns None/False when it does not apply: the layers then run their torch code.
"""

from pagedllm.ops.activation import act_and_mul
from pagedllm.ops.library import cpu_ops, set_enabled
from pagedllm.ops.norm import fused_add_rms_norm_, rms_norm
from pagedllm.ops.rotary import rope_qk

__all__ = ["act_and_mul", "cpu_ops", "fused_add_rms_norm_", "rms_norm", "rope_qk", "set_enabled"]
