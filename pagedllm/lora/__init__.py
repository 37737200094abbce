"""Multi-LoRA serving: adapters over one base model, rows of different adapters in one forward.

``LoRARequest`` (pure Python) is what callers pass; the rest needs torch: ``adapter`` (PEFT folders,
validated), ``layer`` (the batched LoRA op on a projection), ``manager`` (host LRU and device slots).
"""

from pagedllm.lora.request import LoRAError, LoRAInUseError, LoRARequest

__all__ = ["LoRAError", "LoRAInUseError", "LoRARequest"]
