"""CPU decode graphs (pagedllm/worker/cpu_graph.py): a decode step's kernel calls recorded once per
batch size and replayed give bitwise the eager engine's tokens and logprobs, for every dense family;
a pass with torch code in its layers is refused and stays eager; the graphs kept are bounded."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.ops import library as fused_ops
from pagedllm import envs
from pagedllm.ops import graph_replay, recording, skinny_gemm
from pagedllm.worker.cpu_graph import CpuDecodeGraphs
from tests.family_utils import family_config, make_hf_model, save_hf_folder

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3"]


@pytest.fixture(scope="module", autouse=True)
def skinny_gemm_on():
    """Graphs need every linear in the engine's own kernel: the float32 skinny GEMM, forced on here
    so the graph path runs on CPUs without AVX-512 too (where it is off by default)."""
    skinny_gemm.set_enabled(True)
    if not skinny_gemm.enabled():
        pytest.skip("the skinny GEMM kernel cannot be built here")
    yield
    skinny_gemm.set_enabled(None)


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory):
    name = request.param
    hf = make_hf_model(family_config(name), seed=FAMILIES.index(name) + 11)
    return save_hf_folder(hf, tmp_path_factory.mktemp(f"graph_{name}"))


def _prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(rng.randint(2, 40))]} for _ in range(n)]


def _run(folder, tokenizer, prompts, params, **kw):
    llm = LLM(model=str(folder), tokenizer=str(tokenizer), max_model_len=128, num_kv_blocks=256, block_size=4,
              dtype="float32", **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = [(o.outputs[0].token_ids, [sorted(lp.items()) for lp in o.outputs[0].logprobs or []]) for o in outs]
    return result, llm


def _greedy_tiny(folder, prompts, params, **kw):
    """(token ids per request, the LLM) of the tiny Llama folder."""
    llm = LLM(model=str(folder), max_model_len=128, num_kv_blocks=64, **kw)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)], llm


def _logprob_values(result):
    return [[[(tok, lp.logprob) for tok, lp in step] for step in lps] for _, lps in result]


def test_replayed_steps_are_bitwise_the_eager_steps(family_dir, smollm2_path):
    """Greedy with top-5 logprobs and seeded sampling, five requests of different lengths (so batch
    sizes shrink as they finish): the same token ids and the same logprob floats with graphs."""
    prompts = _prompts(5, seed=1)
    params = [SamplingParams(temperature=0.0, max_tokens=12 + 3 * i, ignore_eos=True, logprobs=5) for i in range(4)]
    params.append(SamplingParams(temperature=0.9, top_p=0.8, seed=7, max_tokens=20, ignore_eos=True, logprobs=5))
    eager, _ = _run(family_dir, smollm2_path, prompts, params, enforce_eager=True)
    graphed, llm = _run(family_dir, smollm2_path, prompts, params)
    graphs = llm.llm_engine.runner.cpu_graphs
    assert graphs is not None and graphs.num_captured > 0 and graphs.num_replayed > 0, graphs.refused
    if graph_replay.available():
        assert graphs.num_replayed_native == graphs.num_replayed
    assert [t for t, _ in graphed] == [t for t, _ in eager]
    assert _logprob_values(graphed) == _logprob_values(eager)


@pytest.mark.skipif(not graph_replay.available(), reason="the native replay cannot be built here")
@pytest.mark.parametrize("quantization", [None, "int4", "w8a8"])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_replay_is_bitwise_the_python_replay_and_eager(tiny_model_dir, quantization, threads, monkeypatch):
    """One OpenMP region per step (the native replay), one ctypes call per kernel (the Python replay, switched by
    the environment) and no graphs give the same tokens and logprob floats, for every weight format whose decode
    rows are recorded, on one thread and on two."""
    prompts = _prompts(4, seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 4 * i, ignore_eos=True, logprobs=3) for i in range(4)]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        def run(**kw):
            llm = LLM(model=str(tiny_model_dir), max_model_len=128, num_kv_blocks=64, quantization=quantization, **kw)
            outs = llm.generate(prompts, params, use_tqdm=False)
            lps = [[sorted((t, lp.logprob) for t, lp in step.items()) for step in o.outputs[0].logprobs]
                   for o in outs]
            return [o.outputs[0].token_ids for o in outs], lps, llm.llm_engine.runner.cpu_graphs

        eager = run(enforce_eager=True)[:2]
        *native, graphs = run()
        if graphs is None:
            pytest.skip(f"quantization={quantization} records no CPU decode graphs on this CPU")
        assert graphs.num_replayed_native > 0 and graphs.num_replayed_native == graphs.num_replayed
        monkeypatch.setenv(envs.CPU_GRAPH_NATIVE_REPLAY.name, "0")
        *python, python_graphs = run()
        assert python_graphs.num_replayed > 0 and python_graphs.num_replayed_native == 0
    finally:
        torch.set_num_threads(previous)
    assert native == list(eager) and python == list(eager)  # tokens, then logprob floats


def test_a_declined_refresh_replays_from_python(tiny_model_dir, monkeypatch):
    """When a step's attention calls would not be the recorded ones (a refresh hook declines), that step replays
    from Python: the same tokens, no native replay counted."""
    prompts = _prompts(3, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected, _ = _greedy_tiny(tiny_model_dir, prompts, params, enforce_eager=True)
    monkeypatch.setattr(recording.Recording, "refresh", lambda self: False)
    got, llm = _greedy_tiny(tiny_model_dir, prompts, params)
    graphs = llm.llm_engine.runner.cpu_graphs
    assert got == expected and graphs.num_replayed > 0 and graphs.num_replayed_native == 0


def test_bfloat16_steps_replay_bitwise(tiny_model_dir):
    """In bfloat16 the linears run a bfloat16 skinny kernel (AMX, or AVX512-BF16 without it) and the
    graphs replay it: tokens and logprob floats equal to the eager engine's."""
    if not skinny_gemm.enabled(torch.bfloat16):
        pytest.skip("no bfloat16 skinny GEMM kernel on this CPU")
    prompts = _prompts(4, seed=6)
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 4 * i, ignore_eos=True, logprobs=3) for i in range(4)]

    def run(**kw):
        llm = LLM(model=str(tiny_model_dir), max_model_len=128, num_kv_blocks=64, dtype="bfloat16", **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        lps = [[sorted((t, lp.logprob) for t, lp in step.items()) for step in o.outputs[0].logprobs] for o in outs]
        return [o.outputs[0].token_ids for o in outs], lps, llm

    eager_tokens, eager_lps, _ = run(enforce_eager=True)
    tokens, lps, llm = run()
    graphs = llm.llm_engine.runner.cpu_graphs
    assert graphs is not None and graphs.num_replayed > 0, graphs and graphs.refused
    assert tokens == eager_tokens and lps == eager_lps


def test_enforce_eager_turns_graphs_off(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), max_model_len=128, num_kv_blocks=64, enforce_eager=True)
    assert llm.llm_engine.runner.cpu_graphs is None


