"""Every supported family against transformers on tiny random-weight models.

Each model is saved as a Hugging Face folder (sharded safetensors) and loaded by pagedllm's
own loader; logits must equal transformers' (float32, max abs diff < 1e-4) for prefill,
decode, chunked prefill and a batch of mixed lengths through shuffled paged blocks, for a
prefix-cache hit, and for contexts of up to 64 tokens against sliding windows of 8. The
GGUF files written the way llama.cpp's converter writes them must load to the same model.
"""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.attention import CpuPagedAttention, TorchPagedAttention
from pagedllm.attention.backend import set_forward_context
from pagedllm.loader import load_model_files
from pagedllm.models import get_model_class, supported_architectures
from tests.family_utils import FAMILIES, GGUF_ARCHS, WINDOW, family_config, make_hf_model, save_hf_folder, write_gguf
from tests.model_utils import make_metadata, run_paged

ATOL = 1e-4
LENS, PROMPT_LENS = [64, 41, 9, 23], [30, 41, 1, 23]  # decodes past the window, long prefills, a 1-token prompt


def sequences(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lens]


@torch.no_grad()
def hf_logits(hf, seq):
    return hf(torch.tensor([seq])).logits[0].float()


def load_pagedllm(source: str, tokenizer: str, backend=None):
    files = load_model_files(source, tokenizer)
    model = get_model_class(files.hf_config)(files.hf_config, torch.float32, "cpu", attn_backend=backend)
    model.load_weights(files.weights(torch.float32))
    return model.eval(), files


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory, smollm2_path):
    """(name, transformers model, HF folder, pagedllm model loaded from the folder)."""
    name = request.param
    hf = make_hf_model(family_config(name), seed=FAMILIES.index(name))
    folder = save_hf_folder(hf, tmp_path_factory.mktemp(name))
    model, files = load_pagedllm(str(folder), str(smollm2_path))
    assert files.format == "hf" and type(model).__name__ == hf.config.architectures[0]
    return name, hf, folder, model


def test_every_family_is_registered():
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                 "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM",
                 "Qwen3MoeForCausalLM"):
        assert arch in supported_architectures()


def test_sliding_windows_per_layer(family):
    name, hf, _, model = family
    expected = {"llama": [None] * 2, "qwen2": [None, WINDOW], "qwen3": [None] * 2, "mistral": [WINDOW] * 2,
                "phi3": [WINDOW] * 2, "gemma2": [WINDOW, None, WINDOW], "gemma3": [WINDOW, None, WINDOW],
                "mixtral": [None] * 2, "qwen3_moe": [None] * 3}[name]
    assert model.sliding_windows == expected
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == expected


def test_no_cache_forward_matches_transformers(family):
    _, hf, _, model = family
    seq = sequences([40])[0]
    with torch.inference_mode(), set_forward_context(None):
        logits = model.compute_logits(model(torch.tensor(seq), torch.arange(len(seq))))
    assert (logits - hf_logits(hf, seq)).abs().max().item() < ATOL


@pytest.mark.parametrize("backend_name, block_size, chunk_size", [("torch", 16, None), ("torch", 4, 5),
                                                                  ("cpu", 16, 16)])
def test_paged_prefill_decode_chunked_mixed_match_transformers(family, backend_name, block_size, chunk_size):
    """Mixed batches: prefills, chunked prefills reading earlier chunks back, decodes past the window."""
    _, hf, _, model = family
    backend = TorchPagedAttention() if backend_name == "torch" else CpuPagedAttention()
    if backend_name == "cpu" and not backend.is_kernel_available:
        pytest.skip("no C compiler for the CPU kernel")
    for layer in model.model.layers:
        layer.self_attn.attn.backend = backend
    try:
        seqs = sequences(LENS, seed=block_size)
        out = run_paged(model, seqs, PROMPT_LENS, block_size=block_size, chunk_size=chunk_size)
    finally:
        for layer in model.model.layers:
            layer.self_attn.attn.backend = TorchPagedAttention()
    for seq, logits in zip(seqs, out):
        diff = (logits - hf_logits(hf, seq)).abs().max().item()
        assert diff < ATOL, f"max abs diff {diff} (len {len(seq)})"


