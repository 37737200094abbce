"""A failure caused by one request ends only that request: the others of its step complete with the
tokens they get alone. Rope-scaled models compute every position their ``max_model_len`` admits."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.step_failure import InputError, positions_beyond
from pagedllm.engine.step_failure import retry_output, without_requests


def _greedy(n: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)


def _tokens(outs) -> list[tuple[list[int], float]]:
    return [(o.outputs[0].token_ids, round(o.outputs[0].cumulative_logprob, 3)) for o in outs]


def _run(llm: LLM, prompts: list[list[int]], n: int = 6):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(n), use_tqdm=False)


def test_positions_beyond_names_only_the_requests_past_the_table():
    found = positions_beyond({"a": 10, "b": 60, "c": 0}, {"a": 5, "b": 5, "c": 64}, 64)
    assert list(found) == ["b"] and isinstance(found["b"], InputError) and "position 64" in found["b"]
    assert positions_beyond({"c": 0}, {"c": 64}, 64) == {}


def test_without_requests_and_retry_output():
    from pagedllm.core.outputs import CachedRequestData, NewRequestData

    so = SchedulerOutput(num_scheduled_tokens={"a": 1, "b": 7, "c": 1}, total_num_scheduled_tokens=9,
                         scheduled_new_reqs=[NewRequestData("b", [1] * 7, 7, SamplingParams(), ([0, 1],), 0)],
                         scheduled_cached_reqs=[CachedRequestData("a", ([],), 4), CachedRequestData("c", ([],), 4)])
    kept = without_requests(so, {"b": "x"})
    assert kept.num_scheduled_tokens == {"a": 1, "c": 1} and kept.total_num_scheduled_tokens == 2
    assert kept.scheduled_new_reqs == [] and [r.req_id for r in kept.scheduled_cached_reqs] == ["a", "c"]
    assert so.total_num_scheduled_tokens == 9  # the scheduler's copy is untouched
    ro = retry_output(so, {"b": "boom"}, ["c"])
    assert ro == ModelRunnerOutput(failed={"b": "boom"}, retried={"a"})


@pytest.fixture(scope="module")
def llm(random_model_dir):
    return LLM(model=str(random_model_dir), max_model_len=256, num_kv_blocks=64, block_size=16)


PROMPTS = [[5 + (i * 7 + j) % 400 for j in range(n)] for i, n in enumerate((20, 33, 60, 9))]


def test_a_request_past_the_rotary_table_fails_alone(llm):
    alone = [_tokens(_run(llm, [p]))[0] for p in PROMPTS]
    model = llm.llm_engine.runner.model
    table = model.max_positions
    model.max_positions = 48  # the 60-token prompt reaches past it; the others do not
    try:
        outs = _run(llm, PROMPTS)
    finally:
        model.max_positions = table
    poisoned = outs[2]
    assert poisoned.outputs[0].finish_reason == "error"
    assert isinstance(poisoned.error, InputError) and "beyond the 48 positions" in poisoned.error
    assert _tokens([outs[i] for i in (0, 1, 3)]) == [alone[i] for i in (0, 1, 3)]
    llm.llm_engine.scheduler.check_integrity()
    assert llm.llm_engine.get_stats().num_used_blocks == 0


def test_a_named_step_failure_ends_its_request_and_retries_the_rest(llm, monkeypatch):
    from pagedllm.core.step_failure import StepFailure

    alone = [_tokens(_run(llm, [p]))[0] for p in PROMPTS]
    runner = llm.llm_engine.runner
    real = runner.execute_model
    victim = {}

    def failing(so, *args):
        ids = list(so.num_scheduled_tokens)
        if not victim and len(ids) == len(PROMPTS):  # the first full step: fail one request by name
            victim["id"] = ids[1]
            runner._update_states(so)  # half-updated runner state, as a real failure may leave it
            raise StepFailure(failed={ids[1]: InputError("bad input")})
        return real(so, *args)

    monkeypatch.setattr(runner, "execute_model", failing)
    outs = _run(llm, PROMPTS)
    assert victim["id"].startswith(outs[1].request_id)
    assert outs[1].outputs[0].finish_reason == "error" and outs[1].error == "bad input"
    assert _tokens([outs[i] for i in (0, 2, 3)]) == [alone[i] for i in (0, 2, 3)]
    llm.llm_engine.scheduler.check_integrity()


def _rope_scaled_dir(tmp_path, rope_type: str):
    from tests.model_utils import write_random_llama_folder

    rope = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 4.0}
    if rope_type == "yarn":
        rope["original_max_position_embeddings"] = 64
    return write_random_llama_folder(tmp_path, vocab_size=512, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=64, tie_word_embeddings=True, rope_parameters=rope)


@pytest.mark.parametrize("rope_type", ["linear", "yarn"])
def test_rope_scaled_model_computes_every_admitted_position(tmp_path, rope_type):
    """max_model_len is 4 x max_position_embeddings: a 100-token prompt, alone and batched with a
    short one, gives transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    folder = _rope_scaled_dir(tmp_path, rope_type)
    llm = LLM(model=str(folder), num_kv_blocks=64)
    assert llm.llm_engine.config.max_model_len == 256
    long, short = [3 + (j * 13) % 500 for j in range(100)], [3 + j for j in range(20)]
    alone = _tokens(_run(llm, [long], n=8))
    batched = _tokens(_run(llm, [long, short], n=8))
    assert batched[0] == alone[0]
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([long]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert alone[0][0] == ref[0, 100:].tolist()


def test_dynamic_rope_is_capped_at_the_trained_length(tmp_path):
    from tests.model_utils import write_random_llama_folder

    folder = write_random_llama_folder(tmp_path, vocab_size=512, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=64, tie_word_embeddings=True,
                                       rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})
    llm = LLM(model=str(folder), num_kv_blocks=16)
    assert llm.llm_engine.config.max_model_len == 64
    with pytest.raises(ValueError, match="maximum context length is 64"):
        _run(llm, [[3] * 100])


def test_an_empty_language_regex_fails_only_its_request_as_bad_input(llm):
    pytest.importorskip("xgrammar")
    from pagedllm.sampling_params import StructuredOutputsParams

    empty = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=StructuredOutputsParams(regex=r"[^\s\S]"))
    alone = _tokens(_run(llm, [PROMPTS[0]]))
    outs = llm.generate([{"prompt_token_ids": PROMPTS[1]}, {"prompt_token_ids": PROMPTS[0]}], [empty, _greedy()],
                        use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and isinstance(outs[0].error, InputError)
    assert "language is empty" in outs[0].error
    assert _tokens(outs[1:]) == alone
