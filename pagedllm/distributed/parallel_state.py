"""This process's tensor-parallel group (the engine process is rank 0); unsharded, rank 0 of size 1."""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class _TensorParallelState:
    rank: int
    world_size: int
    backend: str


_STATE: _TensorParallelState | None = None


def get_tensor_parallel_rank() -> int:
    """This process's rank in the tensor-parallel group (0 when not sharded)."""
    return _STATE.rank if _STATE is not None else 0


def get_tensor_parallel_size() -> int:
    """Number of ranks the model is sharded across (1 when not sharded)."""
    return _STATE.world_size if _STATE is not None else 1


def get_tensor_parallel_backend() -> str:
    """The group's torch.distributed backend (``gloo`` or ``nccl``; ``gloo`` when not sharded)."""
    return _STATE.backend if _STATE is not None else "gloo"


def heads_per_rank(num_heads: int, num_kv_heads: int, tensor_parallel_size: int | None = None) -> tuple[int, int]:
    """(attention heads, KV heads) per rank, KV heads replicated when fewer than the ranks. Raises ValueError
    naming ``tensor_parallel_size`` when it does not divide the heads, nor divides or is a multiple of the KV heads."""
    tp = get_tensor_parallel_size() if tensor_parallel_size is None else tensor_parallel_size
    if num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's {num_heads} attention heads")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's {num_kv_heads} KV heads "
                         f"or be a multiple of them (then they are replicated)")
    return num_heads // tp, max(1, num_kv_heads // tp)


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on ``host``'s interface (``""``: every interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_tensor_parallel(rank: int, world_size: int, init_method: str, backend: str,
                         timeout_s: float = 300.0) -> None:
    """Join the group at ``init_method`` (``tcp://host:port``) over ``gloo`` or ``nccl``; a collective waiting
    longer than ``timeout_s`` raises. Raises ValueError for a rank outside the group, RuntimeError when
    this process is already in one."""
    global _STATE
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if _STATE is not None:
        raise RuntimeError("this process already belongs to a tensor-parallel group")
    if world_size > 1:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    _STATE = _TensorParallelState(rank, world_size, backend)


def destroy_tensor_parallel() -> None:
    """Leave the group (idempotent); afterwards rank 0 of size 1 again."""
    global _STATE
    state, _STATE = _STATE, None
    if state is not None and state.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
