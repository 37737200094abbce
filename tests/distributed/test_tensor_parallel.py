"""Tensor parallelism on CPU: two gloo ranks (the engine process and one worker) give the
same greedy tokens and close logprobs as one rank, on tiny random Llama folders whose KV
heads split across the ranks, whose KV heads are fewer than the ranks (replicated), and
whose vocabulary the ranks do not divide — with worker processes (``mp``) and with Ray
actors in a local Ray cluster (``ray``). A failure on any rank (a killed worker, an exception
on a worker or on rank 0 before a collective) fails the engine with a clear error naming the
rank, well within ``worker_timeout_s`` (the failing rank leaves the group, so its peers'
collectives fail at once), and frees every block."""

from __future__ import annotations

import importlib.util
import math
import os
import signal

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.errors import TensorParallelWorkerError
from tests.family_utils import family_config, make_hf_model, save_hf_folder
from tests.model_utils import write_random_llama_folder

HAS_RAY = importlib.util.find_spec("ray") is not None
needs_ray = pytest.mark.skipif(not HAS_RAY, reason="Ray is not installed (pip install 'pagedllm[ray]'; "
                                                   "make venv installs it)")
BACKENDS = ["mp", pytest.param("ray", marks=[needs_ray, pytest.mark.slow])]

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=256, rms_norm_eps=1e-6)
PROMPTS = [[1, 17, 230, 45, 99, 3, 8], [1, 400, 12, 12, 88], [1] + list(range(50, 90)), [1, 5]]
ENGINE = dict(dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=4, max_num_seqs=8,
              max_num_batched_tokens=32, worker_timeout_s=60)


@pytest.fixture(scope="module")
def ray_cluster():
    """A one-machine Ray cluster for this module's Ray tests (2 CPUs: one bundle per rank)."""
    import ray

    # the actors unpickle this module's functions (collective_rpc) by name: give them its folder
    here = os.path.dirname(os.path.abspath(__file__))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([here, os.path.dirname(here), os.path.dirname(os.path.dirname(here))])}})
    yield ray
    ray.shutdown()


@pytest.fixture
def backend(request):
    """The executor backend under test; ``ray`` starts the module's Ray cluster first."""
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return request.param


def _pid(runner) -> int:
    return os.getpid()


def _fail_forward_on(runner, rank: int) -> None:
    """Make rank ``rank``'s first MLP raise (before the down projection's all-reduce)."""
    from pagedllm.distributed import get_tensor_parallel_rank

    if get_tensor_parallel_rank() == rank:
        def fail(*args, **kwargs):
            raise RuntimeError(f"injected fault on rank {rank}")
        runner.model.model.layers[0].mlp.forward = fail


def _greedy(folder, tp: int, on_engine=None, **engine):
    """(tokens, chosen-token logprobs) of PROMPTS, greedy; ``on_engine(llm)`` runs after loading."""
    llm = LLM(str(folder), tensor_parallel_size=tp, **{**ENGINE, **engine})
    try:
        if on_engine is not None:
            on_engine(llm)
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