def test_torch_op_in_the_layers_refuses_the_capture(tiny_model_dir):
    """Without the fused CPU kernels RMSNorm is torch code: capturing would record a pass whose norms
    never run again, so the guard refuses every size and the output is the eager one."""
    prompts = _prompts(3, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected, _ = _greedy_tiny(tiny_model_dir, prompts, params, enforce_eager=True)
    fused_ops.set_enabled(False)
    try:
        got, llm = _greedy_tiny(tiny_model_dir, prompts, params)
    finally:
        fused_ops.set_enabled(None)
    graphs = llm.llm_engine.runner.cpu_graphs
    assert got == expected
    assert graphs.num_captured == 0 and graphs.num_replayed == 0
    assert graphs.refused and all(op.startswith("aten.") for op in graphs.refused.values()), graphs.refused


def test_no_graphs_for_linears_outside_the_skinny_gemm(tiny_model_dir):
    """Projections that run a torch op (here the skinny GEMM switched off: oneDNN / F.linear) would
    refuse every size's capture, so the runner makes no graphs at all; the tokens are the same."""
    prompts = _prompts(2, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected, _ = _greedy_tiny(tiny_model_dir, prompts, params)
    skinny_gemm.set_enabled(False)
    try:
        got, llm = _greedy_tiny(tiny_model_dir, prompts, params)
    finally:
        skinny_gemm.set_enabled(True)
    assert llm.llm_engine.runner.cpu_graphs is None
    assert got == expected


def _edit_and_repack(llm) -> None:
    """Negate and scale every MLP down projection, then pack the linears again (what a weight update
    does): a replay of a graph recorded before would still compute with the old packed copies."""
    model = llm.llm_engine.runner.model
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(-3.0)
    model.pack_linears_for_cpu()


def test_repacking_the_linears_drops_the_graphs(tiny_model_dir):
    """After graphs were recorded, the weights are edited and packed again: the old graphs are dropped,
    so the steps compute with the new weights (the tokens are an eager engine's with the same edit)
    and are recorded again; packed again without the skinny GEMM, the steps stay eager."""
    prompts = _prompts(3, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    reference = LLM(model=str(tiny_model_dir), max_model_len=128, num_kv_blocks=64, enforce_eager=True)
    before = [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    _edit_and_repack(reference)
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    assert expected != before  # the edit changes the tokens: a stale replay would show
    got, llm = _greedy_tiny(tiny_model_dir, prompts, params)
    graphs = llm.llm_engine.runner.cpu_graphs
    assert got == before and graphs.num_captured > 0
    captured = graphs.num_captured
    _edit_and_repack(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert graphs.num_captured > captured
    skinny_gemm.set_enabled(False)
    try:
        llm.llm_engine.runner.model.pack_linears_for_cpu()
        replayed = graphs.num_replayed
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    finally:
        skinny_gemm.set_enabled(True)
    assert graphs.num_replayed == replayed and not graphs.graphs


def test_graphs_kept_are_bounded_least_recently_used_first(tiny_model_dir):
    """Eight requests finishing one after another give eight batch sizes; with room for two graphs,
    at most two are kept at any time, the newest ones, and the tokens stay the eager ones."""
    prompts = _prompts(8, seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 4 * i, ignore_eos=True) for i in range(8)]
    reference = LLM(model=str(tiny_model_dir), max_model_len=128, num_kv_blocks=128, enforce_eager=True)
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    llm = LLM(model=str(tiny_model_dir), max_model_len=128, num_kv_blocks=128)
    graphs = llm.llm_engine.runner.cpu_graphs
    graphs.max_graphs = 2
    sizes_seen = []
    run = graphs.run

    def watched(input_ids, positions):
        out = run(input_ids, positions)
        assert len(graphs.graphs) <= 2
        sizes_seen.append(int(input_ids.shape[0]))
        return out

    graphs.run = watched
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert graphs.num_captured >= 6, (graphs.num_captured, sizes_seen)
    threads = torch.get_num_threads()
    assert list(graphs.graphs) == [(2, threads), (1, threads)]  # the last two sizes, oldest first


def test_size_is_captured_on_its_second_step_and_replayed_after():
    """One token per step through a stand-in model: step 1 eager, step 2 captured, steps 3+ replayed;
    a step with another size in between resets the count."""
    calls = []

    class Layers(torch.nn.Module):
        def forward_layers(self, hidden, cos_sin):
            out = torch.empty_like(hidden)

            def kernel():  # stands for a C kernel: computes into `out`, no torch op the guard sees
                calls.append("kernel")
                rec = recording.current()
                with rec.allowed() if rec is not None else contextlib.nullcontext():
                    torch.mul(hidden, 2, out=out)

            recording.call(kernel)
            return out

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Layers()
            self.model.embed_tokens = lambda ids: ids.float().unsqueeze(1)

        def rope_rows(self, positions):
            return {"default": positions.float().unsqueeze(1)}

    assert not CpuDecodeGraphs.supports(Model())  # no skinny-GEMM linears: the runner would not make graphs
    graphs = CpuDecodeGraphs(Model())
    ids = torch.tensor([3, 4])
    outs = [graphs.run(ids + i, ids) for i in range(4)]
    assert [o.tolist() for o in outs] == [[[6.0], [8.0]], [[8.0], [10.0]], [[10.0], [12.0]], [[12.0], [14.0]]]
    assert (graphs.num_captured, graphs.num_replayed) == (1, 2) and len(calls) == 4
    graphs.run(torch.tensor([5]), torch.tensor([0]))  # another size: eager, counted as its first step
    assert (graphs.num_captured, graphs.num_replayed) == (1, 2)
    assert graphs.run(ids, ids).tolist() == [[6.0], [8.0]] and graphs.num_replayed == 3
    graphs.clear()
    assert not graphs.graphs and graphs.run(ids, ids).tolist() == [[6.0], [8.0]] and graphs.num_replayed == 3


def test_max_graphs_must_be_positive():
    with pytest.raises(ValueError, match="max_graphs"):
        CpuDecodeGraphs(torch.nn.Module(), max_graphs=0)


def test_profiled_steps_run_eagerly():
    """Under torch's profiler every op should show, so no replay."""
    meta = type("Meta", (), {"num_decodes": 2, "num_reqs": 2})()
    assert CpuDecodeGraphs.can_run([meta])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert not CpuDecodeGraphs.can_run([meta])
    mixed = type("Meta", (), {"num_decodes": 1, "num_reqs": 2})()
    assert not CpuDecodeGraphs.can_run([mixed]) and not CpuDecodeGraphs.can_run([])


def test_pool_reuses_a_block_once_its_tensor_is_dropped():
    """The capture's allocations: a freed block serves the next request of its size (so layers share
    memory as eager ones do), a live one never; blocks are 64-byte aligned and stay owned."""
    from pagedllm.worker.cpu_graph import _ArenaPool

    pool = _ArenaPool()
    a = pool.empty([4, 8], torch.float32)
    b = pool.empty([4, 8], torch.float32)
    assert a.data_ptr() != b.data_ptr() and a.data_ptr() % 64 == 0 and b.data_ptr() % 64 == 0
    view = a[:, :4]  # a view keeps the block in use
    ptr_a = a.data_ptr()
    del a
    c = pool.empty([32], torch.float32)
    assert c.data_ptr() not in (ptr_a, b.data_ptr())
    del view
    d = pool.empty([2, 16], torch.float32)  # same bytes, another shape and
    assert d.data_ptr() == ptr_a
    e = pool.empty([3, 5], torch.bfloat16)
    assert e.shape == (3, 5) and e.dtype == torch.bfloat16 and e.data_ptr() not in (ptr_a, b.data_ptr(), c.data_ptr())
    assert len(pool.blocks) == 4 and pool.empty([0, 8], torch.float32) is None


def test_graph_memory_does_not_grow_with_the_layers(tmp_path, smollm2_tokenizer):
    """Six layers keep as much pool memory as two: each layer reuses the blocks the one before freed."""
    from tests.conftest import build_tiny_llama_dir

    nbytes = {}
    for layers in (2, 6):
        folder = build_tiny_llama_dir(tmp_path / f"l{layers}", smollm2_tokenizer, num_hidden_layers=layers)
        llm = LLM(model=str(folder), max_model_len=128, num_kv_blocks=64)
        llm.generate(_prompts(4, seed=5), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                     use_tqdm=False)
        (graph,) = llm.llm_engine.runner.cpu_graphs.graphs.values()
        nbytes[layers] = graph.pool.nbytes
    assert 0 < nbytes[6] == nbytes[2], nbytes
