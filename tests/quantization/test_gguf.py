"""``quantization="gguf"``: blocks kept packed, fused layers of mixed types, against gguf's own dequantization, in
both layouts: the file's blocks (decode rows through the block dot product, prefill rows through dequantized
panels) and the repacked GEMM (every row count, on CPUs with AVX512-VNNI)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from pagedllm.models.layers.linear import MergedLinear
from pagedllm.ops import gguf_dot, gguf_repack
from pagedllm.quantization import get_quantization_config
from pagedllm.quantization import gguf
from pagedllm.quantization.gguf import DOT_MAX_ROWS, GGUFConfig, GGUFLinearMethod, row_bytes
from tests.gguf_blocks import quantized_reference, random_blocks

pytestmark = pytest.mark.skipif(gguf_dot.kernel() is None, reason="no C compiler for the GGUF kernels")
LAYOUTS = ["blocks", pytest.param("repacked", marks=pytest.mark.skipif(
    not gguf_repack.available(), reason="the repacked GEMM needs AVX512-VNNI"))]


@pytest.fixture(params=LAYOUTS)
def layout(request, monkeypatch):
    """Which layout the layers take: "blocks" turns repacking off for the test."""
    if request.param == "blocks":
        monkeypatch.setattr(gguf_repack, "available", lambda: False)
    return request.param


@pytest.fixture
def blocks_layout(monkeypatch):
    monkeypatch.setattr(gguf_repack, "available", lambda: False)


def _fused_layer(parts: list[tuple[Q, int]], k: int, bias: bool, rng: np.random.Generator):
    """A MergedLinear with GGUF parts loaded as the loader does (rows zero-padded to the widest part)."""
    layer = MergedLinear(k, [rows for _, rows in parts], bias=bias).requires_grad_(False)
    method = GGUFLinearMethod(parts)
    method.create_weights(layer)
    assert layer.weight.dtype == torch.uint8 and layer.weight.shape == (layer.out_features, method.row_width(k))
    raws = [random_blocks(kind, rows, k, rng) for kind, rows in parts]
    for i, raw in enumerate(raws):
        layer.shard(layer.weight, i)[:, :raw.shape[1]].copy_(torch.from_numpy(raw))
    if bias:
        layer.bias.copy_(torch.randn(layer.out_features))
    method.process_weights_after_loading(layer)
    layer.quant_method = method
    w = np.concatenate([dequantize(raw, kind).reshape(raw.shape[0], k) for raw, (kind, _) in zip(raws, parts)])
    return layer, w.astype(np.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_of_mixed_types(dtype, layout):
    """Gemma 3's q/k/v: Q5_0, Q5_0 and Q8_0 parts in one layer, each dotted from its own blocks."""
    layer, w = _fused_layer([(Q.Q5_0, 64), (Q.Q5_0, 32), (Q.Q8_0, 32)], 640, True, np.random.default_rng(0))
    if layout == "blocks":
        assert [b.shape for b in layer.buffers() if b.dtype == torch.uint8] == \
            [(64, row_bytes(640, Q.Q5_0)), (32, row_bytes(640, Q.Q5_0)), (32, row_bytes(640, Q.Q8_0))]
    else:  # one byte per code (5- and 8-bit types), tiles of 16 outputs; one layout (half scales): one product
        assert [b.numel() for b in layer.buffers() if b.dtype == torch.uint8] == [128 * 640]
        assert len(layer._gguf_repacked) == 1
    assert np.array_equal(layer.quant_method.dequantize(layer).numpy(), w.astype(np.float32))
    bias = layer.bias.double().numpy()
    x = torch.randn(3, 640).to(dtype)
    q, d, _ = quantized_reference(x.float().numpy())
    xq = (q.reshape(3, -1, 32) * d[..., None].astype(np.float64)).reshape(3, 640)
    ref = xq @ w.T + bias
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    got = layer(x)
    assert got.dtype == dtype
    assert np.abs(got.double().numpy() - ref).max() <= tol * np.abs(ref).max()


@pytest.mark.parametrize("panel", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q6_K, Q.Q4_1])
def test_prefill_rows_use_the_dequantized_weight(kind, panel, monkeypatch, blocks_layout):
    """Above DOT_MAX_ROWS the activations are not quantized: a matmul of gguf's dequantized weight, float32, or
    bfloat16 inputs summed in float32 (within bfloat16's rounding of x and W: 2 * 2^-9 of sum |x| |w|)."""
    monkeypatch.setattr(gguf, "_bf16_panels", [panel == "bfloat16"])
    layer, w = _fused_layer([(kind, 48)], 512, False, np.random.default_rng(1))
    x = torch.randn(DOT_MAX_ROWS + 37, 512)
    assert layer.quant_method.panel_dtype() == getattr(torch, panel)
    ref = x.double().numpy() @ w.T
    got = layer(x).double().numpy()
    if panel == "float32":
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    else:
        bound = 2 * 2.0 ** -8 * (np.abs(x.double().numpy()) @ np.abs(w).T) + 2.0 ** -8 * np.abs(ref)
        assert (np.abs(got - ref) <= bound).all()
        assert np.abs(got - ref).max() > 0  # the bfloat16 panel ran