def _expert_shapes(runner) -> list:
    """(gate_up_proj, down_proj) shapes of every MoE block this rank holds."""
    return [(tuple(m.gate_up_proj.shape), tuple(m.down_proj.shape)) for m in runner.model.modules()
            if type(m).__name__ == "MoEExperts"]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_experts_sharded_tp2_equals_tp1(tmp_path, smollm2_path, family):
    """Every expert's width splits over the ranks (each holds half of every expert); tokens as TP=1."""
    config = family_config(family)
    folder = save_hf_folder(make_hf_model(config, seed=5), tmp_path / family)
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    tokens1, logprobs1 = _greedy(folder, 1, tokenizer=str(smollm2_path))
    shapes = []
    tokens2, logprobs2 = _greedy(folder, 2, tokenizer=str(smollm2_path),
                                 on_engine=lambda llm: shapes.extend(llm.collective_rpc(_expert_shapes)))
    half = ((experts, width, config.hidden_size), (experts, config.hidden_size, width // 2))
    assert shapes and all(rank_shapes and set(rank_shapes) == {half} for rank_shapes in shapes), shapes
    assert tokens2 == tokens1
    for a, b in zip(logprobs1, logprobs2):
        assert all(math.isclose(x, y, abs_tol=1e-4) for x, y in zip(a, b)), (a, b)


def _quantized_layers(runner) -> dict:
    """Module path -> its dequantized weight, of every quantized projection of layer 0 on this rank."""
    return {name: m.quant_method.dequantize(m) for name, m in runner.model.named_modules()
            if getattr(m, "quant_method", None) is not None and ".layers.0." in name}


@pytest.mark.parametrize("quantization", ["int8", "w8a8", "int4"])
def test_quantized_linears_tp2_equal_tp1(tmp_path, quantization):
    """int8 and w8a8 (per-channel scales: a row-parallel shard takes the whole row's maximum over the ranks; w8a8's
    activation groups of 64: o_proj's shard of 32 features cuts a group in two, so its scale is the maximum over the
    ranks, down_proj's shard of 64 holds whole groups and runs the C kernel) and int4 (groups of 32 input features, each inside one rank's shard) quantize every weight
    as one rank does: the row-parallel shards' values are TP=1's halves, and the tokens match (int4's int8
    activation blocks of 32, where repacked, lie inside a shard too)."""
    folder = write_random_llama_folder(tmp_path / "m", num_key_value_heads=2, vocab_size=509,
                                       **{**SHAPE, "intermediate_size": 128})
    engine = dict(quantization=quantization, quantization_group_size=32)
    layers = []
    tokens1, logprobs1 = _greedy(folder, 1, **engine, on_engine=lambda llm: layers.extend(llm.collective_rpc(_quantized_layers)))
    tokens2, logprobs2 = _greedy(folder, 2, **engine, on_engine=lambda llm: layers.extend(llm.collective_rpc(_quantized_layers)))
    one, rank0, rank1 = layers
    for name in ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"):  # row-parallel
        w, w0, w1 = one[name], rank0[name], rank1[name]
        assert w0.shape == w1.shape == (w.shape[0], w.shape[1] // 2)
        assert torch.equal(torch.cat([w0, w1], dim=1), w)
    assert tokens2 == tokens1
    for a, b in zip(logprobs1, logprobs2):
        assert all(math.isclose(x, y, abs_tol=1e-4) for x, y in zip(a, b)), (a, b)


@pytest.mark.parametrize("checkpoint", ["gptq-4bit-g32", pytest.param("compressed-tensors-w8a8",
                                                                      marks=pytest.mark.slow)])
def test_prequantized_checkpoint_tp2_equals_tp1(tmp_path, checkpoint):
    """A pre-quantized checkpoint's tensors are sharded as stored: column-parallel by rows, row-parallel
    by groups of columns (int4) or whole per-channel scales (int8) on every rank."""
    pytest.importorskip("compressed_tensors")
    from tests.quantization.checkpoint_writers import write_compressed_tensors_folder, write_packed_folder

    src = write_random_llama_folder(tmp_path / "m", num_key_value_heads=2, vocab_size=509,
                                    **{**SHAPE, "intermediate_size": 128})
    if checkpoint.startswith("gptq"):
        folder, _ = write_packed_folder(src, tmp_path / "q", "gptq", 32, symmetric=False)
    else:
        folder = write_compressed_tensors_folder(src, tmp_path / "q", "W8A8")
    tokens1, logprobs1 = _greedy(folder, 1)
    tokens2, logprobs2 = _greedy(folder, 2)
    assert tokens2 == tokens1
    for a, b in zip(logprobs1, logprobs2):
        assert all(math.isclose(x, y, abs_tol=1e-4) for x, y in zip(a, b)), (a, b)


@pytest.mark.slow
@needs_ray
def test_ray_tp2_equals_tp1(tmp_path, ray_cluster):
    folder = write_random_llama_folder(tmp_path / "m", num_key_value_heads=2, vocab_size=509, **SHAPE)
    tokens1, logprobs1 = _greedy(folder, 1)
    tokens2, logprobs2 = _greedy(folder, 2, distributed_executor_backend="ray")
    assert tokens2 == tokens1
    for a, b in zip(logprobs1, logprobs2):
        assert all(math.isclose(x, y, abs_tol=1e-4) for x, y in zip(a, b)), (a, b)


def _engine_mid_generation(folder, backend):
    """A TP=2 engine that has served a request and has one running (prefilled) when the fault comes."""
    llm = LLM(str(folder), tensor_parallel_size=2, **{**ENGINE, "worker_timeout_s": 120},
              distributed_executor_backend=backend)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([{"prompt_token_ids": [1, 5, 9]}], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
    engine.add_request("r", [1, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.step()
    return llm, engine


def _assert_failed_and_freed(engine, match: str) -> None:
    """The next steps raise TensorParallelWorkerError matching ``match`` and naming the cause,
    not a timeout (the failing rank's connections close, so nobody waits for worker_timeout_s);
    every request is gone, every block free, and the engine stays failed."""
    with pytest.raises(TensorParallelWorkerError, match=match) as failure:
        for _ in range(100):
            engine.step()
    assert "did not answer" not in str(failure.value) and "Timed out" not in str(failure.value)
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().num_used_blocks == 0
    with pytest.raises(TensorParallelWorkerError):
        engine.step()


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_killed_worker_fails_the_engine_with_a_clear_error(tmp_path, backend):
    folder = write_random_llama_folder(tmp_path / "m", num_key_value_heads=2, vocab_size=128, **SHAPE)
    llm, engine = _engine_mid_generation(folder, backend)
    try:
        driver_pid, worker_pid = llm.collective_rpc(_pid)
        assert driver_pid == os.getpid() != worker_pid
        os.kill(worker_pid, signal.SIGKILL)
        died = r" \(killed by signal 9\)" if backend == "mp" else ": "
        _assert_failed_and_freed(engine, rf"worker rank 1 \(.*pid {worker_pid}\) died{died}")
    finally:
        engine.shutdown()


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("rank", [1, 0], ids=["worker-rank", "engine-rank"])
def test_exception_on_any_rank_fails_the_engine_at_once(tmp_path, backend, rank):
    folder = write_random_llama_folder(tmp_path / "m", num_key_value_heads=2, vocab_size=128, **SHAPE)
    llm, engine = _engine_mid_generation(folder, backend)
    try:
        llm.collective_rpc(_fail_forward_on, (rank,))
        where = r"worker rank 1 \(.*\) failed: .*" if rank == 1 else r"rank 0 \(the engine process\) failed in execute_model: "
        _assert_failed_and_freed(engine, rf"(?s){where}RuntimeError: injected fault on rank {rank}")
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


def test_distributed_executor_backend_checked(monkeypatch):
    from pagedllm.config import EngineConfig

    with pytest.raises(ValueError, match="distributed_executor_backend must be one of mp, ray"):
        EngineConfig(distributed_executor_backend="slurm")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match=r"distributed_executor_backend='ray' needs Ray.*pip install 'pagedllm\[ray\]'"):
        EngineConfig(distributed_executor_backend="ray", tensor_parallel_size=2)
