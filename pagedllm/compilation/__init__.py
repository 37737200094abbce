"""Opt-in torch.compile of the model around the paged-attention op (vLLM's ``compilation_config``)."""
