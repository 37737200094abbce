"""AsyncLLMEngine against a small fake engine with LLMEngine's API (fast, deterministic).

The fake engine is in ``tests/fake_engine.py``.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pagedllm.engine.async_engine import (
    AsyncLLMEngine, EngineDeadError, EngineInput, EngineOverloadedError, EngineUnhealthyError,
    merge_request_output)
from pagedllm.errors import ContextLengthError
from pagedllm.metrics import EngineMetrics
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from fake_engine import FakeEngine

def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def _collect(engine: AsyncLLMEngine, prompt, params: SamplingParams, rid: str) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, rid)]


async def _stop(engine: AsyncLLMEngine) -> None:
    await engine.shutdown()


# ---------------------------------------------------------------------------- tests
def test_delta_cumulative_and_final_only_shapes():
    async def main():
        eng = AsyncLLMEngine(FakeEngine(), stats_log_interval_s=0)
        delta = await _collect(eng, "hi", SamplingParams(max_tokens=3, output_kind=RequestOutputKind.DELTA), "d")
        cum = await _collect(eng, "hi", SamplingParams(max_tokens=3), "c")
        final = await _collect(eng, "hi", SamplingParams(max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY), "f")
        await _stop(eng)
        return delta, cum, final

    delta, cum, final = run(main())
    assert [o.outputs[0].text for o in delta] == ["a", "b", "c"]
    assert [o.finished for o in delta] == [False, False, True]
    assert [o.outputs[0].text for o in cum] == ["a", "ab", "abc"]
    assert cum[-1].outputs[0].token_ids == [97, 98, 99]
    assert len(final) == 1 and final[0].outputs[0].text == "abc" and final[0].outputs[0].finish_reason == "length"
    assert final[0].prompt_token_ids == [ord("h"), ord("i")]


def test_n_children_merge_by_index():
    async def main():
        eng = AsyncLLMEngine(FakeEngine(), stats_log_interval_s=0)
        outs = await _collect(eng, "x", SamplingParams(n=3, max_tokens=2, logprobs=1,
                                                       output_kind=RequestOutputKind.FINAL_ONLY), "n")
        await _stop(eng)
        return outs

    (final,) = run(main())
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert [c.text for c in final.outputs] == ["ab", "bc", "cd"]
    assert [len(c.logprobs) for c in final.outputs] == [2, 2, 2]


def test_merge_request_output_appends_and_replaces():
    d1 = RequestOutput("r", "p", [1], [CompletionOutput(0, "a", [5], -0.1, None, None),
                                       CompletionOutput(1, "x", [7], -0.2, None, None)], False)
    d2 = RequestOutput("r", "p", [1], [CompletionOutput(1, "y", [8], -0.5, None, "stop", 8)], False)
    d3 = RequestOutput("r", "p", [1], [CompletionOutput(0, "b", [6], -0.3, None, "length")], True)
    acc = merge_request_output(None, d1)
    acc = merge_request_output(acc, d2)
    acc = merge_request_output(acc, d3)
    assert [(c.text, c.token_ids, c.finish_reason) for c in acc.outputs] == [
        ("ab", [5, 6], "length"), ("xy", [7, 8], "stop")]
    assert acc.outputs[1].stop_reason == 8 and acc.finished
    assert d1.outputs[0].text == "a"  # the deltas themselves are untouched


def test_validation_errors_raise_before_streaming_and_engine_keeps_serving():
    async def main():
        eng = AsyncLLMEngine(FakeEngine(max_model_len=16), stats_log_interval_s=0)
        errors = []
        for prompt, params in [("", SamplingParams()), ([200], SamplingParams()),
                               ("x" * 10, SamplingParams(max_tokens=10)),
                               ("x", SamplingParams(logprobs=6))]:
            with pytest.raises(ValueError) as e:
                await eng.add_request(f"bad{len(errors)}", prompt, params)
            errors.append(str(e.value))
        ok = await _collect(eng, "ok", SamplingParams(max_tokens=2, output_kind=RequestOutputKind.FINAL_ONLY), "ok")
        await _stop(eng)
        return errors, ok

    errors, ok = run(main())
    assert "empty" in errors[0]
    assert "200" in errors[1] and "128" in errors[1]
    assert "16" in errors[2] and "20" in errors[2]
    assert "logprobs" in errors[3]
    assert ok[0].outputs[0].text == "ab"


def test_engine_runs_in_one_background_thread():
    async def main():
        fake = FakeEngine()
        eng = AsyncLLMEngine(fake, stats_log_interval_s=0)
        await _collect(eng, "a", SamplingParams(max_tokens=1), "t")
        await _stop(eng)
        return fake.step_thread

    thread = run(main())
    assert thread is not threading.main_thread() and thread.name == "pagedllm-engine"


def test_cancelled_consumer_aborts_within_one_step_and_frees_blocks():
    async def main():
        fake = FakeEngine(step_s=0.02, max_model_len=512)
        eng = AsyncLLMEngine(fake, stats_log_interval_s=0)
        gen = eng.generate("abcdefgh", SamplingParams(max_tokens=400, output_kind=RequestOutputKind.DELTA), "long")
        first = await gen.__anext__()
        assert fake.used_blocks() > 0
        steps_before = fake.stats.num_steps
        t0 = time.monotonic()
        await gen.aclose()  # what a client disconnect does
        while fake.requests and time.monotonic() - t0 < 2:
            await asyncio.sleep(0.005)
        elapsed_steps = fake.stats.num_steps - steps_before
        await asyncio.sleep(0.05)
        stats = eng.stats
        await _stop(eng)
        return first, fake, elapsed_steps, stats

    first, fake, elapsed_steps, stats = run(main())
    assert first.outputs[0].text == "a"
    assert not fake.requests and fake.used_blocks() == 0
    assert elapsed_steps <= 1
    assert stats.num_used_blocks == 0


def test_step_failure_fails_only_that_step_then_health_probe_recovers():
    async def main():
        fake = FakeEngine()
        eng = AsyncLLMEngine(fake, stats_log_interval_s=0)
        fake.fail_steps = 1
        failed = await _collect(eng, "a", SamplingParams(max_tokens=2), "f")
        degraded = eng.is_healthy
        await eng.check_health()  # runs a probe; the fake no longer fails
        healthy = eng.is_healthy
        ok = await _collect(eng, "a", SamplingParams(max_tokens=2), "g")
        await _stop(eng)
        return failed, degraded, healthy, ok

    failed, degraded, healthy, ok = run(main())
    assert failed[-1].finished and failed[-1].error and failed[-1].outputs[0].finish_reason == "error"
    assert degraded is False and healthy is True
    assert ok[-1].outputs[0].text == "ab"


def test_permanent_step_failure_makes_health_check_fail():
    async def main():
        fake = FakeEngine()
        eng = AsyncLLMEngine(fake, stats_log_interval_s=0)
        fake.fail_steps = 10**9
        await _collect(eng, "a", SamplingParams(max_tokens=2), "f")
        with pytest.raises(EngineUnhealthyError):
            await eng.check_health()
        await _stop(eng)

    run(main())


def test_engine_death_fails_pending_and_new_requests_promptly():
    async def main():
        fake = FakeEngine(step_s=0.01, max_model_len=512)
        eng = AsyncLLMEngine(fake, stats_log_interval_s=0)
        gen = eng.generate("a", SamplingParams(max_tokens=400, output_kind=RequestOutputKind.DELTA), "victim")
        await gen.__anext__()
        fake.die = True
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        took = time.monotonic() - t0
        with pytest.raises(EngineDeadError):
            await eng.add_request("late", "a", SamplingParams())
        with pytest.raises(EngineDeadError):
            await eng.check_health()
        return took, eng.is_healthy

    took, healthy = run(main())
    assert took < 1.0 and healthy is False


class StoppableFakeEngine(FakeEngine):
    """A FakeEngine that counts ``shutdown()`` calls (LLMEngine's stops tensor-parallel workers)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_shutdowns = 0

    def shutdown(self) -> None:
        self.num_shutdowns += 1


def test_shutdown_stops_the_engine_itself_once():
    """AsyncLLMEngine.shutdown ends with engine.shutdown() — after a normal run, without a start,
    and after the loop died — so nothing the engine started (TP workers) outlives it."""
    async def main():
        served = StoppableFakeEngine()
        eng = AsyncLLMEngine(served, stats_log_interval_s=0)
        await _collect(eng, "hi", SamplingParams(max_tokens=2), "a")
        await eng.shutdown()
        await eng.shutdown()
        never_started = StoppableFakeEngine()
        await AsyncLLMEngine(never_started, stats_log_interval_s=0).shutdown()
        dying = StoppableFakeEngine()
        eng = AsyncLLMEngine(dying, stats_log_interval_s=0)
        dying.die = True
        with pytest.raises(EngineDeadError):
            await _collect(eng, "hi", SamplingParams(max_tokens=2), "b")
        await eng.shutdown()
        return served.num_shutdowns, never_started.num_shutdowns, dying.num_shutdowns

    assert run(main()) == (1, 1, 1)


def test_backpressure_rejects_beyond_max_waiting_requests():
    async def main():
        fake = FakeEngine(max_num_seqs=1, step_s=0.01, max_model_len=512)
        eng = AsyncLLMEngine(fake, max_waiting_requests=2, stats_log_interval_s=0)
        params = SamplingParams(max_tokens=200, output_kind=RequestOutputKind.FINAL_ONLY)
        streams = [await eng.add_request(f"r{i}", "a", params) for i in range(3)]  # 1 running + 2 waiting
        # A step refreshes the stats snapshot; wait (bounded) until it shows the 2 waiting.
        for _ in range(1000):
            if eng.num_waiting_estimate() >= 2:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(EngineOverloadedError):
            await eng.add_request("r3", "a", params)
        for s in streams:
            s.abort()
        for _ in range(1000):  # bounded wait for a step to drop the aborted requests
            if eng.num_waiting_estimate() < 2:
                break
            await asyncio.sleep(0.01)
        again = await eng.add_request("r4", "a", SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY))
        out = [o async for o in again]
        await _stop(eng)
        return out

    out = run(main())
    assert out[0].outputs[0].text == "a"


