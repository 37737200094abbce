"""The offload tiers' bytes: copies between the KV pool and host RAM / disk.

The core decides what to save, load and drop (:mod:`pagedllm.core.kv_offload`, as the step's
:class:`~pagedllm.core.outputs.KVTransferOps`); this module holds the data and does the copies
at the start of the step. A block travels as :data:`BlockData` (float8 as its bytes: CPU torch
has no float8 gather), an int8 cache's scales always with their codes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
import time
from pathlib import Path

import torch

from pagedllm.core.kv_offload import TIER_DISK, TIER_HOST, KVOffloadSpec
from pagedllm.core.outputs import KVTransferOps
from pagedllm.core.step_failure import StepFailure
from pagedllm.quantization.kv_cache import as_bytes

logger = logging.getLogger("pagedllm")

DISK_FORMAT = "pagedllm-kv-block-v2"  # v2: a payload digest in the metadata
_SUFFIX = ".safetensors"

# codes (num_kv_tensors, 2, block_size, num_kv_heads, head_dim), int8 scales (..., num_kv_heads) f32 or None
BlockData = tuple[torch.Tensor, "torch.Tensor | None"]


def payload_digest(tensors: dict[str, torch.Tensor]) -> str:
    """BLAKE2b-128 (hex) over each tensor's name, shape and bytes, in name order."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{list(t.shape)}:{t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class HostKVTier:
    """Block data in host memory, keyed by block hash (``pin``: page-locked, for a GPU pool)."""

    def __init__(self, pin: bool = False) -> None:
        self.pin = pin
        self.blocks: dict[bytes, BlockData] = {}

    def save(self, key: bytes, data: BlockData) -> None:
        self.blocks[key] = tuple(t.pin_memory() if self.pin and t is not None else t for t in data)

    def load(self, key: bytes) -> BlockData:
        """The block's data. Raises KeyError when the tier does not hold ``key``."""
        return self.blocks[key]

    def drop(self, key: bytes) -> None:
        self.blocks.pop(key, None)


