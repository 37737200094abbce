"""Pre-quantized Hugging Face checkpoints: compressed-tensors folders written by the library, GPTQ and AWQ
folders packed as their libraries pack. Each kept projection dequantizes to exactly the format's own
dequantization, and the model's logits equal a float64 transformers model on those weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from pagedllm import LLM
from pagedllm.attention.backend import set_forward_context
from pagedllm.ops import gguf_repack
from tests.conftest import build_tiny_llama_dir
from pagedllm.quantization.w8a8 import W8A8LinearMethod, quantize_activations
from tests.gguf_blocks import rounded_activations
from tests.quantization.checkpoint_writers import (compressed_tensors_dequantized, write_compressed_tensors_folder,
                                                   write_packed_folder)

pytest.importorskip("compressed_tensors")

FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory, smollm2_tokenizer):
    """The tiny Llama with its own LM head (so ``ignore: [lm_head]`` means something)."""
    return build_tiny_llama_dir(tmp_path_factory.mktemp("untied"), smollm2_tokenizer, seed=3,
                                tie_word_embeddings=False)


def _model(folder, **kw):
    llm = LLM(model=str(folder), max_model_len=128, num_kv_blocks=32, **kw)
    return llm.llm_engine.runner.model


def _logits(model, ids):
    with torch.inference_mode(), set_forward_context(None):
        return model.compute_logits(model(ids, torch.arange(ids.shape[0])))


def _reference_logits(src, weights: dict[str, torch.Tensor], ids, rounded: dict | None = None) -> torch.Tensor:
    """A float64 transformers model of ``src`` whose projections carry the dequantized ``weights``; the inputs of
    the projections named in ``rounded`` rounded as pagedllm's method rounds them (``rounded[name]``: a function of
    the input, :func:`_input_rounding`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float64).eval()
    params, modules = dict(model.named_parameters()), dict(model.named_modules())
    for name, rounding in (rounded or {}).items():
        modules[name.rpartition(".")[0]].register_forward_pre_hook(lambda _, args, f=rounding: (f(args[0]),))
    with torch.no_grad():
        for name, w in weights.items():
            params[name].copy_(w)
        return model(ids.unsqueeze(0)).logits[0]


