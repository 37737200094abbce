"""Tensor parallelism on torch.distributed: the process group (:mod:`.parallel_state`: gloo on
CPU, nccl on CUDA) and the collectives the model layers call (:mod:`.communication`; no-ops with
one rank). Who starts the ranks is :mod:`pagedllm.executor`."""

from pagedllm.distributed.parallel_state import (get_tensor_parallel_rank, get_tensor_parallel_size,
                                                 init_tensor_parallel, destroy_tensor_parallel)

__all__ = ["destroy_tensor_parallel", "get_tensor_parallel_rank", "get_tensor_parallel_size",
           "init_tensor_parallel"]
