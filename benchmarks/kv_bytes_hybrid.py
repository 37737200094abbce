"""KV bytes per sequence for Gemma 3 shapes: every block kept vs the hybrid KV cache.

Drives the real :class:`~pagedllm.core.kv_cache_manager.KVCacheManager` (no model, no
torch) with one sequence per context length: the first half is the prompt, prefilled in
chunks of the token budget (2048), the second half decoded one token per step. It records
the blocks the sequence holds at the end and at the peak, times the bytes of one block
(bfloat16, block size 16): once with one block table for all layers (vLLM's
``--disable-hybrid-kv-cache-manager``) and once with the hybrid KV-cache groups (the 5 of
6 sliding-window layers keep only their window).

Shapes (Hugging Face ``config.json`` of google/gemma-3-{270m,1b-it,4b-it,12b-it,27b-it},
text part): layers, KV heads, head_dim, sliding window; every 6th layer (5, 11, ...) is full
attention (``sliding_window_pattern`` 6).

    python benchmarks/kv_bytes_hybrid.py            # -> benchmarks/results/kv_bytes_hybrid.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

from pagedllm.config import EngineConfig  # noqa: E402
from pagedllm.core.kv_cache_groups import layers_per_block, make_kv_cache_groups  # noqa: E402
from pagedllm.core.kv_cache_manager import KVCacheManager, cdiv  # noqa: E402
from pagedllm.core.request import Request  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402

# name: (layers, KV heads, head_dim, sliding window)
GEMMA3_SHAPES = {
    "gemma-3-270m": (18, 1, 256, 512),
    "gemma-3-1b": (26, 1, 256, 512),
    "gemma-3-4b": (34, 4, 256, 1024),
    "gemma-3-12b": (48, 8, 256, 1024),
    "gemma-3-27b": (62, 16, 128, 1024),
}
CONTEXTS = (4096, 8192, 32768)
BLOCK_SIZE = 16
DTYPE_BYTES = 2  # bfloat16
TOKEN_BUDGET = 2048


def run_sequence(windows: list[int | None], kv_heads: int, head_dim: int, hybrid: bool, num_tokens: int) -> dict:
    """Blocks (at the end, at the peak) and bytes one ``num_tokens`` sequence holds."""
    groups = make_kv_cache_groups(windows, hybrid=hybrid)
    # one block: K and V of layers_per_block layers x block_size tokens (as ModelRunner.bytes_per_block)
    block_bytes = 2 * layers_per_block(groups) * BLOCK_SIZE * kv_heads * head_dim * DTYPE_BYTES
    kv = KVCacheManager(len(windows) * cdiv(num_tokens, BLOCK_SIZE) + 1, BLOCK_SIZE, True, num_tokens, groups)
    prompt_len = num_tokens // 2
    req = Request("seq", list(range(prompt_len)), SamplingParams(max_tokens=num_tokens - prompt_len))
    peak = 0
    while req.num_computed_tokens < num_tokens - 1:  # the last token's K/V is never computed
        todo = min(req.num_tokens - req.num_computed_tokens, TOKEN_BUDGET)
        assert kv.allocate_slots(req, todo) is not None
        req.num_computed_tokens += todo
        kv.cache_blocks(req)
        peak = max(peak, kv.num_used_blocks)
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token_ids([req.num_tokens])
    kv.check_integrity()
    return {"num_kv_cache_groups": len(groups), "layers_per_block": layers_per_block(groups),
            "block_bytes": block_bytes, "blocks_end": kv.num_used_blocks, "blocks_peak": peak,
            "bytes_end": kv.num_used_blocks * block_bytes, "bytes_peak": peak * block_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/kv_bytes_hybrid.json)")
    args = parser.parse_args()
    assert EngineConfig().block_size == BLOCK_SIZE  # the engine's default
    rows = []
    t0 = time.perf_counter()
    for name, (num_layers, kv_heads, head_dim, window) in GEMMA3_SHAPES.items():
        windows = [None if i % 6 == 5 else window for i in range(num_layers)]
        for num_tokens in CONTEXTS:
            row = {"model": name, "context_tokens": num_tokens, "num_layers": num_layers,
                   "num_full_layers": windows.count(None), "sliding_window": window}
            for label, hybrid in (("full", False), ("hybrid", True)):
                row[label] = run_sequence(windows, kv_heads, head_dim, hybrid, num_tokens)
            row["hybrid_over_full_peak"] = round(row["hybrid"]["bytes_peak"] / row["full"]["bytes_peak"], 4)
            rows.append(row)
            print(f"{name:14s} {num_tokens:6d} tokens: full {row['full']['bytes_peak'] / 2**20:9.1f} MiB, "
                  f"hybrid {row['hybrid']['bytes_peak'] / 2**20:8.1f} MiB peak "
                  f"({row['hybrid']['bytes_end'] / 2**20:.1f} at the end), x{row['hybrid_over_full_peak']:.3f}")
    record = {"benchmark": "kv_bytes_hybrid", "block_size": BLOCK_SIZE, "dtype": "bfloat16",
              "token_budget": TOKEN_BUDGET, "rows": rows, "seconds": round(time.perf_counter() - t0, 2),
              "machine": common.machine_info()}
    path = common.write_result("kv_bytes_hybrid", record, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
