"""``quantization_config`` of config.json parsed without torch: the schemes pagedllm keeps, and
every other value refused naming its field."""

from __future__ import annotations

import pytest

from pagedllm.loader.quantization_config import WeightScheme, parse_quantization_config


def _ct(weights: dict, fmt: str = "pack-quantized", input_activations=None, **extra) -> dict:
    group = {"targets": ["Linear"], "weights": {"type": "int", "dynamic": False, **weights},
             "input_activations": input_activations, "format": fmt}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group},
            "ignore": ["lm_head"], **extra}


def test_compressed_tensors_w4a16_and_w8a8():
    w4 = parse_quantization_config(_ct({"num_bits": 4, "strategy": "group", "group_size": 128, "symmetric": False}))
    assert w4.scheme_for("model.layers.0.self_attn.q_proj") == WeightScheme(4, 128, False, "pack-quantized")
    assert w4.scheme_for("lm_head") is None
    acts = {"type": "int", "num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": True}
    w8 = parse_quantization_config(_ct({"num_bits": 8, "strategy": "channel", "symmetric": True}, "int-quantized",
                                       acts))
    scheme = w8.scheme_for("model.layers.3.mlp.down_proj")
    assert scheme.group_size is None and scheme.dynamic_int8_activations and scheme.bits == 8
    assert w8.describe() == "compressed-tensors (W8A8 dynamic per token, per channel, symmetric)"


def test_targets_and_ignore_follow_compressed_tensors_matching():
    config = _ct({"num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": True},
                 ignore=["lm_head", "re:.*mlp.down_proj$", "model.layers.1.self_attn.o_proj"])
    config["config_groups"]["group_0"]["targets"] = ["re:.*self_attn.*", "re:.*mlp.*"]
    parsed = parse_quantization_config(config)
    assert parsed.scheme_for("model.layers.0.mlp.up_proj") is not None
    assert parsed.scheme_for("model.layers.0.mlp.down_proj") is None
    assert parsed.scheme_for("model.layers.1.self_attn.o_proj") is None
    assert parsed.scheme_for("model.layers.0.self_attn.o_proj") is not None


def test_gptq_and_awq():
    gptq = parse_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False,
                                      "sym": True})
    assert gptq.scheme_for("model.layers.0.mlp.up_proj") == WeightScheme(4, None, True, "gptq")
    assert gptq.scheme_for("lm_head") is None
    awq = parse_quantization_config({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                     "version": "GEMM", "modules_to_not_convert": ["visual"]})
    assert awq.scheme_for("model.visual.proj") is None
    assert awq.scheme_for("model.layers.0.mlp.up_proj") == WeightScheme(4, 128, False, "gemm")


@pytest.mark.parametrize("config, field", [
    ({"quant_method": "bitsandbytes"},
     r"quantization_config\.quant_method 'bitsandbytes'.*compressed-tensors, gptq, awq"),
    ({"quant_method": "fp8"}, r"quantization_config\.quant_method 'fp8'"),
    ({"quant_method": "gptq", "bits": 3}, r"quantization_config\.bits 3"),
    ({"quant_method": "gptq", "bits": 8, "sym": False}, r"quantization_config\.sym"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, r"quantization_config\.checkpoint_format"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, r"quantization_config\.version"),
    (_ct({"num_bits": 8, "type": "float"}, "float-quantized"), r"config_groups\.group_0\.format 'float-quantized'"),
    (_ct({"num_bits": 8, "type": "float"}, "int-quantized"), r"config_groups\.group_0\.weights\.type 'float'"),
    (_ct({"num_bits": 4, "strategy": "group", "group_size": 128}, input_activations={
        "type": "int", "num_bits": 8, "strategy": "tensor", "dynamic": False, "symmetric": True}),
     r"input_activations\.strategy 'tensor'"),
    (_ct({"num_bits": 4, "strategy": "block"}), r"weights\.strategy 'block'"),
    (_ct({"num_bits": 4, "strategy": "group", "group_size": 128}, kv_cache_scheme={"num_bits": 8}),
     r"quantization_config\.kv_cache_scheme"),
])
def test_unsupported_values_are_refused_naming_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        parse_quantization_config(config)


def test_absent_config_is_a_float_checkpoint():
    assert parse_quantization_config(None) is None
