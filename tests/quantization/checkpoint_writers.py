"""Pre-quantized Hugging Face folders written for the tests, and the formats' own dequantization.

- compressed-tensors: written by the library itself (``apply_quantization_config``, min-max
  ``calculate_qparams`` as llm-compressor's MinMax observer, ``ModelCompressor.compress_model``,
  ``update_config``); dequantized by its own compressors (``decompress_module``).
- GPTQ: AutoGPTQ's ``QuantLinear.pack`` (auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py) re-typed in
  torch, and its forward's dequantization (``scales * (weight - (zeros + 1))``), since neither AutoGPTQ
  nor GPTQModel installs and runs on a CPU-only torch.
- AWQ: AutoAWQ's ``WQLinear_GEMM.from_linear`` packing (awq/modules/linear/gemm.py) re-typed, and
  compressed-tensors' own AutoAWQ converter (``AutoAWQConverter._convert_gemm_module``) as the
  reference unpacking (AutoAWQ itself needs an old transformers).
Weights are rounded to the nearest level of min-max group scales (the packing, not GPTQ's or AWQ's
calibration, is what a loader must get right).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
GPTQ_ORDER_OF_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)


def _hf_model(src: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()


def _save(model, state: dict[str, torch.Tensor], dst: Path, quantization_config: dict | None, src: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(dst / "model.safetensors"))
    model.config.save_pretrained(str(dst))
    if quantization_config is not None:
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (dst / "config.json").write_text(json.dumps(config, indent=2))
    _copy_tokenizer(src, dst)
    return dst


# -- compressed-tensors ------------------------------------------------------------------------

def write_compressed_tensors_folder(src: Path, dst: Path, preset: str, group_size: int | None = None,
                                    ignore: tuple[str, ...] = ("lm_head",), fmt: str | None = None) -> Path:
    """``src`` (a float HF folder) quantized with compressed-tensors' preset scheme (``W8A8``,
    ``W4A16``, ``W4A16_ASYM``, ``W8A16``), ``group_size`` replacing the preset's for group schemes,
    in the library's format for it or ``fmt`` (e.g. ``naive-quantized``)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, apply_quantization_config,
                                                 preset_name_to_scheme)
    from compressed_tensors.quantization.utils import calculate_qparams

    model = _hf_model(src)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group_size is not None and scheme.weights.group_size is not None:
        scheme.weights.group_size = group_size
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore)))
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                args = module.quantization_scheme.weights
                w = module.weight.data
                if args.strategy == "group":
                    w = w.view(w.shape[0], -1, args.group_size)
                keep = args.strategy != "group"
                lo, hi = w.amin(dim=-1, keepdim=keep), w.amax(dim=-1, keepdim=keep)
                scale, zero = calculate_qparams(lo, hi, args)
                module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
                if hasattr(module, "weight_zero_point"):
                    module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    folder = _save(model, dict(model.state_dict()), dst, None, src)
    compressor.update_config(str(folder))
    return folder


def compressed_tensors_dequantized(folder: Path) -> dict[str, torch.Tensor]:
    """Every quantized projection's weight (HF name → float64 (N, K)) as compressed-tensors' own
    compressor for the folder's format decompresses it."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    (group,) = config["config_groups"].values()
    scheme = QuantizationScheme.model_validate(group)
    compressor = BaseCompressor.load_from_registry(group.get("format") or config["format"])
    state = load_file(str(folder / "model.safetensors"))
    modules = {name.rpartition(".")[0] for name in state if name.endswith(".weight_scale")}
    weights = {}
    for module in modules:
        local = {k[len(module) + 1:]: v for k, v in state.items() if k.rpartition(".")[0] == module}
        weights[f"{module}.weight"] = compressor.decompress(local, scheme)["weight"].double()
    return weights


# -- GPTQ and AWQ (min-max group quantization, the formats' own packing) ----------------------------

def _minmax_groups(w: torch.Tensor, group_size: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) → scales (G, N) float16 and integer zero points (G, N) for 4 bits."""
    g = w.view(w.shape[0], -1, group_size)
    if symmetric:
        scale = (g.abs().amax(dim=2) / 7.5).clamp_min(1e-8)
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = g.amin(dim=2).clamp(max=0), g.amax(dim=2).clamp(min=0)
        scale = ((hi - lo) / 15).clamp_min(1e-8)
        zero = torch.round(-lo / scale).clamp(0, 15)
    return scale.half().t().contiguous(), zero.t().contiguous()


