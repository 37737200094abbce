"""The Llama family (Llama 2/3, SmolLM2, TinyLlama, ...) and the decoder every dense family builds on.

transformers' ``LlamaForCausalLM`` restructured for serving: a flat batch of T tokens (no
padding; the step's ``AttentionMetadata`` says which request each belongs to), q/k/v and
gate/up fused into one matmul each, the residual add fused into the next RMSNorm (nano-vllm).
Other families override the hooks (``_attention``, ``_mlp``, ``_decoder_layer``, ...)."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from pagedllm import envs
from pagedllm.attention import AttentionBackend, TorchPagedAttention
from pagedllm.models.layer_types import layer_types, sliding_windows
from pagedllm.distributed.parallel_state import heads_per_rank
from pagedllm.models.layers import (GatedMLP, MergedLinear, ParallelLMHead, RMSNorm, RotaryEmbedding, SelfAttention,
                                    VocabParallelEmbedding, pack_linears_for_cpu, unpack_linears)
from pagedllm.models.layers.rotary import rope_parameters
from pagedllm.loader.model_files import max_model_len_of

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints still carry
DEFAULT_ROPE = "default"


def _rank_part(module: nn.Module | None, name: str, tensor: torch.Tensor, param_name: str,
               shard: int | None) -> torch.Tensor:
    """The part of checkpoint tensor ``name`` this rank holds: a tensor-parallel layer's
    ``checkpoint_slice`` (ValueError naming the weight for a wrong shape), else all of it."""
    if not hasattr(module, "checkpoint_slice"):
        return tensor
    try:
        return module.checkpoint_slice(tensor, param_name, shard)
    except ValueError as e:
        raise ValueError(f"weight {name!r} {e}") from None


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``+ mlp(norm(x))``; ``mlp`` dense or mixture-of-experts."""

    def __init__(self, self_attn: SelfAttention, mlp: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                cos_sin: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden, residual (T, hidden) (residual None at the first layer) -> (mlp_out, residual).
        Sub-modules are called through ``forward``: no hook dispatch per layer."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm.forward(hidden)
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        self_attn = self.self_attn
        hidden = self_attn.forward(hidden, cos_sin[self_attn.rope_key])
        hidden, residual = self.post_attention_layernorm.forward(hidden, residual)
        return self.mlp.forward(hidden), residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers and the final norm (the HF ``model.`` prefix)."""

    def __init__(self, embed_tokens: nn.Module, layers: list[nn.Module], norm: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def forward(self, input_ids: torch.Tensor, cos_sin: dict[str, torch.Tensor]) -> torch.Tensor:
        """input_ids: (T,) int64, cos_sin: rotary rows per table, each (T, 2, rotary_dim) -> (T, hidden)."""
        return self.forward_layers(self.embed_tokens(input_ids), cos_sin)

    def forward_layers(self, hidden: torch.Tensor, cos_sin: dict[str, torch.Tensor]) -> torch.Tensor:
        """The layers and the final norm of :meth:`forward`: hidden (T, hidden) embeddings -> (T, hidden).
        ``hidden`` may be overwritten (the first layer's residual stream is it)."""
        residual = None
        for layer in self.layers:
            hidden, residual = layer.forward(hidden, residual, cos_sin)  # no per-layer hook dispatch
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """A Llama-architecture causal LM over the paged KV cache.

    Args:
        config: a transformers config with the Llama fields.
        dtype: parameter and activation dtype; device: where they live.
        attn_backend: the backend every layer binds (the runner's); default :class:`TorchPagedAttention`.

    Parameters are uninitialized until :meth:`load_weights`. With tensor parallelism
    ``num_heads``/``num_kv_heads`` are this rank's, ``total_num_heads``/``total_num_kv_heads``
    the model's. Raises ValueError for config values not implemented (rope type, activation)."""

    norm_class: type[nn.Module] = RMSNorm
    # HF projection -> (fused module, shard index): checkpoints store q/k/v and gate/up apart.
    packed_modules: dict[str, tuple[str, int]] = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_layers = config.num_hidden_layers
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = getattr(config, "num_key_value_heads", None) or self.total_num_heads
        self.num_heads, self.num_kv_heads = heads_per_rank(self.total_num_heads, self.total_num_kv_heads)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.total_num_heads
        self.vocab_size = config.vocab_size
        self.max_positions = max(config.max_position_embeddings, max_model_len_of(config))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.sliding_windows = sliding_windows(config)
        self.rope_keys = self._rope_keys(config)
        rotary = {key: RotaryEmbedding.from_config(config, self.head_dim, self.max_positions, dtype, self.device,
                                                   None if key == DEFAULT_ROPE else key)
                  for key in dict.fromkeys(self.rope_keys)}
        backend = attn_backend if attn_backend is not None else TorchPagedAttention()
        with torch.device("meta"):  # no time spent initialising weights load_weights overwrites
            layers = [self._decoder_layer(config, i, backend) for i in range(self.num_layers)]
            norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
            embed = VocabParallelEmbedding(config.vocab_size, config.hidden_size, self._embedding_scale(config))
            self.model = DecoderModel(embed, layers, norm)
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, self._final_logit_soft_cap(config))
            self.to(dtype)
        self.to_empty(device=self.device)
        self.requires_grad_(False)  # inference only
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary_embs = nn.ModuleDict(rotary)


    def _decoder_layer(self, config: Any, layer_idx: int, backend: AttentionBackend) -> nn.Module:
        norm = self.norm_class
        return DecoderLayer(self._attention(config, layer_idx, backend), self._mlp(config, layer_idx),
                            norm(config.hidden_size, config.rms_norm_eps), norm(config.hidden_size, config.rms_norm_eps))

    def _attention(self, config: Any, layer_idx: int, backend: AttentionBackend, **options: Any) -> SelfAttention:
        """The layer's attention; ``options`` are :class:`SelfAttention` keywords a family sets."""
        bias = bool(getattr(config, "attention_bias", False))
        options = {"qkv_bias": bias, "o_bias": bias, **options}
        return SelfAttention(config.hidden_size, self.total_num_heads, self.total_num_kv_heads, self.head_dim, backend,
                             sliding_window=self.sliding_windows[layer_idx], rope_key=self.rope_keys[layer_idx],
                             **options)

    def _mlp(self, config: Any, layer_idx: int) -> nn.Module:
        act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None) or "silu"
        return GatedMLP(config.hidden_size, config.intermediate_size, act, bool(getattr(config, "mlp_bias", False)))

    def _embedding_scale(self, config: Any) -> float | None:
        return None

    def _final_logit_soft_cap(self, config: Any) -> float | None:
        return None

    def _rope_keys(self, config: Any) -> list[str]:
        """Which rotary table each layer uses: one per layer type when the config's rope
        parameters are given per layer type (Gemma 3), else one shared table."""
        params = getattr(config, "rope_parameters", None) or {}
        types = layer_types(config)
        if all(isinstance(params.get(t), dict) for t in types):
            for t in set(types):
                rope_parameters(config, t)  # validate the rope type early
            return types
        rope_parameters(config)
        return [DEFAULT_ROPE] * self.num_layers


    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions (T,) int64 -> (T, hidden_size) final hidden states. Without step
        metadata (``set_forward_context(None)``) the tokens are one causal sequence, no cache touched."""
        return self.model(input_ids, self.rope_rows(positions))

    def rope_rows(self, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """positions (T,) int64 -> each rotary table's rows, (T, 2, rotary_dim), shared by the layers."""
        return {key: emb.lookup(positions) for key, emb in self.rotary_embs.items()}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (N, hidden_size) -> logits (N, vocab_size) float32."""
        return self.lm_head(hidden)

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Layer i gets ``kv_caches[i]`` (2, num_blocks, block_size, num_kv_heads, head_dim); [] unbinds.
        Raises ValueError for a wrong count or layout."""
        layers = self.model.layers
        if kv_caches and len(kv_caches) != len(layers):
            raise ValueError(f"kv_caches must have one tensor per layer ({len(layers)}), got {len(kv_caches)}")
        for i, layer in enumerate(layers):
            cache = kv_caches[i] if kv_caches else None
            if cache is not None and (cache.dim() != 5 or cache.shape[0] != 2
                                      or tuple(cache.shape[3:]) != (self.num_kv_heads, self.head_dim)):
                raise ValueError(f"kv_caches[{i}] must be [2, num_blocks, block_size, {self.num_kv_heads}, "
                                 f"{self.head_dim}], got {tuple(cache.shape)}")
            layer.self_attn.attn.kv_cache = cache


    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters in the model dtype.

        Raises ValueError for an unknown name, a shape mismatch (both shapes named), or the
        parameters never filled."""
        unpack_linears(self)
        params = dict(self.named_parameters(remove_duplicate=False))
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            target, tensor = self._weight_target(name, tensor, params, modules)
            if target.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(name)
        if self.tie_word_embeddings and loaded & {"model.embed_tokens.weight", "lm_head.weight"}:
            loaded |= {"model.embed_tokens.weight", "lm_head.weight"}
        missing = self._missing_weights(modules, loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
            raise ValueError(f"weights missing from the checkpoint for {type(self).__name__}: {shown}")
        if envs.cpu_packed_linear():
            self.pack_linears_for_cpu(bf16_math=envs.cpu_fp32_matmul_in_bf16())

    def pack_linears_for_cpu(self, batch_hint: int = 64, bf16_math: bool = False) -> int:
        """Prepack every projection on CPU (:class:`Linear`); returns how many were packed."""
        return pack_linears_for_cpu(self, batch_hint, bf16_math)

    def unpack_linears(self) -> None:
        """Undo :meth:`pack_linears_for_cpu` (plain weights back in the parameters)."""
        unpack_linears(self)

    def _weight_target(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter],
                       modules: dict[str, nn.Module]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the parameter or fused-parameter rows an HF weight fills, the part of the weight
        this rank holds: a tensor-parallel layer's ``checkpoint_slice``, else all of it)."""
        module_path, _, param_name = name.rpartition(".")
        if name in params:
            return params[name], _rank_part(modules.get(module_path), name, tensor, param_name, None)
        parent, _, leaf = module_path.rpartition(".")
        if leaf in self.packed_modules:
            fused_name, shard = self.packed_modules[leaf]
            fused = modules.get(f"{parent}.{fused_name}")
            if isinstance(fused, MergedLinear) and hasattr(fused, param_name):
                return (fused.shard(getattr(fused, param_name), shard),
                        _rank_part(fused, name, tensor, param_name, shard))
        raise ValueError(f"unknown weight {name!r} for {type(self).__name__} ({self.num_layers} layers; "
                         f"expected Hugging Face parameter names)")

    def _missing_weights(self, modules: dict[str, nn.Module], loaded: set[str]) -> list[str]:
        """HF names of the parameters not filled: a fused parameter loaded whole counts as
        filled, else each of its parts (``q_proj``, ...) must have been given."""
        parts_of: dict[str, list[str]] = {}
        for leaf, (fused_name, _) in self.packed_modules.items():
            parts_of.setdefault(fused_name, []).append(leaf)
        missing = []
        for name, _ in self.named_parameters(remove_duplicate=False):
            if name in loaded:
                continue
            module_path, _, param_name = name.rpartition(".")
            parent, _, leaf = module_path.rpartition(".")
            if isinstance(modules.get(module_path), MergedLinear) and leaf in parts_of:
                parts = [f"{parent}.{p}.{param_name}" for p in parts_of[leaf]]
                absent = [part for part in parts if part not in loaded]
                if len(absent) < len(parts):  # given in parts, some missing
                    missing += absent
                elif absent:
                    missing.append(f"{name} (or its parts {', '.join(parts_of[leaf])})")
            else:
                missing.append(name)
        return sorted(missing)
