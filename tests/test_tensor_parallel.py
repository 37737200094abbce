"""Tensor parallelism on CPU: two gloo ranks (the engine process and one worker) give the
same greedy tokens and close logprobs as one rank, on tiny random Llama folders whose KV
heads split across the ranks, whose KV heads are fewer than the ranks (replicated), and
whose vocabulary the ranks do not divide; a killed worker fails the engine with a clear
error within a bounded time and frees every block."""

from __future__ import annotations

import math
import os
import signal
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.executor import TensorParallelWorkerError
from tests.model_utils import write_random_llama_folder

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=256, rms_norm_eps=1e-6)
PROMPTS = [[1, 17, 230, 45, 99, 3, 8], [1, 400, 12, 12, 88], [1] + list(range(50, 90)), [1, 5]]
ENGINE = dict(dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=4, max_num_seqs=8,
              max_num_batched_tokens=32, worker_timeout_s=60)


def _greedy(folder, tp: int, **engine):
    llm = LLM(str(folder), tensor_parallel_size=tp, **{**ENGINE, **engine})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True),
                            use_tqdm=False)
        return ([o.outputs[0].token_ids for o in outs],
                [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs])
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("kv_heads,vocab,tied", [(2, 509, False), pytest.param(1, 512, True, marks=pytest.mark.slow)],
                         ids=["kv-heads-split-odd-vocab", "kv-heads-replicated-tied"])
def test_tp2_equals_tp1(tmp_path, kv_heads, vocab, tied):
    folder = write_random_llama_folder(tmp_path / "m", num_key_value_heads=kv_heads, vocab_size=vocab,
                                       tie_word_embeddings=tied, **SHAPE)
    tokens1, logprobs1 = _greedy(folder, 1)
    # chunked prefill (the 41-token prompt over two steps at a 32-token budget) and a prefix hit
    tokens2, logprobs2 = _greedy(folder, 2)
    assert tokens2 == tokens1
    for a, b in zip(logprobs1, logprobs2):
        assert all(math.isclose(x, y, abs_tol=1e-4) for x, y in zip(a, b)), (a, b)


def test_tensor_parallel_size_must_divide_heads(tmp_path):
    folder = write_random_llama_folder(tmp_path / "m", num_key_value_heads=2, vocab_size=64,
                                       **{**SHAPE, "num_attention_heads": 4, "num_hidden_layers": 1})
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(folder), tensor_parallel_size=3, **ENGINE)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            LLM(str(folder), tensor_parallel_size=bad, **ENGINE)


def test_killed_worker_fails_the_engine_with_a_clear_error(tmp_path):
    folder = write_random_llama_folder(tmp_path / "m", num_key_value_heads=2, vocab_size=128, **SHAPE)
    llm = LLM(str(folder), tensor_parallel_size=2, **{**ENGINE, "worker_timeout_s": 20})
    engine = llm.llm_engine
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate([{"prompt_token_ids": [1, 5, 9]}], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
        (_, proc, _), = engine.executor.workers
        engine.add_request("r", [1, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
        engine.step()  # the request is running when its worker dies
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=10)
        start = time.monotonic()
        with pytest.raises(TensorParallelWorkerError, match=r"worker rank 1 \(pid \d+\) died \(killed by signal 9\)"):
            for _ in range(100):
                engine.step()
        assert time.monotonic() - start < 30  # bounded by worker_timeout_s, never a hang
        assert not engine.has_unfinished_requests()
        assert engine.get_stats().num_used_blocks == 0
        with pytest.raises(TensorParallelWorkerError):  # and stays failed
            engine.step()
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_async_engine_shutdown_stops_the_workers(tmp_path):
    import asyncio

    from pagedllm.engine.async_engine import AsyncLLMEngine

    folder = write_random_llama_folder(tmp_path / "m", num_key_value_heads=2, vocab_size=64,
                                       **{**SHAPE, "num_hidden_layers": 1})
    llm = LLM(str(folder), tensor_parallel_size=2, **ENGINE)
    (_, proc, _), = llm.llm_engine.executor.workers

    async def serve_one_then_shut_down() -> list[int]:
        engine = AsyncLLMEngine(llm.llm_engine, stats_log_interval_s=0)
        outs = [o async for o in engine.generate([1, 5, 9], SamplingParams(temperature=0.0, max_tokens=3,
                                                                          ignore_eos=True))]
        await engine.shutdown()
        return outs[-1].outputs[0].token_ids

    assert len(asyncio.run(serve_one_then_shut_down())) == 3
    proc.join(timeout=10)
    assert not proc.is_alive()  # stopped by the shutdown, not left for the interpreter's exit