def _rounded(x: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """x rounded to int8 blocks of 32 taken in the order ``perm`` (an act-order layer's input_perm)."""
    if perm is None:
        return rounded_activations(x)
    out = torch.empty_like(x)
    out[..., perm] = rounded_activations(x[..., perm])
    return out


def _per_token(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 per token by W8A8's rule (w8a8.quantize_activations), in x's dtype."""
    flat = x.reshape(-1, x.shape[-1]).float()
    q, sx = quantize_activations(flat, None)
    return (q.double() * sx.double()).reshape(x.shape).to(x.dtype)


def _input_rounding(model, hf_name: str):
    """How pagedllm rounds the input of HF projection ``hf_name`` before its integer products (None: it does not):
    int8 blocks of 32 for the repacked int4 GEMM, per token for W8A8."""
    layer = _kept_layer(model, hf_name)[0]
    inner = getattr(layer.quant_method, "inner", None)
    if isinstance(inner, W8A8LinearMethod):
        return _per_token
    if getattr(inner, "repacked", False):
        return lambda x, perm=getattr(layer, "input_perm", None): _rounded(x, perm)
    return None


def _kept_layer(model, hf_name: str):
    """(pagedllm layer, index of the part or None) keeping HF projection ``hf_name``."""
    module, _, _ = hf_name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    modules = dict(model.named_modules())
    if leaf in FUSED:
        fused, index = FUSED[leaf]
        return modules[f"{parent}.{fused}"], index
    return modules[module], None


def _kept_rows(model, hf_name: str) -> torch.Tensor:
    """The dequantized rows pagedllm keeps for HF projection ``hf_name`` (part of a fused layer or not)."""
    layer, index = _kept_layer(model, hf_name)
    rows = layer.quant_method.dequantize(layer)
    return rows if index is None else layer.shard(rows, index)




def _check(model, src, reference: dict[str, torch.Tensor], num_kept: int):
    kept = [n for n, m in model.named_modules() if getattr(m, "quant_method", None) is not None]
    assert len(kept) == num_kept
    original = load_file(str(src / "model.safetensors"))
    for name, w in reference.items():
        got = _kept_rows(model, name).double()
        assert got.shape == w.shape
        assert (got - w).abs().max() <= 1e-6 * w.abs().max(), name
        # and the format's values are the float weight's, rounded (a wrong layout gives ~1.4)
        assert (w - original[name].double()).norm() <= 0.2 * original[name].double().norm(), name
    ids = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(0))
    rounded = {name: _input_rounding(model, name) for name in reference if _input_rounding(model, name)}
    ref = _reference_logits(src, reference, ids, rounded)
    assert (_logits(model, ids).double() - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.parametrize("preset, group_size, fmt", [
    ("W4A16", 32, None), ("W4A16_ASYM", 64, None), ("W8A8", None, None),
    ("W8A16", 32, None), ("W4A16_ASYM", 32, "naive-quantized")])
def test_compressed_tensors_checkpoint_equals_its_own_dequantization(untied_dir, tmp_path, preset, group_size, fmt):
    """compressed-tensors' int-quantized (W8A8: per-channel int8 weights on the W8A8 method, activations rounded
    per token), pack-quantized (W4A16 symmetric / with zero points, W8A16) and naive-quantized
    folders; the LM head is in ``ignore`` and stays float."""
    folder = write_compressed_tensors_folder(untied_dir, tmp_path / "ct", preset, group_size, fmt=fmt)
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["format"] == \
        (fmt or ("int-quantized" if preset == "W8A8" else "pack-quantized"))
    model = _model(folder)
    assert model.lm_head.quant_method is None
    assert isinstance(model.model.layers[0].mlp.down_proj.quant_method.inner, W8A8LinearMethod) == (preset == "W8A8")
    _check(model, untied_dir, compressed_tensors_dequantized(folder), num_kept=2 * 4)


def test_compressed_tensors_ignore_list_keeps_those_layers_float(untied_dir, tmp_path):
    folder = write_compressed_tensors_folder(untied_dir, tmp_path / "ct", "W4A16", 32,
                                             ignore=("lm_head", "re:.*down_proj$"))
    model = _model(folder)
    assert all(layer.mlp.down_proj.quant_method is None for layer in model.model.layers)
    _check(model, untied_dir, compressed_tensors_dequantized(folder), num_kept=2 * 3)


@pytest.mark.parametrize("method, group_size, symmetric, bits, checkpoint_format, act_order", [
    ("gptq", 32, True, 4, "gptq", False), ("gptq", 64, False, 4, "gptq", False),
    ("gptq", 32, False, 4, "gptq_v2", False), ("gptq", 32, True, 8, "gptq", False),
    ("gptq", 32, False, 4, "gptq", True), ("gptq", 32, True, 8, "gptq", True),
    ("awq", 64, False, 4, "gptq", False)])
def test_gptq_and_awq_checkpoints_equal_their_own_dequantization(untied_dir, tmp_path, method, group_size,
                                                                   symmetric, bits, checkpoint_format, act_order):
    """Act-order (desc_act) GPTQ: the kept columns are permuted so that groups are contiguous, the
    layer permutes its input alike (``input_perm``), and dequantization puts the columns back."""
    folder, reference = write_packed_folder(untied_dir, tmp_path / method, method, group_size, symmetric, bits,
                                            checkpoint_format, act_order)
    model = _model(folder)
    layer = model.model.layers[0].mlp.down_proj
    assert (getattr(layer, "input_perm", None) is not None) == act_order
    if act_order:
        assert not torch.equal(layer.input_perm, torch.arange(128))
    _check(model, untied_dir, reference, num_kept=2 * 4)


def test_per_channel_gptq_is_split_into_kernel_groups(untied_dir, tmp_path):
    """``group_size: -1`` (one scale per output row) is kept as equal groups of the int4 kernel's sizes."""
    folder, reference = write_packed_folder(untied_dir, tmp_path / "gptq", "gptq", None, symmetric=False)
    model = _model(folder)
    assert model.model.layers[0].mlp.down_proj.quant_method.inner.group_size == 128  # in_features 128: one group
    assert model.model.layers[0].self_attn.qkv_proj.quant_method.inner.group_size == 64  # in_features 64: one
    _check(model, untied_dir, reference, num_kept=2 * 4)


def test_bfloat16_model_runs_the_int4_kernel_on_a_gptq_checkpoint(untied_dir, tmp_path):
    """The repacked GEMM where the CPU has it (bfloat16 rows rounded to int8 blocks), else torch's int4 kernel."""
    folder, reference = write_packed_folder(untied_dir, tmp_path / "gptq", "gptq", 32, symmetric=False)
    model = _model(folder, dtype="bfloat16")
    layer = model.model.layers[0].self_attn.qkv_proj
    repacked = layer.quant_method.inner.repacked
    assert repacked == gguf_repack.available() and (repacked or getattr(layer, "kernel_qweight", None) is not None)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    ref = (rounded_activations(x) if repacked else x).double() @ layer.quant_method.dequantize(layer).double().t()
    assert (layer(x).double() - ref).abs().max() <= 3e-2 * ref.abs().max()


# -- refusals ----------------------------------------------------------------------------------

def _with_quantization_config(src, dst, quantization_config: dict):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("quantization_config, match", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"quantization_config\.quant_method 'bitsandbytes'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, r"quantization_config\.quant_method 'fp8'.*gptq"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, r"quantization_config\.version"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8}}}},
     r"config_groups\.g\.format 'float-quantized'"),
])
def test_unsupported_quantization_config_is_refused_naming_the_field(untied_dir, tmp_path, quantization_config,
                                                                     match):
    folder = _with_quantization_config(untied_dir, tmp_path / "m", quantization_config)
    with pytest.raises(ValueError, match=match):
        _model(folder)


