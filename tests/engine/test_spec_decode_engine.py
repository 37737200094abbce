"""Speculative decoding end to end on the tiny random Llama (float32 on CPU): greedy and seeded
outputs, logprobs, stop strings, min_tokens, n > 1, preemption, chunked prefill and prefix
caching are the same with and without it, and every block is free afterwards."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}


def _make(model_dir, spec=None, **kw) -> LLM:
    kw.setdefault("max_model_len", 256)
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 4)
    return LLM(model=str(model_dir), speculative_config=spec, debug_integrity_checks=spec is not None, **kw)


def _prompts(n: int, seed: int, shared: int = 0) -> list[dict]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 512) for _ in range(shared)]
    return [{"prompt_token_ids": prefix + [rng.randrange(3, 512) for _ in range(rng.randint(4, 50))]}
            for _ in range(n)]


def _run(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_used_blocks == 0 and stats.num_running == 0 and stats.num_waiting == 0
    llm.llm_engine.scheduler.check_integrity()
    return outs


def _ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def plain(random_model_dir):
    return _make(random_model_dir)


@pytest.fixture(scope="module", params=["ngram", "suffix"])
def spec(random_model_dir, request):
    return _make(random_model_dir, NGRAM if request.param == "ngram" else SUFFIX)


def test_greedy_outputs_are_identical_and_drafts_are_accepted(plain, spec):
    prompts = _prompts(12, seed=1, shared=9)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    assert _ids(_run(spec, prompts, params)) == _ids(_run(plain, prompts, params))
    stats = spec.llm_engine.scheduler.spec_decoding_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0


def test_seeded_sampling_and_logprobs_are_the_same(plain, spec):
    prompts = _prompts(6, seed=2)
    params = [SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=i, max_tokens=30, ignore_eos=True,
                             logprobs=3, presence_penalty=0.2, logit_bias={7: 1.0}) for i in range(6)]
    got, want = _run(spec, prompts, params), _run(plain, prompts, params)
    assert _ids(got) == _ids(want)
    for g, w in zip(got, want):
        for pos_g, pos_w in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert pos_g.keys() == pos_w.keys()
            for tok in pos_g:
                assert pos_g[tok].logprob == pytest.approx(pos_w[tok].logprob, abs=1e-4)
        assert g.outputs[0].cumulative_logprob == pytest.approx(w.outputs[0].cumulative_logprob, abs=1e-3)


def test_stop_strings_min_tokens_eos_and_n(plain, spec):
    prompts = _prompts(6, seed=3)
    ref = _run(plain, prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    params = []
    for i, o in enumerate(ref):  # a stop string from the middle of each reference text
        words = o.outputs[0].text.split()
        params.append(SamplingParams(temperature=0.0, max_tokens=30, stop=[" ".join(words[8 + i:10 + i])],
                                     min_tokens=i, stop_token_ids=[words and int(words[-1][1:])],
                                     n=2 if i % 2 else 1, include_stop_str_in_output=bool(i % 3)))
    got, want = _run(spec, prompts, params), _run(plain, prompts, params)
    for g, w in zip(got, want):
        assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in g.outputs] == \
               [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in w.outputs]
    assert any(c.finish_reason == "stop" for o in got for c in o.outputs)


def test_preemption_chunked_prefill_and_prefix_hits(random_model_dir, plain):
    prompts = _prompts(10, seed=4, shared=12)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    tight = _make(random_model_dir, NGRAM, num_kv_blocks=40, max_model_len=128, max_num_batched_tokens=24,
                  max_num_seqs=6)
    got = _run(tight, prompts, params)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert tight.llm_engine.scheduler.kv_cache_manager.prefix_cache_hits > 0
    assert _ids(got) == _ids(_run(plain, prompts, params))


def test_abort_frees_the_blocks_of_a_speculating_request(spec):
    engine = spec.llm_engine
    engine.add_request("x", _prompts(1, seed=5)[0], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    for _ in range(12):
        engine.step()
    engine.abort_request("x")
    assert engine.get_stats().num_used_blocks == 0
    engine.scheduler.check_integrity()


def test_a_large_batch_switches_speculation_off(random_model_dir):
    llm = _make(random_model_dir, {**NGRAM, "disable_by_batch_size": 4})
    _run(llm, _prompts(6, seed=6), SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    drafts_while_large = llm.llm_engine.scheduler.spec_decoding_stats.num_drafts
    _run(llm, _prompts(2, seed=6), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    assert drafts_while_large == 0 and llm.llm_engine.scheduler.spec_decoding_stats.num_drafts > 0


def test_metrics_counters_status_line_and_usage(random_model_dir, caplog):
    from pagedllm.engine.request_tracker import StatusLogger
    from pagedllm.entrypoints.openai.protocol import usage_metrics
    from pagedllm.metrics import EngineMetrics

    llm = _make(random_model_dir, NGRAM)
    engine = llm.llm_engine
    before = engine.get_stats()
    outs = _run(llm, _prompts(3, seed=7), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    stats = engine.get_stats()
    spec = engine.scheduler.spec_decoding_stats
    assert stats.spec_decode_num_drafts == spec.num_drafts > 0
    assert stats.spec_decode_num_accepted_tokens == sum(stats.spec_decode_num_accepted_tokens_per_pos)
    metrics = EngineMetrics("m")
    metrics.record_stats(stats)
    text = metrics.render().decode()
    assert f'pagedllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {float(spec.num_drafts)}' in text
    assert (f'pagedllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="0"}} '
            f'{float(spec.num_accepted_tokens_per_pos[0])}') in text
    assert sum(o.metrics.num_draft_tokens for o in outs) == spec.num_draft_tokens
    assert sum(o.metrics.num_accepted_tokens for o in outs) == spec.num_accepted_tokens
    story = usage_metrics([o.metrics for o in outs]).model_dump()
    assert story["num_draft_tokens"] == spec.num_draft_tokens
    assert "num_draft_tokens" not in usage_metrics([type(outs[0].metrics)(arrival_time=0.0)]).model_dump()
    status = StatusLogger(1e-9, before)
    with caplog.at_level("INFO", logger="pagedllm.async_engine"):
        status.maybe_log(stats)
    assert f"acceptance_rate={100.0 * spec.acceptance_rate:.1f}%" in caplog.text


def test_structured_outputs_check_every_draft_against_the_grammar(tiny_model_dir):
    pytest.importorskip("xgrammar")
    from pagedllm.sampling_params import StructuredOutputsParams as SO

    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "integer"}}},
              "required": ["items"]}
    sos = [SO(regex=r"(ab|cd)( (ab|cd))+\."), SO(json=schema, disable_any_whitespace=True),
           SO(choice=["alpha beta alpha beta", "gamma"]), SO(regex=r"[0-9]{2}(-[0-9]{2})+")]
    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 140 + 11 * i))} for i in range(len(sos))]
    params = [SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=so) for so in sos]
    plain = _make(tiny_model_dir, max_model_len=512, block_size=16)
    spec = _make(tiny_model_dir, NGRAM, max_model_len=512, block_size=16)
    want, got = _run(plain, prompts, params), _run(spec, prompts, params)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in got] == \
           [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in want]
    assert sum(o.metrics.num_draft_tokens for o in got) > 0
