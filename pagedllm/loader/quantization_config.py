"""A Hugging Face folder's ``quantization_config`` (config.json), parsed and validated (no torch).

Read: compressed-tensors (``int-quantized`` W8A8 / W8A16, ``pack-quantized`` and ``naive-quantized``
W4A16 / W8A16, symmetric or with zero points), GPTQ (4 or 8 bits, ``gptq`` / ``gptq_v2`` zeros,
act-order) and AWQ (GEMM packing). Anything else raises ValueError naming the field and the supported values:
packed tensors are never loaded as float weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

SUPPORTED_QUANT_METHODS = ("compressed-tensors", "gptq", "awq")
COMPRESSED_TENSORS_FORMATS = ("int-quantized", "pack-quantized", "naive-quantized")
_FIELD = "quantization_config"


@dataclass(frozen=True)
class WeightScheme:
    """How one projection's weight is stored.

    ``group_size`` None: one scale per output channel (a per-tensor scale is spread over the
    channels). ``dynamic_int8_activations``: W8A8, activations quantized per token at run time.
    ``format``: compressed-tensors' format, ``gptq`` / ``gptq_v2`` (stored zeros minus one or not),
    or ``gemm`` (AWQ). ``has_act_order``: the inputs' groups are given by a ``g_idx`` tensor (GPTQ
    ``desc_act``, compressed-tensors ``actorder: group``), not by ``input // group_size``.
    """

    bits: int
    group_size: int | None
    symmetric: bool
    format: str
    strategy: str = "group"
    dynamic_int8_activations: bool = False
    has_act_order: bool = False

    def describe(self) -> str:
        acts = "A8 dynamic per token" if self.dynamic_int8_activations else "A16"
        group = f"group {self.group_size}" if self.group_size else "per channel"
        zeros = "symmetric" if self.symmetric else "zero points"
        return f"W{self.bits}{acts}, {group}, {zeros}"


@dataclass(frozen=True)
class CheckpointQuantization:
    """The checkpoint's format: ``schemes`` in config order as (targets, scheme), ``ignore`` names.

    Targets and ignore entries follow compressed-tensors: ``Linear`` (every projection), an exact
    module name, or ``re:<regex>`` matched from the start of the name.
    """

    quant_method: str
    schemes: tuple[tuple[tuple[str, ...], WeightScheme], ...]
    ignore: tuple[str, ...] = ()

    def scheme_for(self, module_name: str) -> WeightScheme | None:
        """The scheme of Hugging Face module ``module_name`` (e.g. ``model.layers.0.self_attn.q_proj``),
        None when it is ignored or no group targets it (a float weight)."""
        if any(_matches(module_name, pattern) for pattern in self.ignore):
            return None
        for targets, scheme in self.schemes:
            if any(_matches(module_name, target) for target in targets):
                return scheme
        return None

    def describe(self) -> str:
        schemes = "; ".join(dict.fromkeys(s.describe() for _, s in self.schemes))
        return f"{self.quant_method} ({schemes})"


def _matches(name: str, target: str) -> bool:
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def parse_quantization_config(raw: Any) -> CheckpointQuantization | None:
    """``config.quantization_config`` (a dict, or an object with ``to_dict``) → the checkpoint's format;
    None when absent. Raises ValueError naming the field for anything pagedllm cannot load exactly."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else vars(raw)
    method = str(raw.get("quant_method", "")).lower().replace("_", "-")
    if method == "compressed-tensors":
        return _compressed_tensors(raw)
    if method == "gptq":
        return _gptq(raw)
    if method == "awq":
        return _awq(raw)
    raise ValueError(f"{_FIELD}.quant_method {raw.get('quant_method')!r} in config.json is not supported "
                     f"(supported: {', '.join(SUPPORTED_QUANT_METHODS)}); use a float checkpoint or one of those")


def _refuse(field: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"{_FIELD}.{field} {value!r} is not supported (supported: {supported})")


# -- compressed-tensors ------------------------------------------------------------------------

def _compressed_tensors(raw: dict) -> CheckpointQuantization:
    for field in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if raw.get(field):
            raise _refuse(field, raw[field], "empty or null")
    groups = raw.get("config_groups") or {}
    if not groups:
        raise ValueError(f"{_FIELD}.config_groups is empty: a compressed-tensors checkpoint names its schemes there")
    schemes = []
    for name, group in groups.items():
        field = f"config_groups.{name}"
        targets = tuple(group.get("targets") or ())
        if not targets:
            raise ValueError(f"{_FIELD}.{field}.targets is empty")
        fmt = group.get("format") or raw.get("format")
        schemes.append((targets, _ct_scheme(group, fmt, field)))
    return CheckpointQuantization("compressed-tensors", tuple(schemes), tuple(raw.get("ignore") or ()))


