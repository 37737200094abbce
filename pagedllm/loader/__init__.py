"""Model loading: GGUF files, Hugging Face folders, tokenizer, chat template, aliases.

    files = load_model_files("smollm2-135m-instruct")   # or a .gguf path, or an HF folder
    files.hf_config, files.tokenizer, files.chat_template, files.max_model_len
    for name, tensor in files.weights(torch.float32): ...   # HF names, dense, one at a time

``resolve`` imports no torch; the rest imports torch, transformers and gguf.
"""

from pagedllm.loader.model_files import ModelFiles, load_model_files, max_model_len_of
from pagedllm.loader.resolve import KNOWN_MODELS, ModelNotFoundError, ResolvedModel, resolve_model

__all__ = ["KNOWN_MODELS", "ModelFiles", "ModelNotFoundError", "ResolvedModel", "load_model_files",
           "max_model_len_of", "resolve_model"]
