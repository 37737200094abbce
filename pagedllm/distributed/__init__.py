"""Tensor parallelism on torch.distributed: the process group and the collectives the model layers call."""

from pagedllm.distributed.parallel_state import (get_tensor_parallel_rank, get_tensor_parallel_size,
                                                 init_tensor_parallel, destroy_tensor_parallel)

__all__ = ["destroy_tensor_parallel", "get_tensor_parallel_rank", "get_tensor_parallel_size",
           "init_tensor_parallel"]
