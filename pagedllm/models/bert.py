"""BERT encoders: :class:`BertModel` (sentence embeddings) and :class:`BertForSequenceClassification`
(cross-encoder rerankers), numerically transformers' classes. Input is a flat batch of T tokens of several
sequences packed without padding (``seq_lens``, positions from 0); attention runs per sequence, no KV cache.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.models.layers import Linear, pack_linears_for_cpu, unpack_linears
from pagedllm.models.layers.activation import get_activation

_QKV = re.compile(r"(.*\.attention\.self)\.(query|key|value)\.(weight|bias)$")
_IGNORED = ("embeddings.position_ids",)


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x + self.position_embeddings(positions))


class BertSelfAttention(nn.Module):
    """Fused q/k/v (``qkv``: (H, 3H)), scaled dot-product attention within each packed sequence."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.qkv = Linear(hidden_size, 3 * hidden_size)

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        qkv = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).permute(1, 2, 0, 3)
        out = torch.empty(self.num_heads, x.shape[0], self.head_dim, dtype=x.dtype, device=x.device)
        start = 0
        for n in seq_lens:  # 4-D (1, nh, n, hd): torch's fused CPU kernel takes only 4-D inputs
            q, k, v = qkv[:, None, :, start:start + n].unbind(0)
            out[:, start:start + n] = F.scaled_dot_product_attention(q, k, v)[0]
            start += n
        return out.transpose(0, 1).reshape(x.shape)


class BertDense(nn.Module):
    """``LayerNorm(dense(x) + residual)``: HF's ``BertSelfOutput`` / ``BertOutput``."""

    def __init__(self, in_features: int, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.dense = Linear(in_features, hidden_size)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        setattr(self, "self", BertSelfAttention(config.hidden_size, config.num_attention_heads))
        self.output = BertDense(config.hidden_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        return self.output(getattr(self, "self")(x, seq_lens), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.intermediate_size)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertDense(config.intermediate_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        x = self.attention(x, seq_lens)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertModel(nn.Module):
    """The encoder -> last hidden states (T, H); ``with_pooler`` keeps HF's ``pooler`` (dense + tanh, first token)."""

    is_encoder_only = True

    def __init__(self, config: Any, with_pooler: bool = False) -> None:
        super().__init__()
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type={config.position_embedding_type!r}: only absolute is supported")
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = _BertPooler(config.hidden_size) if with_pooler else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int],
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions, token_type_ids: (T,) int64 (types default 0); ``seq_lens`` sum to T -> (T, hidden)."""
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, seq_lens)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named weights in (query/key/value into ``qkv``), then pack the linears for CPU. Raises
        ValueError for an unknown name, a shape mismatch, or weights never given."""
        load_hf_weights(self, weights, skip_prefix="pooler." if self.pooler is None else None)


class _BertPooler(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.dense = Linear(hidden_size, hidden_size)

    def forward(self, first_tokens: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(first_tokens))


class BertForSequenceClassification(nn.Module):
    """A cross-encoder: :meth:`classify` returns the logits (N, num_labels) of each sequence from its [CLS] token."""

    is_encoder_only = True

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.bert = BertModel(config, with_pooler=True)
        self.classifier = Linear(config.hidden_size, config.num_labels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int],
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.bert(input_ids, positions, seq_lens, token_type_ids)

    def classify(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        starts = torch.tensor([0] + seq_lens[:-1], device=hidden.device).cumsum(0)
        return self.classifier(self.bert.pooler(hidden[starts]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_hf_weights(self, weights)


def load_hf_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                    skip_prefix: str | None = None) -> None:
    """Fill ``model``'s parameters from HF names (``bert.`` prefix accepted on a bare :class:`BertModel`).
    Raises ValueError naming the weight (unknown, wrong shape) or the missing ones."""
    unpack_linears(model)
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}
    for name, tensor in weights:
        if isinstance(model, BertModel) and name.startswith("bert."):
            name = name[len("bert."):]
        if name.endswith(_IGNORED) or (skip_prefix and name.startswith(skip_prefix)):
            continue
        target, key = _target(name, params)
        if target.shape != tensor.shape:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
        filled[key] = filled.get(key, 0) + target.numel()
    missing = sorted(n for n, p in params.items() if filled.get(n, 0) != p.numel())
    if missing:
        raise ValueError(f"weights missing from the checkpoint for {type(model).__name__}: {', '.join(missing[:8])}")
    pack_linears_for_cpu(model)


def _target(name: str, params: dict[str, nn.Parameter]) -> tuple[torch.Tensor, str]:
    if name in params:
        return params[name], name
    match = _QKV.match(name)
    if match is None or f"{match[1]}.qkv.{match[3]}" not in params:
        raise ValueError(f"unknown weight {name!r} for a BERT model (expected Hugging Face parameter names)")
    key = f"{match[1]}.qkv.{match[3]}"
    return params[key].chunk(3, dim=0)["query key value".split().index(match[2])], key
