"""Tiny random base models with a tokenizer, and random PEFT adapters for them (saved as PEFT folders)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.family_utils import family_config, make_hf_model

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer ``t0``..``t{vocab_size-1}`` (t1 BOS, t2 EOS)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")), bos_token="t1",
                            eos_token="t2", unk_token="t0").save_pretrained(folder)


def write_base_folder(family: str, folder: Path, seed: int = 0):
    """(transformers model, folder the engine loads) for a tiny random ``family`` model."""
    config = family_config(family)
    config.architectures = [type(make_hf_model(config, seed)).__name__]
    model = make_hf_model(config, seed)
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder, config.vocab_size)
    return model, folder


def write_random_adapter(base, folder: Path, seed: int, r: int = 8, alpha: float = 16,
                         targets: list[str] | None = None, use_rslora: bool = False) -> Path:
    """A PEFT LoRA of ``base`` with random A and B (PEFT's own init leaves B zero), saved to ``folder``."""
    import copy

    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_TARGETS, lora_dropout=0.0,
                        use_rslora=use_rslora, init_lora_weights=False)
    model = get_peft_model(copy.deepcopy(base), config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 / p.shape[1] ** 0.5)
    model.save_pretrained(folder)
    return Path(folder)


def peft_logprobs(base, adapter: Path | None, token_ids: list[int], merged: bool = False) -> torch.Tensor:
    """log_softmax of the (adapted) model at every position of ``token_ids`` (float64 on CPU)."""
    import copy

    from peft import PeftModel

    model = copy.deepcopy(base)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).eval()
        if merged:
            model = model.merge_and_unload()
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)