@torch.inference_mode()
def test_prefix_cache_hit_matches_transformers(family):
    """Request B shares A's first 32 tokens (two full blocks): its table points at A's blocks and
    only its own tokens are computed, reading the shared prefix from the cache."""
    _, hf, _, model = family
    block_size, prefix_len = 16, 32
    a = sequences([40], seed=1)[0]
    b = a[:prefix_len] + sequences([20], seed=2)[0]
    num_blocks = 8
    caches = [torch.full((2, num_blocks, block_size, model.num_kv_heads, model.head_dim), 50.0)
              for _ in range(model.num_layers)]
    model.bind_kv_caches(caches)
    table_a, table_b = [5, 2, 7], [5, 2, 0, 3]
    try:
        for context, seq, table in ((0, a, table_a), (prefix_len, b, table_b)):
            meta = make_metadata([context], [len(seq) - context], [table], block_size)
            with set_forward_context(meta):
                hidden = model(torch.tensor(seq[context:]), torch.arange(context, len(seq)))
            logits = model.compute_logits(hidden)
    finally:
        model.bind_kv_caches([])
    assert (logits - hf_logits(hf, b)[prefix_len:]).abs().max().item() < ATOL


@pytest.mark.parametrize("name", list(GGUF_ARCHS))
def test_gguf_round_trip_equals_hf_folder(name, tmp_path, smollm2_path):
    """llama.cpp's layout (tensor names, Q/K permutation, Gemma's w + 1) is undone on load."""
    # llama.cpp keeps no sliding window for qwen2 and hard-codes Gemma 3's pattern (5 local, 1 global)
    overrides = {"qwen2": {"sliding_window": None, "layer_types": ["full_attention"] * 2},
                 "gemma3": {"num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}}
    hf = make_hf_model(family_config(name, **overrides.get(name, {})), seed=FAMILIES.index(name))
    path = write_gguf(hf, name, tmp_path / f"{name}.gguf")
    model, files = load_pagedllm(str(path), str(smollm2_path))
    assert files.format == "gguf" and type(model).__name__ == type(hf).__name__
    cfg, ref = files.hf_config, hf.config
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                  "intermediate_size", "tie_word_embeddings"):
        assert getattr(cfg, field) == getattr(ref, field), field
    assert model.sliding_windows == make_hf_sliding_windows(hf)
    seq = sequences([30], seed=3)[0]
    with torch.inference_mode(), set_forward_context(None):
        logits = model.compute_logits(model(torch.tensor(seq), torch.arange(len(seq))))
    assert (logits - hf_logits(hf, seq)).abs().max().item() < ATOL


def make_hf_sliding_windows(hf):
    """The window of each transformers attention layer (None = full), read from the reference."""
    return [getattr(layer.self_attn, "sliding_window", None) for layer in hf.model.layers]


def test_unsupported_architecture_in_hf_folder(tmp_path, smollm2_path, family):
    _, _, folder, _ = family
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).symlink_to(f)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FancyNewForCausalLM.*supported: .*Gemma3ForCausalLM"):
        load_pagedllm(str(bad), str(smollm2_path))


def test_missing_tensor_names_it_and_the_architecture(family, smollm2_path):
    name, _, folder, _ = family
    files = load_model_files(str(folder), str(smollm2_path))
    model = get_model_class(files.hf_config)(files.hf_config)
    dropped = "model.layers.1.self_attn.k_proj.weight" if name != "phi3" else "model.layers.1.self_attn.qkv_proj.weight"
    weights = ((n, t) for n, t in files.weights(torch.float32) if n != dropped)
    with pytest.raises(ValueError, match=rf"{type(model).__name__}: .*{dropped}"):
        model.load_weights(weights)


def test_unknown_gguf_architecture(tmp_path):
    import gguf

    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'mamba' is not supported; supported: .*gemma3"):
        load_model_files(str(path))
