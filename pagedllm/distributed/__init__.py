"""Tensor parallelism across processes on torch.distributed.

- :mod:`~pagedllm.distributed.parallel_state`: the tensor-parallel process group (gloo on
  CPU, nccl on CUDA), this process's rank and the group size;
- :mod:`~pagedllm.distributed.communication`: the collectives the model layers call
  (all-reduce, all-gather), no-ops with one rank;
- :mod:`~pagedllm.distributed.executor`: the multiprocessing executor: the engine process
  is rank 0, ranks 1..N-1 are worker processes it starts and stops; every step's
  ``SchedulerOutput`` goes to every rank.
"""

from pagedllm.distributed.parallel_state import (get_tensor_parallel_rank, get_tensor_parallel_size,
                                                 init_tensor_parallel, destroy_tensor_parallel)

__all__ = ["destroy_tensor_parallel", "get_tensor_parallel_rank", "get_tensor_parallel_size",
           "init_tensor_parallel"]