def test_metrics_recorded_per_request():
    async def main():
        metrics = EngineMetrics("fake-model")
        eng = AsyncLLMEngine(FakeEngine(), metrics=metrics, stats_log_interval_s=0)
        await _collect(eng, "hello", SamplingParams(max_tokens=3), "m1")
        await _collect(eng, "hello", SamplingParams(max_tokens=2), "m2")
        await asyncio.sleep(0.05)
        await _stop(eng)
        return metrics.render().decode()

    text = run(main())
    assert 'pagedllm:request_success_total{engine="0",finished_reason="length",model_name="fake-model"} 2.0' in text
    assert 'pagedllm:time_to_first_token_seconds_count{engine="0",model_name="fake-model"} 2.0' in text
    # 3 + 2 tokens, one TTFT each: 2 + 1 inter-token gaps
    assert 'pagedllm:inter_token_latency_seconds_count{engine="0",model_name="fake-model"} 3.0' in text
    assert 'pagedllm:generation_tokens_total{engine="0",model_name="fake-model"} 5.0' in text
    assert 'pagedllm:request_prompt_tokens_sum{engine="0",model_name="fake-model"} 10.0' in text
    assert 'pagedllm:kv_cache_usage_perc{engine="0",model_name="fake-model"} 0.0' in text


