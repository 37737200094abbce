"""`pagedllm plan` and pagedllm.sizing: the planner equals the engine's start-up sizing on
the same inputs, the seeds' 13B / 24 GB example by hand, bad input exits with code 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import pagedllm
from pagedllm import sizing
from pagedllm.entrypoints.cli import main
from pagedllm.models.layers.linear import packed_copy_bytes
from pagedllm.planner import MODEL_SHAPES, plan
from pagedllm.sizing import kv_bytes_per_token, kv_dtype_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

GiB = 1024**3
LLAMA2_13B_PARAMS = 13_015_864_320  # Hugging Face's count for meta-llama/Llama-2-13b-hf


# ---- the seeds' example, by hand ------------------------------------------------------------

def test_llama2_13b_shape_arithmetic():
    shape = MODEL_SHAPES["llama-2-13b"]
    # embeddings + lm_head 2 x 32000 x 5120; per layer q,k,v,o 4 x 5120^2 + MLP 3 x 5120 x 13824; 81 norms
    assert shape.param_count() == 2 * 32000 * 5120 + 40 * (4 * 5120**2 + 3 * 5120 * 13824) + 81 * 5120
    assert shape.param_count() == LLAMA2_13B_PARAMS
    # K and V x 40 layers x 40 heads x 128 x 2 bytes = 800 KiB per token (vLLM paper, §3)
    assert sizing.kv_bytes_per_token(shape, 2) == 819_200 == 800 * 1024


def test_seeds_example_fp16_does_not_fit_24gb():
    """13B in fp16 on a 24 GB GPU: 26.0 GB of weights alone exceed 0.9 x 24 GiB."""
    p = plan("llama-2-13b", gpu="24gb", dtype="float16")
    assert p.weight_bytes == 2 * LLAMA2_13B_PARAMS
    assert not p.fits and "do not fit" in p.problems[0]
    assert "--quantization int8" in p.suggested_flags and "--gpu a100-40" in p.suggested_flags


def test_seeds_example_int8_on_24gb_batch_4_at_full_context_does_not_fit():
    """8-bit weights leave ~9 GB of KV: a contiguous allocator reserving 4,096 tokens per
    user holds 2 users (so the 4th user OOMs); paged blocks hold 5 at 2,048 tokens, 22 at 512."""
    p = plan("llama-2-13b", gpu="24gb", dtype="float16", quantization="int8", context_lens=[512, 1024, 2048, 4096])
    linear = 40 * (4 * 5120**2 + 3 * 5120 * 13824)
    weights = (LLAMA2_13B_PARAMS - linear) * 2 + linear  # embeddings and norms stay fp16
    # 2,048-token profiling step: 2048 x max(2*5120 + 3*13824, 2*5120 + 160*128) x 2 B, + 128 rows of fp32 logits
    activations = 2048 * (2 * 5120 + 3 * 13824) * 2 + 128 * 32000 * 4
    budget = int(24 * GiB * 0.9) - weights - activations
    assert (p.weight_bytes, p.activation_bytes, p.kv_budget_bytes) == (weights, activations, budget)
    assert p.num_blocks == budget // (16 * 819_200) == 733
    assert p.max_model_len == 4096 and p.fits
    rows = {r.context_len: r for r in p.rows}
    assert [rows[c].max_seqs for c in (512, 1024, 2048, 4096)] == [22, 11, 5, 2]
    assert {r.contiguous_max_seqs for r in p.rows} == {budget // (4096 * 819_200)} == {2}


def test_seeds_kv_geometry_matches_memory_waste_benchmark():
    """benchmarks/memory_waste.py's seeds scenario uses the same K/V geometry as the planner."""
    import memory_waste

    scen = memory_waste.seeds_scenarios()[0]
    assert scen.kv_bytes_per_token == sizing.kv_bytes_per_token(MODEL_SHAPES["llama-2-13b"], 2)


