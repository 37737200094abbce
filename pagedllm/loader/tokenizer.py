"""Tokenizers: built from GGUF metadata or loaded from a Hugging Face folder, plus chat template.

No BPE is written here. A GGUF's vocabulary, merges, token types and special-token ids are
turned into a ``tokenizers`` pipeline by transformers' own GGUF converter
(``transformers.integrations.gguf``, the code behind ``AutoTokenizer.from_pretrained(folder,
gguf_file=...)``), and wrapped in a :class:`transformers.PreTrainedTokenizerFast`. One fix is
applied on top: the pre-tokenizer for vocabularies llama.cpp marks as splitting every digit
(``tokenizer.ggml.pre`` = ``smollm``, ``starcoder``, ...), which transformers leaves as plain
GPT-2 splitting — see :func:`_set_digit_split`.
"""

from __future__ import annotations

import struct
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast


# llama.cpp (src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_{STARCODER,REFACT,COMMAND_R,SMOLLM,CODESHELL,
# EXAONE,MINERVA}) splits these vocabularies with the regexes ["\p{N}", <GPT-2 regex>], i.e. every
# digit alone. SmolLM2's own tokenizer.json says the same: Sequence[Digits(individual_digits=true),
# ByteLevel(add_prefix_space=false, use_regex=true)]. (SmolLM2's vocabulary has no token mixing a
# digit with anything else, so its ids come out the same either way; a vocabulary with merges like
# "1 2" would not.)
_DIGIT_SPLIT_PRE_TYPES = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"})

# Token texts llama.cpp treats as end-of-generation in addition to tokenizer.ggml.eos/eot/eom_token_id
# (src/llama-vocab.cpp, "special_eog_ids" auto-detection).
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<｜end▁of▁sentence｜>",
})
_CONTROL, _USER_DEFINED = 3, 4  # gguf TokenType values


def load_gguf_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Build the fast tokenizer described by a GGUF file's ``tokenizer.*`` metadata.

    Special tokens (bos/eos/unk/pad), ``add_bos_token``/``add_eos_token`` and the chat template
    (``tokenizer.chat_template``) come from the file, so ``apply_chat_template`` works.
    Raises ValueError if the file has no tokenizer metadata or its tokenizer model
    (``tokenizer.ggml.model``) is unsupported.
    """
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
    # name_or_path must be a folder while constructing: for vocabularies over 100k tokens
    # transformers looks for <name_or_path>/config.json (its Mistral-regex check).
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, name_or_path=str(Path(path).parent),
                                        **tokenizer_config, **extra_kwargs)
    tokenizer.name_or_path = str(path)
    return tokenizer


def _set_digit_split(backend) -> None:
    """Make a byte-level BPE pre-tokenizer isolate every digit before the GPT-2 split."""
    from tokenizers import pre_tokenizers

    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])


def load_hf_tokenizer(folder: str | Path) -> PreTrainedTokenizerFast:
    """Load the tokenizer of a Hugging Face folder (tokenizer.json / tokenizer_config.json /
    chat_template.jinja) from local files only. Raises ``OSError`` naming the folder if the
    tokenizer files are missing.
    """
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        raise OSError(
            f"could not load a tokenizer from {str(folder)!r}: put tokenizer.json (and "
            f"tokenizer_config.json) in that folder, or pass tokenizer=<folder or .gguf>. ({e})") from e


def chat_template_of(tokenizer) -> str | None:
    """The tokenizer's chat template (Jinja source), or None. Multiple named templates → 'default'."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    return template or None


def gguf_end_of_generation_ids(metadata: dict, tokens: list[str], token_types: list[int]) -> tuple[int | None, list[int]]:
    """``(eos_token_id, stop_token_ids)`` the way llama.cpp decides end of generation.

    ``eos_token_id`` is ``tokenizer.ggml.eos_token_id``. ``stop_token_ids`` (sorted, without the
    eos id) are ``tokenizer.ggml.eot_token_id`` / ``eom_token_id`` plus every control or
    user-defined token whose text is a known end-of-turn marker (``<|im_end|>``,
    ``<|endoftext|>``, ``<end_of_turn>``, ``<|eot_id|>``, ...), as llama.cpp's
    ``special_eog_ids`` detection does. For SmolLM2: eos 2 (``<|im_end|>``), stops [0].
    """
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    stops = {metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")} - {None}
    stops |= {i for i, (text, kind) in enumerate(zip(tokens, token_types))
              if kind in (_CONTROL, _USER_DEFINED) and text in _EOG_TEXTS}
    stops.discard(eos)
    return (int(eos) if eos is not None else None), sorted(int(i) for i in stops)
