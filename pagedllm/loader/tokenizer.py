"""Tokenizers from GGUF metadata (via ``transformers.integrations.gguf``) or an HF folder, plus chat template."""

from __future__ import annotations

import struct
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast


# llama.cpp (src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_*) splits every digit alone in these
# vocabularies; transformers' converter leaves them as plain GPT-2 splitting.
_DIGIT_SPLIT_PRE_TYPES = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"})

# End-of-generation token texts, from llama.cpp's "special_eog_ids" detection (src/llama-vocab.cpp).
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<｜end▁of▁sentence｜>",
})
_CONTROL, _USER_DEFINED = 3, 4  # gguf TokenType values


def load_gguf_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """The fast tokenizer of a GGUF's metadata. Raises ValueError if missing or of an unsupported model."""
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError as e:
        raise ImportError("building a tokenizer from GGUF metadata needs transformers>=5 "
                          "(transformers.integrations.gguf); upgrade it with `pip install -U transformers`") from e

    try:
        architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(path))
        backend, extra_kwargs = convert_gguf_tokenizer(architecture, tokenizer_dict)
    except (KeyError, ValueError, struct.error) as e:
        raise ValueError(f"could not build a tokenizer from the GGUF metadata of {str(path)!r}: {e!r}") from e
    pre_type = tokenizer_dict.get("pre_tokenizer_type")
    if tokenizer_dict.get("tokenizer_type") == "gpt2" and pre_type in _DIGIT_SPLIT_PRE_TYPES:
        _set_digit_split(backend)
    # a folder while constructing: over 100k tokens, transformers reads <name_or_path>/config.json
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, name_or_path=str(Path(path).parent),
                                        **tokenizer_config, **extra_kwargs)
    tokenizer.name_or_path = str(path)
    return tokenizer


def _set_digit_split(backend) -> None:
    from tokenizers import pre_tokenizers

    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])


def load_hf_tokenizer(folder: str | Path) -> PreTrainedTokenizerFast:
    """The tokenizer of a local HF folder. Raises OSError naming the folder if its files are missing."""
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        raise OSError(
            f"could not load a tokenizer from {str(folder)!r}: put tokenizer.json (and "
            f"tokenizer_config.json) in that folder, or pass tokenizer=<folder or .gguf>. ({e})") from e


def chat_template_of(tokenizer) -> str | None:
    """The tokenizer's chat template (Jinja source; of several named ones, 'default'), or None."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    return template or None


def gguf_end_of_generation_ids(metadata: dict, tokens: list[str], token_types: list[int]) -> tuple[int | None, list[int]]:
    """``(eos_token_id, stop_token_ids)`` as llama.cpp decides end of generation.

    Stops (sorted, without eos): the eot/eom ids plus control or user-defined tokens in ``_EOG_TEXTS``.
    """
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    stops = {metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")} - {None}
    stops |= {i for i, (text, kind) in enumerate(zip(tokens, token_types))
              if kind in (_CONTROL, _USER_DEFINED) and text in _EOG_TEXTS}
    stops.discard(eos)
    return (int(eos) if eos is not None else None), sorted(int(i) for i in stops)