@pytest.mark.parametrize("parts,k", [([(Q.Q4_K, 40), (Q.Q6_K, 24)], 256), ([(Q.Q4_1, 40), (Q.Q8_0, 24)], 608),
                                     ([(Q.Q5_0, 16), (Q.Q4_0, 8), (Q.Q5_1, 8)], 576)])
def test_decode_rows_are_batch_invariant(parts, k, layout):
    """A row's outputs are the same bits whatever rows share the call: one tile of rows (the legacy types read
    straight from the blocks on the VNNI path) or many (an unpacked row), an odd block count included; repacked,
    at every row count (a prefill chunk's too)."""
    layer, _ = _fused_layer(parts, k, False, np.random.default_rng(2))
    x = torch.randn(DOT_MAX_ROWS if layout == "blocks" else 3 * DOT_MAX_ROWS + 5, k)
    full = layer(x)
    for m in (1, 2, 5, 6, 7, 8, 9, 17, DOT_MAX_ROWS - 1, DOT_MAX_ROWS + 1, 2 * DOT_MAX_ROWS + 3):
        if m <= x.shape[0]:
            assert torch.equal(layer(x[-m:]), full[-m:])


def test_config_keeps_every_type_with_a_kernel():
    types = {f"l.{p}.weight": kind for p, kind in
             [("q_proj", Q.Q5_0), ("k_proj", Q.Q5_0), ("v_proj", Q.Q8_0), ("o_proj", Q.F16), ("down_proj", Q.Q4_K)]}
    config = get_quantization_config("gguf", gguf_tensor_types=types,
                                     fused_parts={"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    assert isinstance(config, GGUFConfig)
    qkv = config.get_linear_method("l.qkv_proj", MergedLinear(640, [64, 32, 32]))
    assert qkv.segments == [(Q.Q5_0, 64), (Q.Q5_0, 32), (Q.Q8_0, 32)]
    assert config.get_linear_method("l.o_proj", torch.nn.Linear(640, 640)) is None  # F16: loaded as float
    assert config.get_linear_method("l.down_proj", torch.nn.Linear(640, 64)) is None  # 640 % 256
    assert config.get_linear_method("l.down_proj", torch.nn.Linear(512, 64)).segments == [(Q.Q4_K, 64)]
    width = row_bytes(640, Q.Q8_0)
    assert config.packed_weight_names == {"l.q_proj.weight": width, "l.k_proj.weight": width,
                                          "l.v_proj.weight": width, "l.down_proj.weight": row_bytes(512, Q.Q4_K)}
    assert (config.num_kept, config.num_float) == (2, 2)


@pytest.mark.slow
def test_smollm2_packed_rows_equal_dequantized_rows(smollm2_path):
    """The loader's raw Q4_1 rows of a Q projection (un-permuted as bytes; zero-padded when asked) dequantize to
    exactly the float rows it yields without ``packed``."""
    from pagedllm.loader import load_model_files

    files = load_model_files(str(smollm2_path))
    name = "model.layers.0.self_attn.q_proj.weight"
    kind = files.gguf_tensor_types[name]
    assert kind == Q.Q4_1
    dense = next(t for n, t in files.weights(torch.float32) if n == name)  # early in the file: stop there
    width = row_bytes(dense.shape[1], kind)
    raw = next(t for n, t in files.weights(torch.float32, packed={name: width + 4}) if n == name)
    assert raw.dtype == torch.uint8 and raw.shape == (dense.shape[0], width + 4) and not raw[:, width:].any()
    values = gguf_dot.dequantize_rows(int(kind), raw, dense.shape[1])
    assert torch.equal(values, dense)


def _tied_model(vocab: int, hidden: int):
    from torch import nn

    from pagedllm.models.layers.embedding import LMHead, VocabEmbedding

    model = nn.Module()
    model.model = nn.Module()
    model.model.embed_tokens = VocabEmbedding(vocab, hidden)
    model.lm_head = LMHead(hidden, vocab)
    model.lm_head.weight = model.model.embed_tokens.weight
    return model.requires_grad_(False)


def test_tied_head_keeps_the_embedding_q8_0_blocks(layout):
    """A head tied to a Q8_0 embedding: the head gets back the file's exact Q8_0 bytes from the embedding's rows;
    the embedding keeps its float rows for the lookup, or, repacked, looks them up in the head's codes (the same
    values, checked at load) and drops them."""
    from pagedllm.quantization.base import create_quantized_weights, process_quantized_weights

    vocab, hidden = 100, 64
    model = _tied_model(vocab, hidden)
    config = GGUFConfig({"model.embed_tokens.weight": Q.Q8_0}, {})
    assert create_quantized_weights(model, config) == 1
    from gguf.quants import quantize

    raw = quantize(np.random.default_rng(3).standard_normal((vocab, hidden)).astype(np.float32), Q.Q8_0)
    w = dequantize(raw, Q.Q8_0).reshape(vocab, hidden)
    model.model.embed_tokens.weight.copy_(torch.from_numpy(w))  # what load_weights does
    process_quantized_weights(model)
    if layout == "blocks":
        assert np.array_equal(model.lm_head.gguf_blocks_0.numpy(), raw)
    assert torch.equal(model.lm_head.quant_method.dequantize(model.lm_head), torch.from_numpy(w))
    assert (model.model.embed_tokens.weight is None) == (layout == "repacked")
    ids = torch.tensor([[3, 99, 0], [3, 3, 7]])
    assert torch.equal(model.model.embed_tokens(ids), torch.from_numpy(w)[ids])
    x = torch.randn(2, hidden)
    q, d, _ = quantized_reference(x.numpy())
    ref = (q.reshape(2, -1, 32) * d[..., None].astype(np.float64)).reshape(2, hidden) @ w.astype(np.float64).T
    assert np.abs(model.lm_head(x).double().numpy() - ref).max() <= 1e-5 * np.abs(ref).max()
    assert "Q8_0 1" in config.describe()


def test_embedding_keeps_rows_that_q8_0_does_not_give_back(layout):
    """Float rows that were not dequantized from Q8_0 (a bfloat16 model's rounded rows, a file written by another
    rule) stay the embedding's: the head's blocks would give other values."""
    from pagedllm.quantization.base import create_quantized_weights, process_quantized_weights

    model = _tied_model(40, 64)
    create_quantized_weights(model, GGUFConfig({"model.embed_tokens.weight": Q.Q8_0}, {}))
    rows = torch.randn(40, 64)
    model.model.embed_tokens.weight.copy_(rows)
    process_quantized_weights(model)
    assert torch.equal(model.model.embed_tokens.weight, rows)
    with pytest.raises(IndexError):
        gguf_repack.values(model.lm_head._gguf_repacked[0], rows=torch.tensor([40])) if layout == "repacked" \
            else model.model.embed_tokens(torch.tensor([40]))


def test_q8_0_quantization_follows_gguf():
    from gguf.quants import quantize

    x = (np.random.default_rng(4).standard_normal((16, 256)) * np.logspace(-9, 5, 256)).astype(np.float32)
    x[0, :32] = 0.0
    assert np.array_equal(gguf_dot.quantize_q8_0(torch.from_numpy(x)).numpy(), quantize(x, Q.Q8_0))


@pytest.mark.slow
def test_gemma3_q4_k_m_greedy_tokens_near_the_dequantized_model():
    """Gemma 3 270M's Q4_K_M file (Q5_0, Q8_0, Q4_K, Q6_K tensors, fused q/k/v of mixed types, tied Q8_0 head)
    kept packed against the same file dequantized to float32: greedy agreement before the first divergence
    (16 prompts x 64 tokens measured 0.74: benchmarks/README.md, "GGUF blocks kept packed"; a wrong layout or scale
    diverges at the first token)."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.loader.resolve import ModelNotFoundError, resolve_model

    try:
        path = str(resolve_model("gemma3-270m").path)
    except (ModelNotFoundError, ImportError) as e:
        pytest.skip(f"gemma3-270m is not installed: {e}")
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at", "The three primary colors are"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for q in (None, "gguf"):
        llm = LLM(model=path, max_model_len=256, kv_cache_memory="64MiB", quantization=q)
        tokens[q] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        if q == "gguf":
            summary = [m for m in llm.llm_engine.runner.model.modules() if getattr(m, "quant_method", None)]
            assert len(summary) == 18 * 4 + 1  # every projection and the head
        del llm
    same = sum(next((i for i, (a, b) in enumerate(zip(r, x)) if a != b), len(r))
               for r, x in zip(tokens[None], tokens["gguf"]))
    assert same / (len(prompts) * 16) >= 0.5


def test_smollm2_decode_steps_replay_bitwise_the_eager_steps(smollm2_path):
    """Decode steps of kept blocks run as recorded CPU decode graphs (the dot product's calls on pool buffers):
    tokens and logprobs equal the eager run's bit for bit."""
    from pagedllm import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    runs = {}
    for eager in (False, True):
        llm = LLM(model=str(smollm2_path), max_model_len=256, kv_cache_memory="64MiB", quantization="gguf",
                  enforce_eager=eager)
        runs[eager] = llm.generate(prompts, params, use_tqdm=False)
        if not eager:
            graphs = llm.llm_engine.runner.cpu_graphs
            assert graphs is not None and graphs.num_replayed > 0 and not graphs.refused
        del llm
    for a, b in zip(runs[False], runs[True]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{t: p.logprob for t, p in d.items()} for d in a.outputs[0].logprobs] == \
            [{t: p.logprob for t, p in d.items()} for d in b.outputs[0].logprobs]
