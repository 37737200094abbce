"""compilation_config: the model compiled with torch.compile around the opaque paged-attention op.

Reference: the same engine run eagerly on the same weights. Compiled outputs must give the
same greedy tokens and logprobs within float32 rounding on every kind of step (prefill,
decode, mixed batches, chunked prefill, a prefix-cache hit), and no step may compile a new
graph after start-up.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention.backend import set_forward_context
from pagedllm.config import CompilationConfig, EngineConfig


# -- configuration -----------------------------------------------------------------------------

@pytest.mark.parametrize("value, mode", [(None, 0), (0, 0), (3, 3), ("3", 3), ('{"mode": 3}', 3),
                                         ({"mode": 3, "dynamic": False, "compile_sizes": [4, 1]}, 3)])
def test_accepted_forms(value, mode):
    assert EngineConfig(compilation_config=value).compilation.mode == mode


def test_enforce_eager_wins_and_freezing_is_the_default():
    assert EngineConfig(compilation_config=3, enforce_eager=True).compilation.mode == 0
    parsed = CompilationConfig.parse({"mode": 3, "inductor_compile_config": {"cpp_wrapper": True}})
    assert parsed.inductor_compile_config == {"freezing": True, "cpp_wrapper": True}
    assert CompilationConfig.parse({"mode": 3, "compile_sizes": [8, 2, 8]}).compile_sizes == (2, 8)


@pytest.mark.parametrize("value, field", [
    (2, "compilation_config.mode"), ({"mode": True}, "compilation_config.mode"), (True, "compilation_config must"),
    ("{", "compilation_config must"),
    ({"mode": 3, "level": 3}, "unknown keys ['level']"), ({"mode": 3, "backend": "tvm"}, "compilation_config.backend"),
    ({"mode": 3, "dynamic": "yes"}, "compilation_config.dynamic"),
    ({"mode": 3, "compile_sizes": [0]}, "compilation_config.compile_sizes"),
    ({"mode": 3, "dynamic": False}, "compilation_config.compile_sizes"),
    ({"mode": 3, "inductor_compile_config": []}, "compilation_config.inductor_compile_config"),
    ([3], "compilation_config")])
def test_bad_values_name_the_field(value, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        EngineConfig(compilation_config=value)


def test_unknown_inductor_option_names_the_field(random_model_dir):
    with pytest.raises(ValueError, match="inductor_compile_config has unknown inductor options"):
        LLM(model=str(random_model_dir), device="cpu", max_model_len=64, num_kv_blocks=8,
            compilation_config={"mode": 3, "inductor_compile_config": {"no_such_option": 1}})


def test_enforce_eager_engine_compiles_nothing(random_model_dir):
    llm = LLM(model=str(random_model_dir), device="cpu", max_model_len=64, num_kv_blocks=8, compilation_config=3,
              enforce_eager=True)
    runner = llm.llm_engine.runner
    assert runner.compiled_model is None
    assert all(a.compiled_op_name is None for a in runner.model.modules() if hasattr(a, "compiled_op_name"))


# -- outputs against eager ----------------------------------------------------------------------

def _prompts():
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 41, 12, 70, 2)]
    prompts.append(prompts[3][:48] + [11, 12, 13])  # shares 3 blocks with prompt 3: a prefix-cache hit
    return [{"prompt_token_ids": p} for p in prompts]


def _generate(model_dir, **options):
    # a budget of 32 tokens: the 41- and 70-token prompts prefill in chunks, alongside decodes
    llm = LLM(model=str(model_dir), device="cpu", max_model_len=256, num_kv_blocks=64, max_num_seqs=8, block_size=16,
              max_num_batched_tokens=32, **options)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    outputs = llm.generate(_prompts()[:5], params, use_tqdm=False)
    outputs += llm.generate(_prompts()[5:], params, use_tqdm=False)  # after prompt 3 is cached
    return llm, outputs


@pytest.fixture(scope="module")
def eager_outputs(random_model_dir):
    return _generate(random_model_dir)[1]


def _assert_close_to_eager(outputs, reference, atol):
    for out, ref in zip(outputs, reference):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for lp, ref_lp in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
            for tok in ref_lp.keys() & lp.keys():
                assert abs(lp[tok].logprob - ref_lp[tok].logprob) < atol


def _graph_count() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _check_no_recompiles(llm, graphs_after_warmup, expected_warm_sizes):
    compiled = llm.llm_engine.runner.compiled_model
    assert compiled is not None and compiled.is_warm
    assert compiled.warmup_sizes == expected_warm_sizes
    assert compiled.num_eager_fallbacks == 0
    assert _graph_count() == graphs_after_warmup  # steps of 1..32 tokens compiled nothing new


def _generate_compiled(model_dir, compilation_config):
    """(llm, outputs, dynamo's graph count right after the start-up warm-up)."""
    from pagedllm.compilation.compiled_model import CompiledModel

    counts = {}
    warm_up = CompiledModel.warm_up

    def spy(self, *args):
        seconds = warm_up(self, *args)
        counts["after_warmup"] = _graph_count()
        return seconds

    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CompiledModel, "warm_up", spy)
        llm, outputs = _generate(model_dir, compilation_config=compilation_config)
    return llm, outputs, counts["after_warmup"]


