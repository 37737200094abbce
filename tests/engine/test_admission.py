"""Requests count against the waiting limit, and against a data-parallel replica's load, from
the moment they arrive or are routed, not once tokenized or accepted, so a burst cannot
overshoot either."""

from __future__ import annotations

import asyncio
import time

from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineOverloadedError
from pagedllm.engine.data_parallel import DataParallelAsyncEngine
from pagedllm.engine.router import make_router
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from tests.fake_engine import FakeEngine


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def _slow_tokenizer(fake: FakeEngine) -> FakeEngine:
    tokenize = fake.tokenize_prompt

    def slow(prompt, add_special_tokens: bool = True):
        time.sleep(0.001)
        return tokenize(prompt, add_special_tokens)

    fake.tokenize_prompt = slow
    return fake


def test_300_text_prompts_against_a_waiting_limit_of_32():
    async def main():
        fake = _slow_tokenizer(FakeEngine(max_num_seqs=1, step_s=0.05, max_model_len=512))
        eng = AsyncLLMEngine(fake, max_waiting_requests=32, stats_log_interval_s=0)
        params = SamplingParams(max_tokens=100, output_kind=RequestOutputKind.FINAL_ONLY)
        results = await asyncio.gather(*[eng.add_request(f"r{i}", "hello there", params) for i in range(300)],
                                       return_exceptions=True)
        accepted = [r for r in results if not isinstance(r, BaseException)]
        overloaded = [r for r in results if isinstance(r, EngineOverloadedError)]
        peak = eng.num_waiting_estimate()
        for stream in accepted:
            stream.abort()
        await eng.shutdown()
        return len(accepted), len(overloaded), peak

    num_accepted, num_overloaded, peak = run(main())
    assert num_accepted == 32 and num_overloaded == 268
    assert peak <= 32


class _Replica(FakeEngine):
    exit_reason = None

    def is_alive(self) -> bool:
        return True


def test_a_burst_is_split_evenly_by_the_least_loaded_router():
    async def main():
        replicas = [AsyncLLMEngine(_Replica(max_model_len=512, step_s=0.01), stats_log_interval_s=0) for _ in range(2)]
        config = EngineConfig(model="fake-model", max_model_len=512, block_size=4)
        dp = DataParallelAsyncEngine(replicas, _slow_tokenizer(FakeEngine(max_model_len=512)), config,
                                     make_router("least_loaded", 4))
        params = SamplingParams(max_tokens=50, output_kind=RequestOutputKind.FINAL_ONLY)
        streams = await asyncio.gather(*[dp.add_request(f"r{i}", "hello there", params) for i in range(48)])
        counts = [len(live) for live in dp._in_flight]
        assert all(not routed for routed in getattr(dp, "_routed", []))
        for stream in streams:
            stream.abort()
        await dp.shutdown()
        return counts

    assert run(main()) == [24, 24]
