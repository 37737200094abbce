"""The data-parallel routers (pure Python, no model), and the prefix-cache hit rate they give two
real engines (tiny random model) on a trace of requests sharing a few system prompts."""

from __future__ import annotations

import random

import pytest

from pagedllm.core.block_pool import hash_block_tokens
from pagedllm.engine.router import (LeastLoadedRouter, PrefixAwareRouter, ReplicaLoad, RoundRobinRouter, make_router,
                                    prefix_block_hashes)

IDLE = ReplicaLoad(0, 0)


def test_prefix_hashes_are_the_prefix_cache_chain():
    ids = list(range(100, 111))  # 2 full blocks of 4, 3 tokens left over
    first = hash_block_tokens(None, ids[0:4])
    assert prefix_block_hashes(ids, 4, 64) == [first, hash_block_tokens(first, ids[4:8])]
    assert prefix_block_hashes(ids, 4, 1) == [first]
    assert prefix_block_hashes(ids[:3], 4, 64) == []


def test_shared_prefix_goes_to_the_replica_that_served_it():
    router = PrefixAwareRouter(block_size=4)
    system_a, system_b = [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 8, 8, 8, 8]
    first_a = router.route(system_a + [100], [IDLE, IDLE])
    first_b = router.route(system_b + [100], [IDLE, IDLE])
    assert first_a != first_b  # new prefixes spread over idle replicas (ties taken in turn)
    for user in range(5):
        assert router.route(system_a + [200 + user, 7], [IDLE, IDLE]) == first_a
        assert router.route(system_b + [300 + user], [IDLE, IDLE]) == first_b
    # while first_a cannot take requests the other replica serves system_a: it becomes the
    # prefix's latest owner, for its longer prefix and for system_a alone
    longer = system_a + [50, 51, 52, 53]
    router.route(longer, [None, IDLE] if first_a == 0 else [IDLE, None])
    assert router.route(longer + [1], [IDLE, IDLE]) == 1 - first_a
    assert router.route(system_a + [60], [IDLE, IDLE]) == 1 - first_a
    assert router.num_prefix_routed == 12


def test_load_cap_spills_a_hot_prefix_and_then_both_replicas_own_it():
    router = PrefixAwareRouter(block_size=4, max_imbalance=3)
    hot = [5] * 8
    owner = router.route(hot, [IDLE, IDLE])
    loads = [ReplicaLoad(0, 0), ReplicaLoad(0, 0)]
    loads[owner] = ReplicaLoad(2, 100)
    assert router.route(hot + [1], loads) == owner  # 2 more in flight: under the cap
    loads[owner] = ReplicaLoad(3, 150)
    other = router.route(hot + [2], loads)  # 3 more: spills to the least loaded
    assert other == 1 - owner and router.num_spilled == 1
    assert router.route(hot + [3], [IDLE, IDLE]) == other  # the latest owner of the hot prefix


def test_least_loaded_and_round_robin_and_dead_replicas():
    least = LeastLoadedRouter()
    assert least.route([1], [ReplicaLoad(2, 10), ReplicaLoad(1, 99), ReplicaLoad(1, 50)]) == 2
    assert least.route([1], [ReplicaLoad(2, 10), None, ReplicaLoad(3, 5)]) == 0
    rr = RoundRobinRouter()
    assert [rr.route([1, 2, 3, 4], [IDLE, IDLE, IDLE]) for _ in range(4)] == [0, 1, 2, 0]
    assert [rr.route([1], [IDLE, None, IDLE]) for _ in range(2)] == [0, 2]  # the unavailable one skipped
    prefix = PrefixAwareRouter(block_size=2)
    owner = prefix.route([7, 7, 7, 7], [IDLE, IDLE])
    prefix.forget(owner)  # its cache died with it
    assert prefix.route([7, 7, 7, 7], [IDLE, IDLE]) in (0, 1) and prefix.num_prefix_routed == 0
    with pytest.raises(ValueError, match="no data-parallel replica"):
        rr.route([1], [None, None])


@pytest.mark.parametrize("field,value", [("block_size", 0), ("max_imbalance", -1), ("max_prefix_blocks", 0)])
def test_router_bad_arguments(field, value):
    with pytest.raises(ValueError, match=field):
        PrefixAwareRouter(**{"block_size": 4, field: value})
    with pytest.raises(ValueError, match="data_parallel_router"):
        make_router("random", 4)


# ---------------------------------------------------------------------------- real prefix caches
def _trace(num_systems: int = 4, users_per_system: int = 6, system_len: int = 24, seed: int = 0) -> list[list[int]]:
    """Requests = one of ``num_systems`` system prompts + a short user part, shuffled."""
    rng = random.Random(seed)
    systems = [[1] + [rng.randrange(3, 128) for _ in range(system_len - 1)] for _ in range(num_systems)]
    trace = [s + [rng.randrange(3, 128) for _ in range(rng.randrange(3, 9))]
             for s in systems for _ in range(users_per_system)]
    rng.shuffle(trace)
    return trace


def _hit_rate(engines, router, trace) -> float:
    """Serve the trace one request at a time through ``router``; prefix-cache hit rate over
    every engine (tokens found / tokens looked up, from the engines' own counters)."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    before = [e.get_stats() for e in engines]
    for k, ids in enumerate(trace):
        engine = engines[router.route(ids, [IDLE] * len(engines))]
        engine.add_request(f"r{k}", {"prompt_token_ids": ids}, params)
        while engine.has_unfinished_requests():
            engine.step()
    stats = [e.get_stats() for e in engines]
    hits = sum(s.prefix_cache_hits - b.prefix_cache_hits for s, b in zip(stats, before))
    queries = sum(s.prefix_cache_queries - b.prefix_cache_queries for s, b in zip(stats, before))
    return hits / queries


def test_prefix_routing_beats_round_robin_on_shared_system_prompts(tmp_path):
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.config import EngineConfig
    from tests.model_utils import write_random_llama_folder

    folder = write_random_llama_folder(tmp_path / "m", vocab_size=128, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                       max_position_embeddings=128)
    # 16 blocks of 4 tokens per replica: two system prompts (6 blocks each) stay cached next to
    # the running request, four do not
    config = EngineConfig(model=str(folder), max_model_len=64, block_size=4, num_kv_blocks=16, max_num_seqs=4)
    trace = _trace()
    engines = [LLMEngine(config) for _ in range(2)]
    rates = {}
    for name, router in (("round_robin", RoundRobinRouter()), ("prefix", PrefixAwareRouter(block_size=4))):
        for engine in engines:
            assert engine.scheduler.reset_prefix_cache()  # each policy starts from empty caches
        rates[name] = _hit_rate(engines, router, trace)
    print(f"prefix-cache hit rate: round robin {rates['round_robin']:.3f}, prefix-aware {rates['prefix']:.3f}")
    # prefix-aware: each system prompt misses once (4 of 24 requests), 6 cached blocks of
    # every later request hit; round robin: both replicas see all four prompts and evict
    assert rates["prefix"] > rates["round_robin"] + 0.2
    assert rates["prefix"] > 0.6
