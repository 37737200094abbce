"""The Ray executor (``distributed_executor_backend="ray"``): ranks 1..N-1 as Ray actors in a placement
group (one bundle per rank, bundle 0 pinned to this node, strategy ``PACK``), so a tensor-parallel group
can span a Ray cluster as vLLM's does. The cluster is the user's (docs/parallelism.md, "Across machines with Ray").
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.errors import TensorParallelWorkerError
from pagedllm.executor.abstract import DistributedExecutor, failure_summary
from pagedllm.worker.worker import TensorParallelWorker

logger = logging.getLogger("pagedllm")

PLACEMENT_STRATEGY = "PACK"  # vLLM's: one node when it fits, else across nodes


def import_ray():
    """The ``ray`` module. Raises ValueError naming ``distributed_executor_backend`` without it."""
    try:
        import ray
    except ImportError as e:
        raise ValueError("distributed_executor_backend='ray' needs Ray, which is not installed: "
                         "pip install 'pagedllm[ray]'") from e
    return ray


class RayExecutor(DistributedExecutor):
    """Rank 0 in this process plus ``tensor_parallel_size - 1`` Ray actors; ``worker_timeout_s`` bounds
    placing the group, every wait on an actor and every collective. Actors load the model from
    ``config.model``, a path every node must have.

    Raises TensorParallelWorkerError when the cluster cannot place the ranks in time (naming the resources
    asked and available), an actor fails to start or dies; ValueError without Ray.
    """

    def __init__(self, config: EngineConfig, model_files) -> None:
        import torch

        from pagedllm.distributed.parallel_state import free_port, init_tensor_parallel
        from pagedllm.utils import resolve_device
        from pagedllm.worker.model_runner import ModelRunner

        ray = import_ray()
        from ray.util.placement_group import get_current_placement_group, placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self.world_size = config.tensor_parallel_size
        self.timeout_s = float(config.worker_timeout_s)
        self.actors: list[tuple[int, Any]] = []
        self._pending: list = []
        self.worker_pids: dict[int, int] = {}
        if not ray.is_initialized():
            ray.init()
        gpu = resolve_device(config.device).type == "cuda"
        backend = "nccl" if gpu else "gloo"
        resource = "GPU" if gpu else "CPU"
        ip = ray.util.get_node_ip_address()

        self._own_group = get_current_placement_group() is None
        if self._own_group:
            bundles = [{resource: 1.0} for _ in range(self.world_size)]
            bundles[0][f"node:{ip}"] = 0.001
            self.placement_group = placement_group(bundles, strategy=PLACEMENT_STRATEGY,
                                                   name=f"pagedllm-tp-{id(self):x}")
        else:
            self.placement_group = get_current_placement_group()
        self._finalizer = weakref.finalize(self, _stop_actors, ray, self.actors, self.placement_group,
                                           self._own_group)
        try:
            ray.get(self.placement_group.ready(), timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            self._finalizer()
            raise TensorParallelWorkerError(
                f"Ray could not place {self.world_size} ranks ({resource}: 1 each, rank 0 on this node {ip}, "
                f"strategy {PLACEMENT_STRATEGY}) within worker_timeout_s={self.timeout_s:g} s; the cluster has "
                f"{ray.available_resources()} available") from None

        def on_bundle(index: int):
            return PlacementGroupSchedulingStrategy(placement_group=self.placement_group,
                                                    placement_group_bundle_index=index)

        driver_gpu = None
        if gpu:  # the GPU Ray reserved for rank 0's bundle is the one this process uses
            driver_gpu = int(ray.get(ray.remote(_gpu_ids).options(num_gpus=1, num_cpus=0,
                                                                   scheduling_strategy=on_bundle(0)).remote())[0])
            torch.cuda.set_device(driver_gpu)
        init_method = f"tcp://{ip}:{free_port('')}"
        actor_cls = ray.remote(RayTensorParallelWorker)
        for rank in range(1, self.world_size):
            actor = actor_cls.options(num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0,
                                      scheduling_strategy=on_bundle(rank), name=None).remote(rank, self.world_size)
            self.actors.append((rank, actor))
        # Ray limits an actor to its GPU: it is device 0 there
        self._pending = [actor.start.remote(init_method, backend, config, self.timeout_s, 0 if gpu else None)
                         for _, actor in self.actors]
        try:
            init_tensor_parallel(0, self.world_size, init_method, backend, self.timeout_s)
            self.driver = ModelRunner(config, model_files)
        except BaseException as e:
            self._start_failed(e)
        self.worker_pids = dict(zip((r for r, _ in self.actors), self._collect()))
        logger.info("tensor parallel: %d ranks (%s, Ray placement group %s, rendezvous %s), worker pids %s",
                    self.world_size, backend, PLACEMENT_STRATEGY, init_method, self.worker_pids)

    def _send(self, method, args, kwargs, return_result) -> None:
        self._pending = [actor.call.remote(method, args, kwargs, return_result) for _, actor in self.actors]

    def _gather(self, timeout_s: float | None = None) -> list[tuple[int, bool, Any]]:
        ray, pending = self._ray, self._pending
        self._pending = []
        if not pending:
            return []
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
        ready = set(ready)
        out = []
        for (rank, _), ref in zip(self.actors, pending):
            where = f"tensor-parallel worker rank {rank} (Ray actor, pid {self.worker_pids.get(rank, '?')})"
            if ref not in ready:
                out.append((rank, False, f"{where} did not answer within {wait_s:g} s"))
                continue
            try:
                status, detail = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                out.append((rank, False, f"{where} died: {str(e).strip().splitlines()[0]}"))
                continue
            except ray.exceptions.RayError as e:
                out.append((rank, False, f"{where} failed: {type(e).__name__}: {e}"))
                continue
            out.append((rank, True, detail) if status == "ok" else (rank, False, failure_summary(where, detail)))
        return out

    def _stop_workers(self) -> None:
        self._finalizer()


class RayTensorParallelWorker(TensorParallelWorker):
    """The worker as a Ray actor: after a failed call it replies, then its process exits a second later."""

    def call(self, method, args: tuple = (), kwargs: dict | None = None, return_result: bool = False):
        reply = super().call(method, args, kwargs, return_result)
        if reply[0] != "ok":
            threading.Thread(target=_exit_after, args=(1.0,), daemon=True).start()
        return reply


def _exit_after(seconds: float) -> None:
    time.sleep(seconds)
    os._exit(1)


def _gpu_ids() -> list:
    """The GPU ids Ray gave this task (run on rank 0's bundle)."""
    import ray

    return ray.get_gpu_ids()


def _stop_actors(ray, actors: list, group, own_group: bool) -> None:
    """Kill the actors and release the placement group we made (the cluster is the user's)."""
    if not ray.is_initialized():
        return
    for _, actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 — already dead
            pass
    if own_group:
        try:
            ray.util.remove_placement_group(group)
        except Exception:  # noqa: BLE001
            pass
