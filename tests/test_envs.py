"""``pagedllm.envs`` is the one reader of ``PAGEDLLM_*`` variables, and each accessor checks its value."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pagedllm import envs

PACKAGE = Path(__file__).resolve().parents[1] / "pagedllm"

# accessor, {raw value: parsed}, bad values; every variable in envs.ALL has a row
CASES = {
    envs.ATTENTION_BACKEND: (envs.attention_backend, {"": "auto", " CPU ": "cpu", "flashinfer": "flashinfer"}, ["cuda"]),
    envs.CACHE_DIR: (envs.cache_dir, {"/tmp/kernels": Path("/tmp/kernels")}, []),
    envs.CPU_FUSED_OPS: (envs.cpu_fused_ops, {"": True, "1": True, "0": False}, ["yes", "2"]),
    envs.SKINNY_GEMM: (envs.skinny_gemm, {"": None, "1": True, "0": False}, ["yes"]),
    envs.CPU_FP32_MATMUL: (envs.cpu_fp32_matmul_in_bf16, {"": False, "fp32": False, "BF16": True}, ["fp16"]),
    envs.CPU_FP32_PREFILL_LINEAR: (envs.cpu_fp32_prefill_linear, {"": "auto", "onednn": "onednn", "blas": "blas"},
                                   ["mkl"]),
    envs.CPU_PACKED_LINEAR: (envs.cpu_packed_linear, {"": True, "0": False, "1": True}, ["off"]),
    envs.GGUF_DOT_ISA: (envs.gguf_dot_isa, {"": "auto", "AVX2": "avx2", "scalar": "scalar"}, ["sse", "amx"]),
    envs.INT8_GEMM_ISA: (envs.int8_gemm_isa, {"": "auto", "AVX2": "avx2", "scalar": "scalar",
                                              "avx512_vnni": "avx512_vnni"}, ["amx", "sse"]),
    envs.CPU_GRAPH_NATIVE_REPLAY: (envs.cpu_graph_native_replay, {"": True, "1": True, "0": False}, ["off"]),
    envs.ENGINE_CORES: (envs.engine_cores, {"": None, "4": 4, " 12 ": 12}, ["0", "-2", "four", "2.5"]),
    envs.API_KEY: (envs.api_key, {"": None, "sk-1": "sk-1"}, []),
}


def _env_name_literals(path: Path) -> list[str]:
    """Where ``path`` spells a ``PAGEDLLM_`` name in a string (an f-string's text included)."""
    return [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("PAGEDLLM_")]


def test_only_envs_names_a_pagedllm_variable():
    """A ``"PAGEDLLM_..."`` string outside envs.py is a second reader (or writer) of the environment;
    use the accessor, or ``envs.<VAR>.name`` to set one for a child process. C macros are not variables."""
    offenders = [where for path in sorted(PACKAGE.rglob("*.py")) if path.name != "envs.py"
                 for where in _env_name_literals(path)]
    assert offenders == []


def test_every_variable_is_listed_and_tested():
    names = [var.name for var in envs.ALL]
    assert len(names) == len(set(names)) and all(name.startswith("PAGEDLLM_") for name in names)
    assert set(CASES) == set(envs.ALL)
    for var in envs.ALL:
        assert var.default == "" or var.choices is None or var.default in var.choices, var.name


@pytest.mark.parametrize("var", envs.ALL, ids=lambda var: var.name)
def test_accessor_parses_its_values(var, monkeypatch):
    accessor, parsed, _ = CASES[var]
    monkeypatch.delenv(var.name, raising=False)
    default = accessor()
    for raw, expected in parsed.items():
        monkeypatch.setenv(var.name, raw)
        assert accessor() == expected, (var.name, raw)
    if "" in parsed:
        assert default == parsed[""]  # unset reads as the default, as an empty value does


@pytest.mark.parametrize("var", [var for var in envs.ALL if CASES[var][2]], ids=lambda var: var.name)
def test_accessor_refuses_a_bad_value_naming_the_variable(var, monkeypatch):
    accessor, _, bad_values = CASES[var]
    for raw in bad_values:
        monkeypatch.setenv(var.name, raw)
        with pytest.raises(ValueError, match=var.name):
            accessor()


def test_cache_dir_defaults_to_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(envs.CACHE_DIR.name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert envs.cache_dir() == tmp_path / ".cache" / "pagedllm"