def test_named_shapes_known_figures():
    assert sizing.kv_bytes_per_token(MODEL_SHAPES["llama-3-8b"], 2) == 128 * 1024  # GQA 8 KV heads
    assert round(MODEL_SHAPES["llama-3-8b"].param_count() / 1e9, 2) == 8.03
    assert round(MODEL_SHAPES["qwen2.5-7b"].param_count() / 1e9, 2) == 7.62
    p = plan("llama-2-70b", gpu="a100-80", tensor_parallel_size=4)
    assert p.kv_bytes_per_token == 2 * 80 * 2 * 128 * 2  # 8 KV heads / 4 ranks = 2 per rank
    assert p.weight_bytes == -(-MODEL_SHAPES["llama-2-70b"].param_count() * 2 // 4)


def test_sliding_window_layers_hold_only_their_window():
    """4 layers alternating sliding (window 32) / full: two KV-cache groups of 2 layers; a
    sequence of L tokens holds ceil(L/16) full-group blocks + at most ceil((32-1+chunk)/16)+1
    sliding-group blocks; the contiguous reservation keeps the window in sliding layers."""
    cfg = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, vocab_size=100, max_position_embeddings=512, sliding_window=32,
               layer_types=["sliding_attention", "full_attention"] * 2)
    shape = sizing.ModelShape.from_hf_config(cfg, "hybrid")
    assert shape.layer_windows == (32, None, 32, None)
    groups = sizing.kv_cache_groups_for(shape)
    assert [(g.layer_ids, g.sliding_window) for g in groups] == [((1, 3), None), ((0, 2), 32)]
    per_block = sizing.kv_bytes_per_block(shape, 16, 4, sizing.layers_per_block(groups))
    assert per_block == 2 * 2 * 16 * 2 * 16 * 4  # K,V x 2 layers x 16 tokens x 2 heads x 16 x 4 B
    spec = sizing.KVCacheSpec(100, 16, per_block, 512, tuple(groups), max_chunk_tokens=64)
    assert spec.blocks_per_seq_at(512) == 32 + (-(-(31 + 64) // 16) + 1)  # 32 full + 7 sliding
    assert spec.max_concurrency_at(512) == 99 / 39  # block 0 is the null block
    assert sizing.contiguous_bytes_per_sequence(shape, 512, 4) == (512 + 32) * 2 * 2 * 2 * 16 * 4
    full = sizing.kv_cache_groups_for(shape, hybrid=False)
    assert [(g.layer_ids, g.sliding_window) for g in full] == [((0, 1, 2, 3), None)]


# ---- planner == engine start-up --------------------------------------------------------------

@pytest.fixture(scope="module")
def gqa_model_dir(tmp_path_factory, smollm2_tokenizer):
    from conftest import build_tiny_llama_dir

    return build_tiny_llama_dir(tmp_path_factory.mktemp("tiny_gqa"), smollm2_tokenizer, num_hidden_layers=3,
                                num_attention_heads=8, num_key_value_heads=1, hidden_size=128,
                                tie_word_embeddings=False, max_position_embeddings=512)


def _host_packs(dtype: str) -> bool:
    """Whether this host's CPU loader packs a weight of ``dtype`` at all: bfloat16 has neither a
    skinny kernel nor oneDNN's copy on an AVX2-only CPU."""
    from pagedllm.models.layers import linear

    plan = linear.cpu_packing(getattr(torch, dtype), 64)
    return plan.skinny or plan.onednn


def _engine_and_plan(model_dir: Path, **options):
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.config import EngineConfig

    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", **options))
    return engine, plan(str(model_dir), device="cpu", **options)


@pytest.mark.parametrize("which,options", [
    ("tiny", dict(dtype="float32", block_size=16, kv_cache_memory="4MiB", max_model_len=512)),
    ("tiny", dict(dtype="bfloat16", block_size=32, kv_cache_memory="3MB", max_model_len=256)),
    ("gqa", dict(dtype="float32", block_size=8, num_kv_blocks=50, max_model_len=128, max_num_seqs=4)),
    # quantized KV: int8's per token-and-head float32 scales are part of every block
    ("tiny", dict(dtype="float32", block_size=16, kv_cache_memory="4MiB", max_model_len=512, kv_cache_dtype="int8")),
    ("gqa", dict(dtype="float32", block_size=8, kv_cache_memory="1MiB", max_model_len=128, kv_cache_dtype="fp8")),
])
def test_plan_equals_engine_startup(which, options, tiny_model_dir, gqa_model_dir):
    engine, p = _engine_and_plan(tiny_model_dir if which == "tiny" else gqa_model_dir, **options)
    spec = engine.kv_cache_spec
    assert (p.num_blocks, p.num_tokens, p.bytes_per_block) == (spec.num_blocks, spec.num_tokens, spec.bytes_per_block)
    assert p.max_concurrency == spec.max_concurrency
    assert p.kv_cache_spec().describe() == spec.describe()  # the start-up log line, word for word
    assert p.weight_bytes == engine.runner.weight_bytes()  # exact parameter count from the file headers
    assert p.packed_weight_bytes == packed_copy_bytes(engine.runner.model)  # the start-up line's "+ N packed"
    assert (p.packed_weight_bytes > 0) == _host_packs(options["dtype"])
    assert p.fits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("skinny", [True, False])
@pytest.mark.parametrize("onednn_rows", [True, False])
def test_plan_counts_the_packed_copies_the_loader_makes(dtype, skinny, onednn_rows, gqa_model_dir, monkeypatch):
    """Every packing rule of this host's CPU loader (the skinny GEMM on or off, float32 prefill rows on
    oneDNN's copy or not) gives the plan the bytes the loaded model holds next to its parameters; with
    PAGEDLLM_CPU_PACKED_LINEAR=0 both are 0."""
    from pagedllm.models.layers import linear
    from pagedllm.ops import skinny_gemm

    monkeypatch.setattr(linear, "fp32_rows_use_onednn", lambda: onednn_rows)
    skinny_gemm.set_enabled(skinny)
    try:
        options = dict(dtype=dtype, num_kv_blocks=8, max_model_len=128)
        engine, p = _engine_and_plan(gqa_model_dir, **options)
        assert p.packed_weight_bytes == packed_copy_bytes(engine.runner.model)
        assert (p.packed_weight_bytes > 0) == _host_packs(dtype)
        monkeypatch.setenv("PAGEDLLM_CPU_PACKED_LINEAR", "0")
        engine, p = _engine_and_plan(gqa_model_dir, **options)
        assert p.packed_weight_bytes == packed_copy_bytes(engine.runner.model) == 0
    finally:
        skinny_gemm.set_enabled(None)


def test_kv_bytes_per_token_by_kv_dtype():
    """Per token: 2 x layers x KV heads x (head_dim x element bytes + scale bytes); int8 adds a
    float32 scale per token and head, fp8's per-tensor scales add nothing per token."""
    shape = MODEL_SHAPES["llama-3-8b"]  # 32 layers, 8 KV heads, head_dim 128
    per_token = {name: kv_bytes_per_token(shape, kv_dtype_bytes(name)[0], 1, kv_dtype_bytes(name)[1])
                 for name in ("bfloat16", "fp8", "int8")}
    assert per_token == {"bfloat16": 2 * 32 * 8 * 256, "fp8": 2 * 32 * 8 * 128, "int8": 2 * 32 * 8 * 132}
    assert plan("llama-3-8b", gpu="a100-80", kv_cache_dtype="int8").kv_bytes_per_token == per_token["int8"]
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_dtype_bytes("int4")


def test_plan_reports_what_the_engine_rejects(tiny_model_dir):
    """A pool too small for one max_model_len sequence: the engine raises, the plan says no with the same words."""
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.config import EngineConfig

    options = dict(dtype="float32", block_size=16, kv_cache_memory="64KiB", max_model_len=1024)
    with pytest.raises(ValueError) as e:
        LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", **options))
    p = plan(str(tiny_model_dir), device="cpu", **options)
    assert not p.fits and p.problems == [str(e.value)]
    largest = p.num_blocks * 16
    assert f"--max-model-len {largest}" in p.suggested_flags
    assert plan(str(tiny_model_dir), device="cpu", **{**options, "max_model_len": largest}).fits


@pytest.mark.slow
def test_plan_equals_engine_startup_smollm2(smollm2_path):
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.config import EngineConfig

    engine = LLMEngine(EngineConfig(model=str(smollm2_path), device="cpu", max_model_len=2048))
    p = pagedllm.plan(str(smollm2_path), device="cpu", max_model_len=2048)
    assert p.kv_cache_spec().describe() == engine.kv_cache_spec.describe()
    assert p.weight_bytes == engine.runner.weight_bytes()
    assert p.packed_weight_bytes == packed_copy_bytes(engine.runner.model)


# ---- the command line -------------------------------------------------------------------------

def test_cli_json_fits(capsys):
    assert main(["plan", "-m", "llama-3-8b", "--gpu", "a100-80", "--json", "--context-len", "1024"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is True and out["kv_bytes_per_token"] == 131072
    assert [r["context_len"] for r in out["rows"]] == [1024]
    assert out["rows"][0]["max_seqs"] == out["num_blocks"] // 64


def test_cli_does_not_fit_exits_2_with_json(capsys):
    assert main(["plan", "-m", "llama-2-13b", "--gpu", "24gb", "--dtype", "float16", "--json"]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out)["fits"] is False
    assert "does not fit" in captured.err and "weights" in captured.err


def test_cli_table(capsys):
    assert main(["plan", "-m", "llama-2-13b", "--gpu", "24gb", "--quantization", "int8"]) == 0
    out = capsys.readouterr().out
    assert "733 blocks x 16 tokens = 11728 tokens" in out and "fits: yes" in out
    assert "suggested: pagedllm serve MODEL" in out


@pytest.mark.parametrize("argv,message", [
    (["--gpu", "rtx-9999"], "unknown GPU 'rtx-9999'"),
    (["--device-memory=-8GiB"], "--device-memory must be positive"),
    (["--device-memory", "0"], "--device-memory must be positive"),
    (["--gpu", "a100-80", "--device-memory", "80GiB"], "either --device-memory or gpu"),
    (["-m", "no-such-model"], "llama-2-13b"),  # the message lists the named shapes
    (["--gpu", "h100-80", "--tensor-parallel-size", "0"], "--tensor-parallel-size"),
])
def test_cli_bad_input_exits_2(argv, message, capsys):
    args = ["plan", *argv] if "-m" in argv else ["plan", "-m", "llama-3-8b", *argv]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_python_api_rejects_unknown_option():
    with pytest.raises(ValueError, match="unknown plan option"):
        pagedllm.plan("llama-3-8b", gpus="a100-80")


def test_suggestions_for_a_model_far_too_big():
    """70B on a 24 GB GPU: neither 8-bit nor 4-bit weights fit; 8-way tensor parallelism does."""
    p = plan("llama-2-70b", gpu="24gb")
    assert not p.fits and p.suggested_flags == ["--tensor-parallel-size 8"]
    assert plan("llama-2-70b", gpu="24gb", tensor_parallel_size=8).fits


@pytest.mark.parametrize("options,flags", [
    ({"quantization": "int8"}, ["--quantization int8"]),
    ({"kv_cache_dtype": "fp8"}, ["--kv-cache-dtype fp8"]),
    ({"tensor_parallel_size": 2}, ["--tensor-parallel-size 2"]),
    ({"quantization": "int4", "kv_cache_dtype": "int8", "tensor_parallel_size": 2},
     ["--quantization int4", "--kv-cache-dtype int8", "--tensor-parallel-size 2"]),
])
def test_suggested_serve_command_keeps_the_planned_formats_and_sharding(options, flags):
    """The suggested `serve` line runs what was planned: without --quantization int8 the 13B
    on 24 GB would load 26 GB of fp16 weights and not start."""
    p = plan("llama-2-13b", gpu="24gb" if "quantization" in options else "a100-80", dtype="float16", **options)
    assert p.fits
    assert [f for f in p.suggested_flags if f.split()[0] in ("--quantization", "--kv-cache-dtype",
                                                            "--tensor-parallel-size")] == flags
    assert not any(f.startswith("--quantization") for f in plan("llama-2-13b", gpu="a100-80").suggested_flags)