def test_act_order_g_idx_without_desc_act_is_refused(untied_dir, tmp_path):
    from safetensors.torch import save_file

    folder, _ = write_packed_folder(untied_dir, tmp_path / "gptq", "gptq", 32, symmetric=False)
    state = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"
    state[name] = state[name].flip(0).contiguous()
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="act-order.*desc_act false"):
        _model(folder)


def test_act_order_parts_of_a_fused_layer_must_share_their_input_order(untied_dir, tmp_path):
    from safetensors.torch import save_file

    folder, _ = write_packed_folder(untied_dir, tmp_path / "gptq", "gptq", 32, act_order=True)
    state = load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.self_attn.v_proj.g_idx"
    state[name] = (torch.arange(64, dtype=torch.int32) // 32).contiguous()
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="v_proj: its act-order g_idx differs.*qkv_proj"):
        _model(folder)


def test_group_that_does_not_divide_in_features_is_refused(untied_dir, tmp_path):
    folder, _ = write_packed_folder(untied_dir, tmp_path / "gptq", "gptq", 32)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["group_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="self_attn.qkv_proj: quantization_config group size 96 does not divide "
                                         "in_features 64"):
        _model(folder)


def test_quantization_option_on_a_prequantized_checkpoint_is_refused(untied_dir, tmp_path):
    folder, _ = write_packed_folder(untied_dir, tmp_path / "awq", "awq", 32)
    with pytest.raises(ValueError, match="quantization='int8'.*already quantized.*awq"):
        _model(folder, quantization="int8")


def test_missing_tensors_of_a_quantized_projection_are_named(untied_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = write_packed_folder(untied_dir, tmp_path / "awq", "awq", 32)
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.self_attn.o_proj.qzeros"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks tensors.*model\.layers\.1\.self_attn\.o_proj\.qzeros"):
        _model(folder)