@pytest.fixture(scope="module")
def traced_run(random_model_dir):  # tests using it are slow-marked: ~20 s of engine builds, an opt-in feature
    """The opaque attention op and the warm-up, traced without code generation (fast)."""
    return _generate_compiled(random_model_dir, {"mode": 3, "backend": "eager"})


@pytest.mark.slow
def test_traced_graph_equals_eager(traced_run, eager_outputs):
    llm, outputs, graphs_after_warmup = traced_run
    _assert_close_to_eager(outputs, eager_outputs, atol=5e-5)  # plain F.linear vs the eager run's prepacked oneDNN weights
    _check_no_recompiles(llm, graphs_after_warmup, (1, 64))
    assert llm.llm_engine.get_stats().num_used_blocks == 0


@pytest.mark.slow
def test_step_fitting_no_graph_runs_eagerly(traced_run):
    """A call no compiled graph's guards accept (here: tensors made outside inference mode)
    runs the eager model and is counted; it compiles nothing."""
    llm, _, _ = traced_run
    runner = llm.llm_engine.runner
    compiled, graphs = runner.compiled_model, _graph_count()
    ids, positions = torch.tensor([5, 9, 17]), torch.arange(3)
    with set_forward_context(None):  # one causal sequence, no KV cache
        out = compiled(ids, positions)
        expected = runner.model(ids, positions)
    assert compiled.num_eager_fallbacks == 1 and _graph_count() == graphs
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    compiled.num_eager_fallbacks = 0


@pytest.mark.slow
def test_inductor_compiled_equals_eager(random_model_dir, eager_outputs):
    """inductor with freezing (the real path): same greedy tokens, logprobs within float32
    rounding of fused kernels; no new graph after start-up."""
    llm, outputs, graphs_after_warmup = _generate_compiled(random_model_dir, 3)
    _assert_close_to_eager(outputs, eager_outputs, atol=1e-4)
    _check_no_recompiles(llm, graphs_after_warmup, (1, 64))


@pytest.mark.slow
def test_static_sizes_run_other_sizes_eagerly(random_model_dir, eager_outputs):
    """dynamic=False: only the compile_sizes are compiled; every other step size runs eagerly."""
    torch._dynamo.reset()
    llm, outputs = _generate(random_model_dir, compilation_config={"mode": 3, "backend": "eager", "dynamic": False,
                                                                   "compile_sizes": [1, 5]})
    _assert_close_to_eager(outputs, eager_outputs, atol=5e-5)  # plain F.linear vs the eager run's prepacked oneDNN weights
    compiled = llm.llm_engine.runner.compiled_model
    assert compiled.runs_compiled(5) and not compiled.runs_compiled(6)
    assert compiled.num_eager_fallbacks == 0
