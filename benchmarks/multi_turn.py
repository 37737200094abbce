"""Returning chat sessions: the prefix cache's host-RAM and disk tiers vs the pool alone.

``--sessions`` simulated chat sessions × ``--turns`` turns. Turn 1 of a session is a
system prompt + a user message; turn k+1 is turn k's prompt + its answer + a new user
message (seeded ordinary token ids; answers are the engine's own greedy output, EOS
ignored). Turns are interleaved: turn k of every session runs (``--wave`` sessions at a
time) before turn k+1 of any, and the KV pool holds only about ``--pool-sessions``
sessions at their longest, so by the time a session returns its blocks were evicted.

Three engines, identical but for the tiers, run each turn's waves alternately:

* ``pool``: the block pool only;
* ``host``: + a host-RAM tier (``kv_offload_memory``) large enough for every session;
* ``disk``: + a host tier and a disk tier (``kv_offload_dir``), and the engine is
  **restarted** (a new process state: pool and host tier empty) before turn 3, so turns
  3.. hit only what the disk tier kept.

Reported per engine for turns 2..: TTFT p50/p90 (queueing within a wave included),
prompt tokens computed (prefill work the cache did not save) and cached tokens by tier
(from ``RequestOutput.metrics``). Greedy outputs must agree token for token.

    python benchmarks/multi_turn.py
    python benchmarks/multi_turn.py --quick
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import common
from prefix_cache import percentiles

sys.path.insert(0, str(common.REPO_ROOT))

SYSTEMS = ("pool", "host", "disk")


class Sessions:
    """The seeded conversation state: per session its token ids so far."""

    def __init__(self, seed: int, num: int, system_len: int, user_len: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.user_len = user_len
        self.history = [common.random_prompts(self.rng, np.array([system_len]))[0] for _ in range(num)]

    def next_prompts(self) -> list[list[int]]:
        """Each session's history + a new user message (the next turn's prompts)."""
        users = common.random_prompts(self.rng, np.full(len(self.history), self.user_len))
        return [h + u for h, u in zip(self.history, users)]


def make_engine(args, system: str, offload_dir: str):
    from pagedllm import LLM
    kw = {}
    if system in ("host", "disk"):
        kw["kv_offload_memory"] = args.host_tier
    if system == "disk":
        kw.update(kv_offload_dir=offload_dir, kv_offload_disk_space=args.disk_tier)
    return LLM(model="smollm2-135m-instruct", dtype="float32", seed=0, max_model_len=args.max_model_len,
               num_kv_blocks=args.pool_blocks, max_num_seqs=args.wave, **kw)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--wave", type=int, default=8, help="sessions served at once (max_num_seqs)")
    p.add_argument("--system-len", type=int, default=192, help="system prompt tokens")
    p.add_argument("--user-len", type=int, default=48, help="tokens per user message")
    p.add_argument("--max-tokens", type=int, default=16, help="answer tokens per turn")
    p.add_argument("--pool-sessions", type=int, default=8, help="sessions the KV pool holds at their longest")
    p.add_argument("--host-tier", default="2GiB")
    p.add_argument("--disk-tier", default="4GiB")
    p.add_argument("--dir", default=None, help="disk tier folder (default: a fresh temporary one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="8 sessions × 3 turns, short prompts")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.sessions, args.turns, args.wave, args.system_len, args.user_len, args.max_tokens = 8, 3, 2, 48, 16, 4
        args.pool_sessions, args.host_tier, args.disk_tier = 2, "256MiB", "256MiB"
    longest = args.system_len + args.turns * (args.user_len + args.max_tokens)
    args.max_model_len = -(-longest // 16) * 16 + 16
    args.pool_blocks = args.pool_sessions * -(-longest // 16) + 1
    offload_dir = args.dir or tempfile.mkdtemp(prefix="pagedllm-multi-turn-")
    engines = {s: make_engine(args, s, offload_dir) for s in SYSTEMS}
    for llm in engines.values():  # warm-up on an unrelated prompt
        common.generate_greedy(llm, common.random_prompts(np.random.default_rng(10_000), np.array([64])), 2)
    sessions = {s: Sessions(args.seed, args.sessions, args.system_len, args.user_len) for s in SYSTEMS}
    per_turn: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    outputs: dict[str, list[list[int]]] = {s: [] for s in SYSTEMS}
    for turn in range(1, args.turns + 1):
        if turn == 3:  # restart the disk engine: pool and host tier gone, the folder stays
            del engines["disk"]
            gc.collect()
            engines["disk"] = make_engine(args, "disk", offload_dir)
        prompts = {s: sessions[s].next_prompts() for s in SYSTEMS}
        stats = {s: {"ttft_s": [], "computed": 0, "cached": dict.fromkeys(("pool", "host", "disk"), 0)}
                 for s in SYSTEMS}
        for w in range(0, args.sessions, args.wave):
            order = SYSTEMS if (w // args.wave) % 2 == 0 else SYSTEMS[::-1]  # alternate who goes first
            for s in order:
                llm = engines[s]
                before = llm.llm_engine.get_stats().prompt_tokens_total
                outs = common.generate_greedy(llm, prompts[s][w:w + args.wave], args.max_tokens)
                st = stats[s]
                st["computed"] += llm.llm_engine.get_stats().prompt_tokens_total - before
                for i, o in enumerate(outs):
                    st["ttft_s"].append(o.metrics.time_to_first_token)
                    for tier, n in (o.metrics.cached_tokens_by_tier or {}).items():
                        st["cached"][tier] += n
                    sessions[s].history[w + i] = prompts[s][w + i] + list(o.outputs[0].token_ids)
                    outputs[s].append(list(o.outputs[0].token_ids))
        for s in SYSTEMS:
            st = stats[s]
            per_turn[s].append({"turn": turn, "ttft_s": percentiles(st["ttft_s"]),
                                "prompt_tokens": sum(len(x) for x in prompts[s]),
                                "prompt_tokens_computed": st["computed"], "cached_tokens_by_tier": st["cached"],
                                "ttft_all_s": [round(x, 4) for x in st["ttft_s"]]})
    if args.dir is None:
        shutil.rmtree(offload_dir, ignore_errors=True)
    systems = {}
    for s in SYSTEMS:
        later = [t for t in per_turn[s] if t["turn"] >= 2]
        ttfts = [x for t in later for x in t.pop("ttft_all_s")]
        per_turn[s][0].pop("ttft_all_s", None)
        systems[s] = {"ttft_turns_2plus_s": percentiles(ttfts),
                      "prompt_tokens_computed_turns_2plus": sum(t["prompt_tokens_computed"] for t in later),
                      "prompt_tokens_turns_2plus": sum(t["prompt_tokens"] for t in later),
                      "per_turn": per_turn[s]}
    agree = all(outputs[s] == outputs["pool"] for s in SYSTEMS)
    pool = systems["pool"]
    record = {"sessions": args.sessions, "turns": args.turns, "wave": args.wave, "system_len": args.system_len,
              "user_len": args.user_len, "max_tokens": args.max_tokens, "pool_blocks": args.pool_blocks,
              "pool_sessions": args.pool_sessions, "host_tier": args.host_tier, "disk_tier": args.disk_tier,
              "systems": systems, "greedy_agreement": agree,
              "ttft_p50_speedup_vs_pool": {s: round(pool["ttft_turns_2plus_s"]["p50"]
                                                    / systems[s]["ttft_turns_2plus_s"]["p50"], 3) for s in SYSTEMS},
              "prefill_tokens_saved_vs_pool": {s: 1 - systems[s]["prompt_tokens_computed_turns_2plus"]
                                               / max(pool["prompt_tokens_computed_turns_2plus"], 1) for s in SYSTEMS}}
    path = common.write_result("multi_turn" + ("_quick" if args.quick else ""), record, args.out)
    line = "; ".join(f"{s}: TTFT p50 {systems[s]['ttft_turns_2plus_s']['p50']:.3f} s p90 "
                     f"{systems[s]['ttft_turns_2plus_s']['p90']:.3f} s, {systems[s]['prompt_tokens_computed_turns_2plus']}"
                     f" prompt tokens computed" for s in SYSTEMS)
    print(f"multi_turn [{args.sessions} sessions x {args.turns} turns, pool for {args.pool_sessions}, turns 2+]: "
          f"{line}; greedy agreement {agree} -> {path}")
    return record


if __name__ == "__main__":
    t0 = time.perf_counter()
    main(sys.argv[1:])
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
