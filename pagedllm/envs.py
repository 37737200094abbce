"""Every ``PAGEDLLM_*`` environment variable, parsed and documented in one place.

Nothing else in the package reads a ``PAGEDLLM_*`` variable (``tests/test_envs.py`` pins it). Each accessor
reads the environment when it is called (callers that run per kernel call cache the answer) and raises
ValueError naming the variable for a value it does not accept. ``docs/flags.md`` lists them for users.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    choices: tuple[str, ...] | None  # None: free text
    help: str


# name (after PAGEDLLM_) | default | choices ("*": free text; "-" stands for the empty value) | help
_TABLE = """
ATTENTION_BACKEND       | auto | auto torch cpu triton flashinfer | default of EngineConfig.attention_backend (the --attention-backend flag wins)
CACHE_DIR               |      | *               | where compiled C kernels and extracted model packages are cached (default ~/.cache/pagedllm)
CPU_FUSED_OPS           | 1    | 0 1             | 0: the fused residual+RMSNorm, rotary and gated-activation C kernels are off (torch code runs)
SKINNY_GEMM             |      | - 0 1           | decode-row linears in the skinny GEMM kernel: unset = where measured faster, 1 = always, 0 = never
CPU_FP32_MATMUL         | fp32 | fp32 bf16       | bf16: float32 models run their CPU linears with bfloat16 math (oneDNN)
CPU_FP32_PREFILL_LINEAR | auto | auto onednn blas | float32 linears of many rows: oneDNN's packed copy (auto: on non-Intel CPUs) or F.linear (BLAS)
CPU_PACKED_LINEAR       | 1    | 0 1             | 0: the CPU loader packs no linear for oneDNN or the skinny GEMM
GGUF_DOT_ISA            | auto | auto avx512 avx2 scalar | the GGUF block dot-product kernels' path: auto = the best this CPU runs (AVX512-VNNI, AVX2, portable C); a named path this CPU cannot run is an error
INT8_GEMM_ISA           | auto | auto avx512_vnni avx2 scalar | the W8A8 kernel's instruction set (auto: the best this CPU runs; a forced one it lacks is refused)
CPU_GRAPH_NATIVE_REPLAY | 1    | 0 1             | 0: a CPU decode graph replays its recorded kernel calls from Python, one ctypes call each (1: in one C loop, one OpenMP region per step)
ENGINE_CORES            |      | *               | CPU cores the engine's ranks share (default: all); set by the data-parallel launcher per replica
API_KEY                 |      | *               | the server's API key when --api-key is not given (clients send it as a Bearer token or x-api-key)
"""


def _parse(table: str) -> tuple[EnvVar, ...]:
    variables = []
    for line in table.strip().splitlines():
        name, default, choices, help_text = (cell.strip() for cell in line.split("|"))
        parsed = None if choices == "*" else tuple("" if c == "-" else c for c in choices.split())
        variables.append(EnvVar("PAGEDLLM_" + name, default, parsed, help_text + "."))
    return tuple(variables)


ALL: tuple[EnvVar, ...] = _parse(_TABLE)
(ATTENTION_BACKEND, CACHE_DIR, CPU_FUSED_OPS, SKINNY_GEMM, CPU_FP32_MATMUL, CPU_FP32_PREFILL_LINEAR,
 CPU_PACKED_LINEAR, GGUF_DOT_ISA, INT8_GEMM_ISA, CPU_GRAPH_NATIVE_REPLAY, ENGINE_CORES, API_KEY) = ALL


def read(var: EnvVar) -> str:
    """The variable's value (stripped; lower-cased when it has choices), or its default when unset
    or empty. Raises ValueError naming the variable when the value is not one of ``var.choices``."""
    value = os.environ.get(var.name, "").strip() or var.default
    if var.choices is None:
        return value
    value = value.lower()
    if value not in var.choices:
        shown = ", ".join(repr(c) for c in var.choices)
        raise ValueError(f"{var.name} must be one of {shown}, got {value!r}")
    return value


def attention_backend() -> str:
    return read(ATTENTION_BACKEND)


def cache_dir() -> Path:
    return Path(read(CACHE_DIR) or Path.home() / ".cache" / "pagedllm")


def cpu_fused_ops() -> bool:
    return read(CPU_FUSED_OPS) != "0"


def cpu_graph_native_replay() -> bool:
    return read(CPU_GRAPH_NATIVE_REPLAY) != "0"


def skinny_gemm() -> bool | None:
    """True: forced on, False: off, None: the default rule."""
    value = read(SKINNY_GEMM)
    return None if value == "" else value == "1"


def cpu_fp32_matmul_in_bf16() -> bool:
    return read(CPU_FP32_MATMUL) == "bf16"


def cpu_fp32_prefill_linear() -> str:
    return read(CPU_FP32_PREFILL_LINEAR)


def cpu_packed_linear() -> bool:
    return read(CPU_PACKED_LINEAR) != "0"


def gguf_dot_isa() -> str:
    return read(GGUF_DOT_ISA)


def int8_gemm_isa() -> str:
    return read(INT8_GEMM_ISA)


def engine_cores() -> int | None:
    """Cores given to the engine, or None when unset. Raises ValueError for a non-positive or non-integer value."""
    value = read(ENGINE_CORES)
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{ENGINE_CORES.name} must be a positive integer, got {value!r}")
    return int(value)


def api_key() -> str | None:
    return read(API_KEY) or None