class DiskKVTier:
    """One safetensors file per block hash, with its parent hash, token ids and ``identity`` in the
    metadata; written under a temporary name and renamed, so a crash never leaves half a block.
    Raises ValueError naming ``kv_offload_dir`` when the folder cannot be created or written."""

    def __init__(self, directory: str | os.PathLike, identity: dict[str, str]) -> None:
        self.dir = Path(directory)
        self.identity = {"format": DISK_FORMAT, **identity}
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.dir, prefix=".probe-"):
                pass
        except OSError as e:
            raise ValueError(f"kv_offload_dir {str(directory)!r} is not a writable directory: {e}") from e
        others = [p.name for p in self.dir.iterdir() if not p.is_file() or p.is_symlink()]
        if others:
            raise ValueError(f"kv_offload_dir {str(directory)!r} holds entries that are not regular files "
                             f"({', '.join(sorted(others)[:5])}); give the disk tier a folder of its own")

    def path(self, key: bytes) -> Path:
        return self.dir / (key.hex() + _SUFFIX)

    def scan(self) -> list[tuple[bytes, bytes | None, tuple[int, ...]]]:
        """Valid block files as ``(key, parent hash, token ids)``, oldest first; others are skipped
        with a warning, never deleted."""
        found = []
        for path in self.dir.glob("*" + _SUFFIX):
            entry = self._read_header(path)
            if entry is not None:
                found.append((path.stat().st_mtime, entry))
        found.sort(key=lambda t: t[0])
        if found:
            logger.info("KV offload disk tier: %d blocks found in %s", len(found), self.dir)
        return [entry for _, entry in found]

    def _read_header(self, path: Path) -> tuple[bytes, bytes | None, tuple[int, ...]] | None:
        from safetensors import safe_open

        try:
            key = bytes.fromhex(path.name[:-len(_SUFFIX)])
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                shape = list(f.get_slice("kv").get_shape())
            parent = bytes.fromhex(meta["parent_hash"]) if meta.get("parent_hash") else None
            token_ids = tuple(int(t) for t in json.loads(meta["token_ids"]))
        except Exception as e:  # noqa: BLE001 — any unreadable file is skipped, not fatal
            logger.warning("KV offload disk tier: ignoring unreadable file %s (%s: %s)", path, type(e).__name__, e)
            return None
        mismatched = {k: (meta.get(k), v) for k, v in self.identity.items() if meta.get(k) != v}
        if json.dumps(shape) != self.identity.get("shape"):
            mismatched["shape (in file)"] = (json.dumps(shape), self.identity.get("shape"))
        if mismatched:
            logger.warning("KV offload disk tier: ignoring %s, written by another engine setup (file vs now: %s)",
                           path, mismatched)
            return None
        return key, parent, token_ids

    def save(self, key: bytes, parent_hash: bytes | None, token_ids: tuple[int, ...], data: BlockData) -> None:
        from safetensors.torch import save_file

        kv, scales = data
        tensors = {"kv": kv.contiguous()} | ({"kv_scales": scales.contiguous()} if scales is not None else {})
        meta = {**self.identity, "parent_hash": parent_hash.hex() if parent_hash else "",
                "token_ids": json.dumps(list(token_ids)), "block_hash": key.hex(),
                "digest": payload_digest(tensors)}
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-", suffix=_SUFFIX)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=meta)
            os.replace(tmp, self.path(key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def load(self, key: bytes) -> BlockData:
        """The block's data. Raises OSError / safetensors errors for a missing or damaged file,
        ValueError when its payload does not match the digest stored with it or its header
        names another block or engine setup."""
        from safetensors import safe_open

        path = self.path(key)
        if not stat.S_ISREG(path.lstat().st_mode):
            raise ValueError(f"{path.name} is not a regular file")
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        if any(meta.get(k) != v for k, v in self.identity.items()) or meta.get("block_hash") != key.hex():
            raise ValueError("the file was written for another block or engine setup")
        if meta.get("digest") != payload_digest(tensors):
            raise ValueError("the block's payload does not match its digest")
        return tensors["kv"], tensors.get("kv_scales")

    def drop(self, key: bytes) -> None:
        self.path(key).unlink(missing_ok=True)


class KVOffloader:
    """Performs a step's :class:`KVTransferOps` on the runner's KV tensors (``kv_caches``, each
    ``(2, num_blocks, block_size, num_kv_heads, head_dim)``; an int8 pool's ``kv_scales`` each
    ``(2, num_blocks, block_size, num_kv_heads)`` float32). The swap space is ``torch.empty`` host
    memory (pinned for a GPU pool), so its pages are committed only when first written."""

    def __init__(self, kv_caches: list[torch.Tensor], host: HostKVTier | None, disk: DiskKVTier | None,
                 num_swap_blocks: int = 0, kv_scales: list[torch.Tensor | None] | None = None) -> None:
        self.kv_caches = [as_bytes(c) for c in kv_caches]  # float8 moved as bytes
        self.kv_scales = list(kv_scales) if kv_scales is not None and kv_scales[0] is not None else None
        self.tiers = {name: t for name, t in ((TIER_HOST, host), (TIER_DISK, disk)) if t is not None}
        self.failed_saves: list[tuple[str, bytes]] = []
        c = self.kv_caches[0]
        # (slots, num_kv_tensors, 2, block_size, num_kv_heads, head_dim): one slot = one block
        self.swap = torch.empty((num_swap_blocks, len(kv_caches), 2, *c.shape[2:]), dtype=c.dtype,
                                pin_memory=c.is_cuda)
        self.swap_scales = None  # (slots, num_kv_tensors, 2, block_size, num_kv_heads) float32
        if self.kv_scales is not None:
            self.swap_scales = torch.empty((num_swap_blocks, len(kv_caches), 2, *c.shape[2:4]), dtype=torch.float32,
                                           pin_memory=c.is_cuda)

    def apply(self, ops: KVTransferOps) -> None:
        """Swap-outs, saves, loads, swap-ins, drops: every read of the pool before any write."""
        if ops.swap_out:
            slots = torch.tensor([s for _, s in ops.swap_out], dtype=torch.int64)
            kv, scales = self.gather([b for b, _ in ops.swap_out])
            self.swap[slots] = kv
            if scales is not None:
                self.swap_scales[slots] = scales
        if ops.saves:
            kv, scales = self.gather([s.block_id for s in ops.saves])
            for i, s in enumerate(ops.saves):
                self._save(s, (kv[i], None if scales is None else scales[i]))
        failed_loads = []
        if ops.loads:
            blocks = {(t, k, b): self._load(t, k) for t, k, b in ops.loads}
            failed_loads = [load for load, data in blocks.items() if data is None]
            loaded = [(load[2], data) for load, data in blocks.items() if data is not None]
            if loaded:
                self.scatter([b for b, _ in loaded], torch.stack([kv for _, (kv, _) in loaded]),
                             None if self.kv_scales is None else torch.stack([s for _, (_, s) in loaded]))
        if ops.swap_in:
            slots = torch.tensor([s for s, _ in ops.swap_in], dtype=torch.int64)
            self.scatter([b for _, b in ops.swap_in], self.swap[slots],
                         None if self.swap_scales is None else self.swap_scales[slots])
        for tier, key in ops.drops:
            self._io(tier, key, "drop", self.tiers[tier].drop, key)
        if failed_loads:
            raise StepFailure(failed_loads=failed_loads)

    def take_failed_saves(self) -> list[tuple[str, bytes]]:
        """``(tier, key)`` of the blocks whose save failed since the last call (not stored)."""
        failed, self.failed_saves = self.failed_saves, []
        return failed

    def _save(self, s, block: BlockData) -> None:
        if s.tier == TIER_DISK:
            ok = self._io(s.tier, s.key, "save", self.tiers[TIER_DISK].save, s.key, s.parent_hash, s.token_ids, block)
        else:
            ok = self._io(s.tier, s.key, "save", self.tiers[s.tier].save, s.key,
                          tuple(t if t is None else t.clone() for t in block))
        if not ok:
            self.failed_saves.append((s.tier, s.key))

    def _load(self, tier: str, key: bytes) -> BlockData | None:
        data = self._io(tier, key, "load", self.tiers[tier].load, key)
        return None if data is False else data

    @staticmethod
    def _io(tier: str, key: bytes, what: str, fn, *args):
        """``fn(*args)``; a tier is a cache, so any error is a logged miss: returns False then
        (True for a call that returns None)."""
        try:
            result = fn(*args)
        except Exception as e:  # noqa: BLE001 — files can be missing, damaged, foreign, or unwritable
            logger.warning("KV offload %s tier: %s of block %s failed (%s: %s); treated as a miss", tier, what,
                           key.hex()[:16], type(e).__name__, e)
            return False
        return True if result is None else result

    def gather(self, block_ids: list[int]) -> BlockData:
        """Blocks ``block_ids`` on the host, as :data:`BlockData` with a leading block dimension."""
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.kv_caches[0].device)
        # (num_kv_tensors, 2, n, bs, kvh, hd) -> (n, num_kv_tensors, 2, bs, kvh, hd)
        data = torch.stack([c.index_select(1, ids) for c in self.kv_caches]).permute(2, 0, 1, 3, 4, 5)
        scales = None
        if self.kv_scales is not None:
            scales = torch.stack([s.index_select(1, ids) for s in self.kv_scales]).permute(2, 0, 1, 3, 4)
            scales = scales.to("cpu").contiguous()
        return data.to("cpu").contiguous(), scales

    def scatter(self, block_ids: list[int], kv: torch.Tensor, scales: torch.Tensor | None = None) -> None:
        """Write blocks (codes and scales as :meth:`gather` returns them, stacked) into pool blocks
        ``block_ids``. Raises ValueError when an int8 pool gets no scales."""
        if (scales is None) != (self.kv_scales is None):
            raise ValueError("an int8 KV pool's blocks move with their kv_scales (and only its blocks have them)")
        dev = self.kv_caches[0].device
        ids = torch.tensor(block_ids, dtype=torch.int64, device=dev)
        kv = kv.to(dev)  # (n, num_kv_tensors, 2, bs, kvh, hd)
        for j, cache in enumerate(self.kv_caches):
            cache[:, ids] = kv[:, j].transpose(0, 1).to(cache.dtype)  # (2, n, bs, kvh, hd)
        if scales is not None:
            scales = scales.to(dev)  # (n, num_kv_tensors, 2, bs, kvh)
            for j, s in enumerate(self.kv_scales):
                s[:, ids] = scales[:, j].transpose(0, 1)


    def measure_copy_bandwidth(self) -> float:
        """Bytes per second of a pool → swap → pool round trip (0.0 without swap); pool unchanged."""
        n = min(32, len(self.swap), self.kv_caches[0].shape[1])
        if n == 0:
            return 0.0
        ids = list(range(n))
        self.scatter(ids, *self.gather(ids))  # warm-up (and a no-op on the data)
        t0 = time.perf_counter()
        kv, scales = self.gather(ids)
        self.swap[:n] = kv
        if scales is not None:
            self.swap_scales[:n] = scales
        self.scatter(ids, self.swap[:n], None if scales is None else self.swap_scales[:n])
        if self.kv_caches[0].is_cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        num_bytes = kv.numel() * kv.element_size() + (0 if scales is None else scales.numel() * 4)
        return 2 * num_bytes / max(seconds, 1e-9)


def build_kv_offload(config, kv_caches: list[torch.Tensor], bytes_per_block: int, num_groups: int,
                     identity: dict[str, str], kv_scales: list[torch.Tensor | None] | None = None
                     ) -> tuple[KVOffloadSpec, KVOffloader | None]:
    """The tiers and swap space ``config`` asks for, in blocks of ``bytes_per_block``; tiers need
    prefix caching and one KV-cache group. Raises ValueError for an unwritable ``kv_offload_dir``."""
    num_swap = config.swap_space_bytes // bytes_per_block if config.preemption_mode != "recompute" else 0
    wanted = config.kv_offload_memory is not None or config.kv_offload_dir is not None
    if wanted and (not config.enable_prefix_caching or num_groups != 1):
        logger.warning("KV offload tiers are off: they need prefix caching on and a model without "
                       "sliding-window layers (one KV-cache group)")
        wanted = False
    if not wanted:
        return KVOffloadSpec(), KVOffloader(kv_caches, None, None, num_swap, kv_scales) if num_swap else None
    num_host = config.kv_offload_memory_bytes // bytes_per_block if config.kv_offload_memory is not None else 0
    host = HostKVTier(pin=kv_caches[0].is_cuda) if num_host else None
    disk, num_disk, entries = None, 0, ()
    if config.kv_offload_dir is not None:
        disk = DiskKVTier(config.kv_offload_dir, identity)
        num_disk = config.kv_offload_disk_space_bytes // bytes_per_block
        entries = tuple(disk.scan()) if num_disk else ()
        if not num_disk:
            disk = None
    spec = KVOffloadSpec(num_host, num_disk, entries)
    logger.info("KV offload: host tier %d blocks, disk tier %d blocks%s", num_host, num_disk,
                f" in {config.kv_offload_dir}" if disk is not None else "")
    return spec, KVOffloader(kv_caches, host, disk, num_swap, kv_scales) if spec.is_enabled or num_swap else None