def _ct_scheme(group: dict, fmt: str | None, field: str) -> WeightScheme:
    if fmt not in COMPRESSED_TENSORS_FORMATS:
        raise _refuse(f"{field}.format", fmt, ", ".join(COMPRESSED_TENSORS_FORMATS))
    if group.get("output_activations"):
        raise _refuse(f"{field}.output_activations", group["output_activations"], "null")
    weights = group.get("weights") or {}
    if weights.get("type", "int") != "int":
        raise _refuse(f"{field}.weights.type", weights.get("type"), "'int' (float weights such as FP8 are not read)")
    bits = weights.get("num_bits")
    if bits not in (4, 8):
        raise _refuse(f"{field}.weights.num_bits", bits, "4, 8")
    strategy = weights.get("strategy", "tensor")
    if strategy not in ("tensor", "channel", "group"):
        raise _refuse(f"{field}.weights.strategy", strategy, "tensor, channel, group")
    if weights.get("dynamic", False):
        raise _refuse(f"{field}.weights.dynamic", weights["dynamic"], "false")
    symmetric = bool(weights.get("symmetric", True))
    if bits == 8 and not symmetric:
        raise _refuse(f"{field}.weights.symmetric", False, "true for 8-bit weights")
    if fmt == "int-quantized" and bits != 8:
        raise _refuse(f"{field}.weights.num_bits", bits, "8 in the int-quantized format")
    group_size = weights.get("group_size") if strategy == "group" else None
    if strategy == "group" and (not isinstance(group_size, int) or group_size <= 0):
        raise _refuse(f"{field}.weights.group_size", group_size, "a positive integer with strategy 'group'")
    return WeightScheme(bits=bits, group_size=group_size, symmetric=symmetric, format=fmt, strategy=strategy,
                        dynamic_int8_activations=_ct_activations(group.get("input_activations"), field),
                        has_act_order=weights.get("actorder") == "group")


def _ct_activations(acts: dict | None, field: str) -> bool:
    """True for int8 activations quantized per token at run time (W8A8); False for none."""
    if not acts:
        return False
    wanted = {"type": "int", "num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": True}
    for key, value in wanted.items():
        if acts.get(key, None) != value:
            raise _refuse(f"{field}.input_activations.{key}", acts.get(key),
                          f"{value!r} (int8 activations quantized per token at run time, or none)")
    return True


# -- GPTQ and AWQ ------------------------------------------------------------------------------

def _gptq(raw: dict) -> CheckpointQuantization:
    bits = raw.get("bits")
    if bits not in (4, 8):
        raise _refuse("bits", bits, "4, 8")
    fmt = raw.get("checkpoint_format", "gptq") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("checkpoint_format", fmt, "gptq, gptq_v2")
    symmetric = bool(raw.get("sym", True))
    if bits == 8 and not symmetric:
        raise _refuse("sym", False, "true for 8-bit weights")
    if raw.get("dynamic"):
        raise _refuse("dynamic", raw["dynamic"], "empty (one scheme for every layer)")
    scheme = WeightScheme(bits=bits, group_size=_group_size(raw.get("group_size", 128)), symmetric=symmetric,
                          format=fmt, has_act_order=bool(raw.get("desc_act", False)))
    ignore = () if raw.get("lm_head", False) else ("lm_head",)
    return CheckpointQuantization("gptq", ((("Linear",), scheme),), ignore)


def _awq(raw: dict) -> CheckpointQuantization:
    bits = raw.get("bits", raw.get("w_bit", 4))
    if bits != 4:
        raise _refuse("bits", bits, "4")
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("version", raw.get("version"), "gemm (GEMV and Marlin packings are not read)")
    group_size = _group_size(raw.get("group_size", raw.get("q_group_size", 128)))
    scheme = WeightScheme(bits=4, group_size=group_size, symmetric=not raw.get("zero_point", True), format="gemm")
    not_converted = tuple(f"re:.*{re.escape(m)}" for m in raw.get("modules_to_not_convert") or ())
    return CheckpointQuantization("awq", ((("Linear",), scheme),), ("lm_head",) + not_converted)


def _group_size(value: Any) -> int | None:
    """GPTQ/AWQ ``group_size``: -1 means one group per output channel."""
    if value == -1:
        return None
    if not isinstance(value, int) or value <= 0:
        raise _refuse("group_size", value, "a positive integer or -1")
    return value
