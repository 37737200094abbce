"""What the live KV-cache map costs the engine: snapshot time vs step time at 1 refresh/s.

The map's data (``GET /kv/state``) is ``LLMEngine.kv_cache_snapshot()``, run on the engine
thread between two steps (``AsyncLLMEngine.call``), then turned into JSON on the event
loop. Measured here, with SmolLM2-135M and the engine's default 1 GiB KV pool:

1. the snapshot's own time on the engine thread, and the JSON encoding time, over the
   polls of a run (median), against the median step time of the same run: the cost at
   one refresh per second is snapshot time ÷ 1 s of engine time;
2. the end-to-end effect: the same burst of requests through ``AsyncLLMEngine`` with a
   poller fetching the snapshot (and encoding it) every ``--interval`` seconds, and
   without, alternated ``--repeats`` times (quote the ratio, not the absolute rates);
3. how the snapshot scales with the pool: ``block_states()`` of block pools of
   1k–128k blocks, half of them in use (no model).

    python benchmarks/kv_map_overhead.py
    python benchmarks/kv_map_overhead.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import numpy as np

import common

sys.path.insert(0, str(common.REPO_ROOT))


def run_burst(engine, prompts: list[list[int]], max_tokens: int, interval_s: float | None) -> dict:
    """All prompts at once through an AsyncLLMEngine; poll the snapshot every ``interval_s`` (None: never)."""
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    snap_s, encode_s = [], []

    def timed_snapshot(e):
        t0 = time.perf_counter()
        snap = e.kv_cache_snapshot()
        snap_s.append(time.perf_counter() - t0)
        return snap

    async def main() -> float:
        aengine = AsyncLLMEngine(engine, log_requests=False, stats_log_interval_s=0)
        aengine.start()
        steps0 = engine.num_steps
        t0 = time.perf_counter()

        async def one(i: int, p: list[int]) -> None:
            async for _ in aengine.generate(p, params, f"r{i}-{time.monotonic_ns()}"):
                pass

        async def poll() -> None:
            while True:
                await asyncio.sleep(interval_s)
                snap = await aengine.call(timed_snapshot)
                t1 = time.perf_counter()
                json.dumps(snap.to_dict())
                encode_s.append(time.perf_counter() - t1)

        poller = asyncio.ensure_future(poll()) if interval_s else None
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        elapsed = time.perf_counter() - t0
        if poller is not None:
            poller.cancel()
        await aengine.shutdown()
        return elapsed, engine.num_steps - steps0

    elapsed, num_steps = asyncio.run(main())
    return {"elapsed_s": elapsed, "num_steps": num_steps, "output_tok_s": len(prompts) * max_tokens / elapsed,
            "step_ms_mean": 1000 * elapsed / num_steps, "snapshot_ms": [1000 * s for s in snap_s],
            "encode_ms": [1000 * s for s in encode_s]}


def pool_scaling(sizes: list[int]) -> list[dict]:
    """``block_states()`` time for pools of ``sizes`` blocks, half in use, a quarter cached."""
    from pagedllm.core.block_pool import BlockPool

    out = []
    for n in sizes:
        pool = BlockPool(n, 16, True)
        blocks = pool.get_new_blocks(n * 3 // 4)
        for i, b in enumerate(blocks[n // 2:]):  # a quarter: published, then freed -> cached
            pool.cache_full_block(b, i.to_bytes(32, "little"), None, list(range(16)))
        pool.free_blocks(blocks[n // 2:])
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            pool.block_states()
            times.append(time.perf_counter() - t0)
        out.append({"num_blocks": n, "block_states_ms": round(1000 * statistics.median(times), 3)})
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between polls (the page's default: 1)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="8 requests x 16 tokens, 1 repeat, polling every 0.2 s")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.max_tokens, args.repeats, args.interval = 8, 16, 1, 0.2

    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine

    rng = np.random.default_rng(0)
    prompts = common.random_prompts(rng, rng.integers(20, 200, size=args.num_requests))
    engine = LLMEngine(EngineConfig(device="cpu", max_model_len=2048))
    run_burst(engine, prompts[:2], 4, None)  # warm-up
    runs = {"without_map": [], "with_map": []}
    for _ in range(args.repeats):  # alternate, so load changes hit both alike
        runs["without_map"].append(run_burst(engine, prompts, args.max_tokens, None))
        runs["with_map"].append(run_burst(engine, prompts, args.max_tokens, args.interval))
    snaps = [s for r in runs["with_map"] for s in r["snapshot_ms"]]
    encodes = [s for r in runs["with_map"] for s in r["encode_ms"]]
    step_ms = statistics.median(r["step_ms_mean"] for r in runs["with_map"])
    snap_ms = statistics.median(snaps) if snaps else float("nan")
    tput = {k: statistics.median(r["output_tok_s"] for r in v) for k, v in runs.items()}
    record = {
        "config": {"model": engine.config.model, "num_blocks": engine.kv_cache_spec.num_blocks,
                   "num_requests": args.num_requests, "max_tokens": args.max_tokens,
                   "interval_s": args.interval, "repeats": args.repeats},
        "snapshot_ms_median": round(snap_ms, 3), "snapshot_ms_max": round(max(snaps, default=0), 3),
        "json_encode_ms_median": round(statistics.median(encodes), 3) if encodes else None,
        "num_polls": len(snaps), "step_ms_mean": round(step_ms, 2),
        "engine_time_fraction_at_1_per_s": round(snap_ms / 1000, 6),
        "snapshot_vs_one_step": round(snap_ms / step_ms, 5),
        "output_tok_s": {k: round(v, 1) for k, v in tput.items()},
        "with_over_without": round(tput["with_map"] / tput["without_map"], 4),
        "pool_scaling": pool_scaling([1024, 16384, 131072]),
        "runs": {k: [{kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in r.items()
                      if kk not in ("snapshot_ms", "encode_ms")} for r in v] for k, v in runs.items()},
    }
    path = common.write_result("kv_map_overhead", record, args.out)
    print(f"kv map: snapshot {snap_ms:.2f} ms median over {len(snaps)} polls of {record['config']['num_blocks']} "
          f"blocks, json {record['json_encode_ms_median']} ms; step {step_ms:.1f} ms; at 1 refresh/s the engine "
          f"spends {100 * snap_ms / 1000:.3f}% of its time on it; throughput with/without polling every "
          f"{args.interval} s: {record['with_over_without']:.3f}x  -> {path}")
    return record


if __name__ == "__main__":
    main()
