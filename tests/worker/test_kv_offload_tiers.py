"""Offload tiers of the prefix cache end to end on the tiny random Llama (float32, CPU).

A returning prompt whose blocks other traffic evicted from the pool hits the host tier
(or, after a restart, the disk tier) and produces exactly the tokens of a run without
tiers; damaged or foreign disk files are skipped with a warning; bad settings are clear
errors.
"""

from __future__ import annotations

import logging
import random

import pytest

from pagedllm import LLM, SamplingParams

MAX_LEN = 256
_rng = random.Random(7)
PROMPT = [_rng.randrange(3, 49152) for _ in range(80)]  # 5 blocks of 16
CHURN = [[_rng.randrange(3, 49152) for _ in range(200)] for _ in range(3)]  # each needs most of the pool


def _greedy(n: int = 8) -> SamplingParams:
    # logprobs too: the tiny random model often repeats one token, so the tokens alone
    # would hide K/V damage that the probabilities show
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)


def _result(out) -> tuple[list[int], float]:
    return out.outputs[0].token_ids, round(out.outputs[0].cumulative_logprob, 3)


def _make(tiny_model_dir, **kw) -> LLM:
    return LLM(model=str(tiny_model_dir), max_model_len=MAX_LEN, num_kv_blocks=16, **kw)


def _generate(llm: LLM, prompt: list[int]):
    out, = llm.generate([{"prompt_token_ids": prompt}], _greedy(), use_tqdm=False)
    return out


def _session(llm: LLM):
    """The prompt, traffic that evicts it from the pool, the prompt again."""
    first = _generate(llm, PROMPT)
    for p in CHURN:
        _generate(llm, p)
    again = _generate(llm, PROMPT)
    llm.llm_engine.scheduler.check_integrity()
    assert llm.llm_engine.get_stats().num_used_blocks == 0
    return first, again


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return _result(_generate(_make(tiny_model_dir, enable_prefix_caching=False), PROMPT))


def test_host_tier_hit_after_churn_gives_the_same_tokens(tiny_model_dir, reference):
    pool_only = _make(tiny_model_dir)
    _, again = _session(pool_only)
    assert again.num_cached_tokens == 0  # the pool alone lost it

    llm = _make(tiny_model_dir, kv_offload_memory="1MiB")
    first, again = _session(llm)
    assert first.metrics.cached_tokens_by_tier == {"pool": 0, "host": 0, "disk": 0}
    m = again.metrics
    assert m.num_preemptions == 0 and m.preemption_modes == []
    assert m.queue_time >= 0 and m.prefill_time >= 0 and m.decode_time >= 0
    assert m.queue_time + m.prefill_time == pytest.approx(m.time_to_first_token)
    pool_hit = _generate(llm, PROMPT)  # right after: the blocks are back in the pool
    assert pool_hit.metrics.cached_tokens_by_tier == {"pool": 64, "host": 0, "disk": 0}
    assert again.num_cached_tokens == 64
    assert again.metrics.cached_tokens_by_tier == {"pool": 0, "host": 64, "disk": 0}
    assert _result(first) == _result(again) == reference


def test_disk_tier_survives_a_restart_and_skips_damaged_files(tiny_model_dir, reference, tmp_path, caplog):
    llm = _make(tiny_model_dir, kv_offload_dir=str(tmp_path))
    _, again = _session(llm)
    assert again.metrics.cached_tokens_by_tier["disk"] == 64
    del llm
    files = sorted(tmp_path.glob("*.safetensors"))
    assert files
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")

    restarted = _make(tiny_model_dir, kv_offload_dir=str(tmp_path))
    out = _generate(restarted, PROMPT)
    assert out.metrics.cached_tokens_by_tier == {"pool": 0, "host": 0, "disk": 64}
    assert _result(out) == reference
    assert "junk.safetensors" in caplog.text

    for f in tmp_path.glob("*.safetensors"):  # truncate every block file: none may be used
        f.write_bytes(f.read_bytes()[:100])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        damaged = _make(tiny_model_dir, kv_offload_dir=str(tmp_path))
    assert "ignoring unreadable file" in caplog.text
    out = _generate(damaged, PROMPT)
    assert out.num_cached_tokens == 0
    assert _result(out) == reference


def test_disk_files_of_another_setup_are_ignored(tiny_model_dir, tmp_path, caplog):
    _session(_make(tiny_model_dir, kv_offload_dir=str(tmp_path)))
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        other = LLM(model=str(tiny_model_dir), max_model_len=MAX_LEN, num_kv_blocks=32, block_size=8,
                    kv_offload_dir=str(tmp_path))
    assert "written by another engine setup" in caplog.text
    assert _generate(other, PROMPT).num_cached_tokens == 0


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_tiers_with_quantized_kv_give_the_same_tokens(tiny_model_dir, tmp_path, name):
    """fp8 blocks, and int8 blocks with their scales, saved to the host tier and to disk and
    loaded back: the same tokens and logprobs as computing the prompt, before and after a restart."""
    reference = _result(_generate(_make(tiny_model_dir, kv_cache_dtype=name, enable_prefix_caching=False), PROMPT))
    llm = _make(tiny_model_dir, kv_cache_dtype=name, kv_offload_memory="1MiB", kv_offload_dir=str(tmp_path))
    first, again = _session(llm)
    assert again.metrics.cached_tokens_by_tier == {"pool": 0, "host": 64, "disk": 0}
    assert _result(first) == _result(again) == reference
    del llm
    restarted = _make(tiny_model_dir, kv_cache_dtype=name, kv_offload_dir=str(tmp_path))
    out = _generate(restarted, PROMPT)
    assert out.metrics.cached_tokens_by_tier == {"pool": 0, "host": 0, "disk": 64}
    assert _result(out) == reference


@pytest.mark.parametrize("kw, field", [
    ({"kv_offload_memory": -5}, "kv_offload_memory"),
    ({"kv_offload_memory": "lots"}, "kv_offload_memory"),
    ({"kv_offload_disk_space": "0GiB"}, "kv_offload_disk_space"),
    ({"kv_offload_dir": ""}, "kv_offload_dir"),
])
def test_bad_sizes_are_clear_errors(kw, field):
    from pagedllm.config import EngineConfig

    with pytest.raises(ValueError, match=field):
        EngineConfig(**kw)


def test_unwritable_offload_dir_is_a_clear_error(tiny_model_dir, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ValueError, match="kv_offload_dir"):
        _make(tiny_model_dir, kv_offload_dir=str(not_a_dir / "sub"))