@pytest.mark.parametrize("preset", ["W4A16", "W8A8"])
def test_compressed_tensors_checkpoint_against_transformers_own_forward(untied_dir, tmp_path, preset):
    """transformers' compressed-tensors integration runs the folder itself. W4A16: its forward is
    dequantize-then-matmul, which pagedllm matches to float32 rounding (its projections' inputs rounded to int8
    blocks of 32 first where pagedllm runs the repacked int4 GEMM). W8A8: both round the activations to int8 per
    token, the library with a scale of max / 127.5 (its symmetric range 255 / 2, clamped to -128..127), pagedllm
    and vLLM's kernels with max / 127; the logits differ by that rounding only (about 1% of their range here, as
    far as the weight-only int8 method's float activations; test_compressed_tensors_checkpoint_equals_its_own_
    dequantization checks pagedllm's rule to float rounding)."""
    from transformers import AutoModelForCausalLM

    folder = write_compressed_tensors_folder(untied_dir, tmp_path / "ct", preset, 32)
    library = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    model = _model(folder)
    for name, module in library.named_modules():
        if name.endswith("_proj") and preset == "W4A16" and _input_rounding(model, f"{name}.weight"):
            module.register_forward_pre_hook(lambda _, args: (rounded_activations(args[0]),))
    ids = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = library(ids.unsqueeze(0)).logits[0]
    got = _logits(model, ids)
    tol = 1e-5 if preset == "W4A16" else 2e-2
    assert (got - ref).abs().max() <= tol * ref.abs().max()


# -- the real default model (slow) --------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_float_dir(tmp_path_factory, smollm2_path):
    from tests.quantization.checkpoint_writers import write_hf_folder_from_gguf

    return write_hf_folder_from_gguf(smollm2_path, tmp_path_factory.mktemp("smollm2") / "float32")


def _greedy(folder, num_prompts: int = 4, max_tokens: int = 16):
    from pagedllm import SamplingParams
    from tests.quantization.test_quantization import _questions

    llm = LLM(model=str(folder), max_model_len=512, kv_cache_memory="128MiB")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.chat([[{"role": "user", "content": q}] for q in _questions()[:num_prompts]], params, use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outs]


def _float_folder_with(src, dst, weights: dict[str, torch.Tensor]):
    """``src`` with the projections replaced by ``weights`` (float32): the checkpoint's values as a float model."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    state = load_file(str(src / "model.safetensors"))
    state.update({k: v.float().contiguous() for k, v in weights.items()})
    save_file(state, str(dst / "model.safetensors"))
    return dst


@pytest.mark.slow
def test_smollm2_compressed_tensors_w4a16_runs_as_its_dequantized_float_model(smollm2_float_dir, tmp_path):
    """SmolLM2 quantized by compressed-tensors (W4A16, zero points, group 32): its 210 projections
    (120 fused layers) kept at 4 bits give the greedy tokens of the float32 model carrying the
    library's dequantized weights (4 prompts x 16 tokens; only the order of float operations
    differs: measured 1.0, floor 0.9; benchmarks/prequantized_accuracy.py measures the formats against float32).
    Repacked for the AVX512-VNNI GEMM, the activations are also rounded to int8 blocks of 32, which flips near-ties
    of the greedy continuations (measured 0.66; floor 0.5, a wrong layout scores about 0)."""
    from tests.quantization.test_quantization import _prefix_agreement

    folder = write_compressed_tensors_folder(smollm2_float_dir, tmp_path / "w4", "W4A16_ASYM", 32)
    llm, got = _greedy(folder)
    assert sum(getattr(m, "quant_method", None) is not None for m in llm.llm_engine.runner.model.modules()) == 30 * 4
    del llm
    _, ref = _greedy(_float_folder_with(smollm2_float_dir, tmp_path / "dequantized",
                                        compressed_tensors_dequantized(folder)))
    repacked = gguf_repack.available()
    assert _prefix_agreement(ref, got) >= (0.5 if repacked else 0.9)