def test_caller_ids_are_labels_internal_ids_never_collide():
    """A retried id, and labels that look like child (``0_x``) or batch (``y-1``) ids, run side by side."""
    async def main():
        fake = FakeEngine(max_model_len=512)
        eng = AsyncLLMEngine(fake, stats_log_interval_s=0)
        params = SamplingParams(max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY)
        x = await eng.add_request("x", "a", params.clone())
        retry = await eng.add_request("x", "a", params)
        lookalike = await eng.add_request("0_x", "a", params)
        y = await eng.add_requests("y", [EngineInput("a"), EngineInput("b")], params)
        y1 = await eng.add_request("y-1", "c", params)
        y0 = await eng.add_request("y-0", "c", params)
        streams = [x, retry, lookalike, *y, y1, y0]
        ids = [s.request_id for s in streams]
        finals = [[o async for o in s][-1] for s in streams]
        await _stop(eng)
        return streams, ids, finals, fake

    streams, ids, finals, fake = run(main())
    assert len(set(ids)) == len(ids) == 7
    assert [s.label for s in streams] == ["x", "x", "0_x", "y[0]", "y[1]", "y-1", "y-0"]
    assert all(f.finished and f.outputs[0].text == "abc" for f in finals)
    assert fake.requests == {}


def test_batch_add_is_all_or_nothing_and_names_the_prompt():
    async def main():
        fake = FakeEngine(max_model_len=16)
        eng = AsyncLLMEngine(fake, stats_log_interval_s=0)
        params = SamplingParams(max_tokens=4, output_kind=RequestOutputKind.FINAL_ONLY)
        with pytest.raises(ValueError, match=r"^prompt\[2\]: .*16"):
            await eng.add_requests("b", [EngineInput("a"), EngineInput("b"), EngineInput("x" * 14)], params)
        await asyncio.sleep(0.05)
        left = dict(fake.requests)
        ok = await eng.add_requests("b", [EngineInput("a"), EngineInput("b")], params)
        texts = [[o async for o in s][-1].outputs[0].text for s in ok]
        await _stop(eng)
        return left, texts, eng.num_active_streams

    left, texts, active = run(main())
    assert left == {} and texts == ["abcd", "abcd"] and active == 0


