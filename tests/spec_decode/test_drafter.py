"""The drafter's off-switches: the step-cost model turns drafting off for a compute-bound
batch, a request whose drafts keep failing stops drafting and is probed again later."""

from __future__ import annotations

from pagedllm.config import SpeculativeConfig
from pagedllm.core.request import Request
from pagedllm.core.step_cost import StepCostCoefficients, StepCostModel
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.drafter import Drafter
from pagedllm.spec_decode.proposer import Proposer


class _Fixed(Proposer):
    def propose(self, request, num_tokens):
        return [7] * num_tokens


def _decoding(rid: str) -> Request:
    req = Request(rid, [1, 2, 3], SamplingParams(max_tokens=64), max_tokens=64)
    req.append_output_token_ids([4])
    req.num_computed_tokens = req.num_tokens - 1
    return req


def _model(per_prefill_token: float) -> StepCostModel:
    return StepCostModel(StepCostCoefficients(base=0.03, per_decode_token=0.004, per_prefill_token=per_prefill_token,
                                              per_kilo_pair=1e-6))


def test_weight_bound_steps_draft_and_compute_bound_ones_do_not():
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=4), _Fixed())
    small = [_decoding(f"s{i}") for i in range(2)]
    drafter.step(small, [], _model(0.001))
    assert all(r.spec_token_ids == [7] * 4 for r in small)  # an extra token is ~3% of a 2-decode step
    large = [_decoding(f"l{i}") for i in range(128)]
    drafter.step(large, [], _model(0.004))  # an extra token costs a decode token: never pays
    assert all(r.spec_token_ids == [] for r in large)


def test_a_request_with_failing_drafts_stops_and_is_probed_again():
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=4), _Fixed())
    req, model = _decoding("a"), _model(0.004)
    lengths = []
    for _ in range(80):
        drafter.step([req], [], model)
        lengths.append(len(req.spec_token_ids))
        if req.spec_token_ids:  # every draft rejected at its first token
            req.num_draft_tokens += len(req.spec_token_ids)
    assert lengths[0] > 0
    first_off = lengths.index(0)
    assert first_off <= 5  # switched off after a few failures
    assert any(lengths[first_off:])  # probed again as the estimate relaxes
    assert sum(1 for n in lengths if n) < 16  # but mostly off
    assert drafter.acceptance_rate("a") < 0.6


def test_disable_by_batch_size_and_finished_requests_are_forgotten():
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=3), _Fixed())
    reqs = [_decoding(f"r{i}") for i in range(3)]
    drafter.step(reqs, [], _model(0.0001))
    assert all(r.spec_token_ids == [] for r in reqs)
    drafter.step(reqs[:2], [reqs[2]], _model(0.0001))
    assert [r.spec_token_ids for r in reqs[:2]] == [[7, 7], [7, 7]]
    assert drafter.acceptance_rate("r2") is None