def gptq_pack(weight: torch.Tensor, group_size: int, symmetric: bool, bits: int = 4,
              act_order: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """AutoGPTQ's ``QuantLinear.pack`` (v1 format: stored zeros are ``z - 1``; the g_idx-aware pack of its
    qlinear_exllama / qlinear_cuda), 4 or 8 bits. ``act_order``: the order (K,) in which inputs were
    quantized (desc_act): group i holds inputs ``act_order[i * group_size:(i + 1) * group_size]``."""
    n, k = weight.shape
    maxq = 2 ** bits - 1
    order = torch.arange(k) if act_order is None else act_order
    grouped = weight[:, order]
    if bits == 4:
        scales, zeros = _minmax_groups(grouped, group_size, symmetric)
    else:  # symmetric 8-bit
        g = grouped.reshape(n, -1, group_size)
        scales = (g.abs().amax(dim=2) / 127.5).clamp_min(1e-8).half().t().contiguous()
        zeros = torch.full(scales.shape, 128.0)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group_size).to(torch.int32)
    scale_zeros = zeros * scales.float()
    intweight = torch.round((weight + scale_zeros[g_idx.long()].t()) / scales.float()[g_idx.long()].t())
    intweight = intweight.clamp(0, maxq).to(torch.int64).t().contiguous()  # (K, N)
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    qweight = (intweight.view(k // per_word, per_word, n) << shifts.view(1, -1, 1)).sum(dim=1)
    stored_zeros = (zeros.to(torch.int64) - 1) & maxq  # v1: zeros - 1, as uint32 bit patterns
    qzeros = (stored_zeros.view(zeros.shape[0], n // per_word, per_word) << shifts.view(1, 1, -1)).sum(dim=2)
    as_int32 = lambda t: ((t + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32)  # uint32 bits → int32
    return {"qweight": as_int32(qweight), "qzeros": as_int32(qzeros), "scales": scales, "g_idx": g_idx}


def gptq_dequantize(tensors: dict[str, torch.Tensor], bits: int = 4) -> torch.Tensor:
    """AutoGPTQ's forward (qlinear_cuda_old, torch path): ``scales * (weight - (zeros + 1))`` → (N, K) float64."""
    wf = torch.arange(0, 32, bits, dtype=torch.int32).unsqueeze(0)
    qweight, qzeros, scales, g_idx = tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"]
    zeros = torch.bitwise_right_shift(qzeros.unsqueeze(2).expand(-1, -1, 32 // bits), wf.unsqueeze(0))
    zeros = (torch.bitwise_and(zeros, 2 ** bits - 1) + 1).reshape(qzeros.shape[0], -1)  # (G, N)
    weight = torch.bitwise_right_shift(qweight.unsqueeze(1).expand(-1, 32 // bits, -1), wf.unsqueeze(-1))
    weight = torch.bitwise_and(weight, 2 ** bits - 1).reshape(-1, qweight.shape[1])  # (K, N)
    g = g_idx.long()
    return (scales.double()[g] * (weight - zeros[g]).double()).t()


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def awq_pack(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """AutoAWQ's ``WQLinear_GEMM.from_linear``: intweight (K, N) and zeros (G, N) packed along N in AWQ_ORDER."""
    scales, zeros = _minmax_groups(weight, group_size, symmetric=False)
    k = weight.shape[1]
    group_of = torch.arange(k) // group_size
    intweight = torch.round((weight.t() + (zeros * scales.float())[group_of]) / scales.float()[group_of])
    intweight = intweight.clamp(0, 15).to(torch.int64)  # (K, N)

    def pack(values: torch.Tensor) -> torch.Tensor:
        rows, cols = values.shape
        out = torch.zeros(rows, cols // 8, dtype=torch.int64)
        for i, j in enumerate(AWQ_ORDER):
            out |= values[:, j::8] << (4 * i)
        return ((out + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32)

    return {"qweight": pack(intweight), "qzeros": pack(zeros.to(torch.int64)), "scales": scales}


def awq_dequantize(tensors: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    """compressed-tensors' AutoAWQ converter unpacking, then ``(q - zero_point) * scale`` → (N, K) float64."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    converter = AutoAWQConverter(bits=4, group_size=group_size, zero_point=True)
    q, scale, zero = converter._convert_gemm_module(tensors["qweight"], tensors["scales"], tensors["qzeros"])
    groups = torch.arange(q.shape[1]) // group_size
    return (q.double() - zero.double()[:, groups]) * scale.double()[:, groups]


def write_packed_folder(src: Path, dst: Path, method: str, group_size: int | None, symmetric: bool = False,
                        bits: int = 4, checkpoint_format: str = "gptq", act_order: bool = False
                        ) -> tuple[Path, dict[str, torch.Tensor]]:
    """``src`` with every decoder projection packed as GPTQ (``method="gptq"``) or AWQ (``group_size``
    None: one group per row, ``-1`` in the config); returns the folder and each projection's reference
    dequantized weight (HF name → float64 (N, K)). ``act_order`` (GPTQ): each layer's inputs quantized in
    a seeded random order (desc_act), the same order for the projections of one input."""
    model = _hf_model(src)
    state = dict(model.state_dict())
    reference = {}
    orders: dict[tuple[str, int], torch.Tensor] = {}  # (layer, in_features) -> input order
    for name in list(state):
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or module.rpartition(".")[2] not in GPTQ_ORDER_OF_PROJECTIONS:
            continue
        weight = state.pop(name)
        group = group_size or weight.shape[1]
        order = None
        if act_order:
            key = (module.rpartition(".")[0] + module.rpartition(".")[2].replace("k_proj", "q_proj").replace(
                "v_proj", "q_proj").replace("up_proj", "gate_proj"), weight.shape[1])
            order = orders.setdefault(key, torch.randperm(weight.shape[1], generator=torch.Generator().manual_seed(
                len(orders))))
        if method == "gptq":
            tensors = gptq_pack(weight, group, symmetric, bits, order)
            if checkpoint_format == "gptq_v2":  # stored zeros are z itself
                z = torch.bitwise_and(tensors["qzeros"].unsqueeze(2) >> torch.arange(0, 32, bits).int(), 2 ** bits - 1)
                z = z + 1
                shifts = torch.arange(0, 32, bits, dtype=torch.int64)
                packed = ((z.to(torch.int64) & (2 ** bits - 1)) << shifts).sum(dim=2)
                tensors["qzeros"] = ((packed + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32)
            reference[name] = gptq_dequantize(gptq_pack(weight, group, symmetric, bits, order), bits)
        else:
            tensors = awq_pack(weight, group)
            reference[name] = awq_dequantize(tensors, group)
        state.update({f"{module}.{k}": v for k, v in tensors.items()})
    if method == "gptq":
        config = {"quant_method": "gptq", "bits": bits, "group_size": group_size or -1, "desc_act": act_order,
                  "sym": symmetric, "checkpoint_format": checkpoint_format}
    else:
        config = {"quant_method": "awq", "bits": 4, "group_size": group_size or -1, "zero_point": True,
                  "version": "gemm"}
    return _save(model, state, dst, config, src), reference


def write_hf_folder_from_gguf(gguf_path: Path, dst: Path) -> Path:
    """A float32 Hugging Face folder of a GGUF model (its weights dequantized as pagedllm loads them,
    its config and tokenizer), for the quantizing libraries, which read Hugging Face models."""
    from pagedllm.loader import load_model_files

    files = load_model_files(str(gguf_path))
    dst.mkdir(parents=True, exist_ok=True)
    state = dict(files.weights(torch.float32))
    if files.hf_config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(dst / "model.safetensors"))
    files.hf_config.architectures = files.hf_config.architectures or ["LlamaForCausalLM"]
    files.hf_config.save_pretrained(str(dst))
    files.tokenizer.save_pretrained(str(dst))
    if files.chat_template and not (dst / "chat_template.jinja").is_file():
        (dst / "chat_template.jinja").write_text(files.chat_template)
    return dst