def test_cancelled_batch_add_leaves_nothing_behind():
    async def main():
        fake = FakeEngine(step_s=0.01, max_model_len=512)
        eng = AsyncLLMEngine(fake, stats_log_interval_s=0)
        eng.start()
        params = SamplingParams(max_tokens=300)
        task = asyncio.ensure_future(eng.add_requests("c", [EngineInput("a")] * 50, params))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not fake.requests:
                break
        await _stop(eng)
        return fake

    fake = run(main())
    assert fake.requests == {} and fake.used_blocks() == 0


async def _read_for_steps(stream, fake: FakeEngine, num_steps: int) -> int:
    """Read ``stream`` until the engine ran ``num_steps`` more steps; the tokens read (a
    deadline of 10 s: a stalled engine fails, it does not hang)."""
    first, got = fake.stats.num_steps, 0

    async def read() -> None:
        nonlocal got
        async for out in stream:
            got += len(out.outputs[0].token_ids)
            if got >= num_steps and fake.stats.num_steps - first >= num_steps:
                return

    await asyncio.wait_for(read(), 10)
    return got


@pytest.mark.parametrize("kind", ["prompt", "chat"])
def test_slow_tokenization_does_not_hold_back_running_streams(kind):
    """A prompt or conversation whose tokenization is slow (a huge prompt, a heavy chat
    template) is tokenized on the front-end thread: while it is stuck, a running request
    keeps getting tokens step after step, and the slow one is added once it is done."""
    async def main():
        fake = FakeEngine(step_s=0.002, max_model_len=4096)
        stuck, release = threading.Event(), threading.Event()

        def slow_encode(text: str) -> None:
            if "huge" in text:
                stuck.set()
                release.wait(30)

        fake.tokenizer.on_encode = slow_encode
        eng = AsyncLLMEngine(fake, stats_log_interval_s=0)
        running = await eng.add_request("running", [5, 6, 7], SamplingParams(max_tokens=3000))
        if kind == "prompt":
            slow = asyncio.ensure_future(eng.add_request("slow", "huge " * 500, SamplingParams(max_tokens=2)))
        else:
            slow = asyncio.ensure_future(eng.call_front(lambda f: f.apply_chat_template(
                [{"role": "user", "content": "huge " * 500}])))
        assert await asyncio.to_thread(stuck.wait, 10)
        got = await _read_for_steps(running, fake, 20)  # the engine steps while the tokenizer is stuck
        was_done = slow.done()
        release.set()
        result = await slow
        if kind == "chat":
            await eng.add_request("slow", result, SamplingParams(max_tokens=2))
        await _stop(eng)
        return fake, got, was_done

    fake, got, was_done = run(main())
    assert got >= 20 and not was_done
    assert len(fake.prompt_seen) == 2 and len(fake.prompt_seen[1]) > 2000  # added after all
    huge_threads = set(fake.tokenizer.encode_threads)
    assert huge_threads and all(name.startswith("pagedllm-frontend") for name in huge_threads), huge_threads


def test_input_processor_context_length_error_is_its_own_value_error():
    """The real engine's context check raises ContextLengthError (a ValueError), which the server
    turns into a 400 naming the prompt field; the fake above raises the same."""
    from pagedllm.engine.input_processor import InputProcessor

    proc = InputProcessor(None, vocab_size=100, max_model_len=8, max_logprobs=5, extra_stop_token_ids=[])
    with pytest.raises(ContextLengthError, match="maximum context length is 8"):
        proc.process([1] * 8, SamplingParams(max_tokens=None))  # no room for one output token
    with pytest.raises(ContextLengthError, match="you requested 9 tokens"):
        proc.process([1] * 4, SamplingParams(max_tokens=5))
    assert proc.process([1] * 4, SamplingParams(max_tokens=4)).max_tokens == 4
    assert issubclass(ContextLengthError, ValueError)
