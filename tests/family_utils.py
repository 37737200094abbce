"""Tiny random-weight models of every supported family, saved the ways users have them.

- :data:`FAMILIES`: name -> a transformers config (2-3 layers, hidden 64, vocab 512), each
  exercising what makes the family differ (biases, q/k norm, sliding windows of 8 tokens,
  soft-capping, partial rotary, per-layer-type rope).
- :func:`make_hf_model`: the transformers reference model (eager attention) with seeded weights.
- :func:`save_hf_folder`: config.json + sharded safetensors.
- :func:`write_gguf`: the same weights as llama.cpp's ``convert_hf_to_gguf.py`` writes them
  (tensor names from ``gguf.get_tensor_name_map``, Q/K rows permuted for llama, ``w + 1``
  on Gemma norms), F32 so values round-trip exactly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.model_utils import _init_

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
WINDOW = 8


def _config(name: str):
    import transformers as tf

    if name == "llama":
        return tf.LlamaConfig(**COMMON, num_hidden_layers=2, tie_word_embeddings=False)
    if name == "qwen2":  # layer 1 slides (use_sliding_window, max_window_layers=1); untied
        return tf.Qwen2Config(**COMMON, num_hidden_layers=2, use_sliding_window=True, sliding_window=WINDOW,
                              max_window_layers=1, tie_word_embeddings=False)
    if name == "qwen3":  # head_dim 32 != hidden / heads; tied
        return tf.Qwen3Config(**COMMON, num_hidden_layers=2, head_dim=32, tie_word_embeddings=True)
    if name == "mistral":
        return tf.MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=WINDOW, tie_word_embeddings=False)
    if name == "phi3":  # half the head dims rotate; every layer slides
        return tf.Phi3Config(**COMMON, num_hidden_layers=2, sliding_window=WINDOW, partial_rotary_factor=0.5,
                             tie_word_embeddings=False)
    if name == "gemma2":
        return tf.Gemma2Config(**COMMON, num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16,
                               sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    if name == "gemma3":  # local / global rope bases, linear scaling on global layers
        return tf.Gemma3TextConfig(
            **COMMON, num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=32, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    if name == "mixtral":  # 8 experts, 2 per token, renormalised
        return tf.MixtralConfig(**COMMON, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
                                tie_word_embeddings=False)
    if name == "qwen3_moe":  # layer 1 dense (mlp_only_layers); top-k not renormalised
        return tf.Qwen3MoeConfig(**COMMON, num_hidden_layers=3, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                 moe_intermediate_size=32, norm_topk_prob=False, mlp_only_layers=[1],
                                 tie_word_embeddings=False)
    raise KeyError(name)


FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe"]
GGUF_ARCHS = {"llama": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3", "gemma2": "GEMMA2", "gemma3": "GEMMA3",
              "mixtral": "LLAMA"}


def family_config(name: str, **overrides):
    config = _config(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def make_hf_model(config, seed: int = 0):
    """transformers' model for ``config`` (float32, eval, eager attention) with seeded weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        _init_(model.named_parameters(), torch.Generator().manual_seed(seed))
    return model


def save_hf_folder(model, path: Path) -> Path:
    """config.json + safetensors in several shards (model.safetensors.index.json)."""
    model.save_pretrained(path, safe_serialization=True, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    return path


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py, LlamaModel.permute: HF's rotary halves -> interleaved pairs."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, family: str, path: Path) -> Path:
    """Write ``model``'s config and weights as llama.cpp's converter would (F32 tensors)."""
    import gguf

    config = model.config
    arch = gguf.MODEL_ARCH[GGUF_ARCHS[family]]
    arch_name = gguf.MODEL_ARCH_NAMES[arch]
    writer = gguf.GGUFWriter(str(path), arch_name)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    if family.startswith("gemma"):
        writer.add_sliding_window(config.sliding_window)
    if family == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if family == "mixtral":
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if rope.get("rope_type", "default") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        values = tensor.float().numpy()
        if name.endswith("experts.gate_up_proj"):  # llama.cpp stacks each projection of all experts
            prefix = names.get_name(name.replace("experts.gate_up_proj", "gate")).removesuffix("gate_inp")
            gate, up = np.split(values, 2, axis=1)  # (experts, intermediate, hidden) each
            writer.add_tensor(f"{prefix}gate_exps.weight", np.ascontiguousarray(gate))
            writer.add_tensor(f"{prefix}up_exps.weight", np.ascontiguousarray(up))
            continue
        if name.endswith("experts.down_proj"):
            prefix = names.get_name(name.replace("experts.down_proj", "gate")).removesuffix("gate_inp")
            writer.add_tensor(f"{prefix}down_exps.weight", np.ascontiguousarray(values))
            continue
        if family in ("llama", "mixtral") and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            values = _llama_cpp_permute(values, heads)
        if family.startswith("gemma") and name.endswith("norm.weight"):
            values = values + 1  # llama.cpp stores Gemma norms as w + 1
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
