"""The Llama family (Llama 2/3, SmolLM2, TinyLlama, ...) in plain PyTorch over the paged KV cache.

Numerically the same model as transformers' ``LlamaForCausalLM`` (RMSNorm, neox-style
rotary embeddings with the config's base and rope scaling, grouped-query attention,
SwiGLU MLP, tied or untied output embedding), restructured for serving:

- it takes a flat batch of T tokens (no padding, no batch axis) with their positions;
  which request each token belongs to is in the step's ``AttentionMetadata``, read by the
  attention layers from the forward context;
- q/k/v and gate/up projections are fused into one matmul each (``qkv_proj``,
  ``gate_up_proj``); :meth:`LlamaForCausalLM.load_weights` takes Hugging Face names and
  fills the fused parameters;
- the residual add is fused into the following RMSNorm call (nano-vllm's layout).
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention import Attention, AttentionBackend, TorchPagedAttention

_SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
_PACKED_LINEAR_ENV = "PAGEDLLM_CPU_PACKED_LINEAR"


class Linear(nn.Linear):
    """``nn.Linear`` that can run from a oneDNN-prepacked copy of its weight on CPU.

    :meth:`pack_for_cpu` reorders the weight once into oneDNN's blocked layout (the same
    prepacking torch.compile's CPU freezing pass does); forward then calls the oneDNN
    linear directly instead of re-packing the weight inside every matmul. Measured on this
    project's 2-core AVX-512 machine at 64 tokens (SmolLM2 shapes, one thread): each matmul
    20-40 % faster in float32 (the 49152-row lm_head 58 -> 36 ms) and 15-25 % in bfloat16;
    a whole batch-64 decode step 19 % (float32) and 16 % (bfloat16) faster.

    The packed copy lives on the CPU: pack after the model reaches its device (as
    ``load_weights`` does), not before a ``.to("cuda")``.
    """

    packed_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, in_features) -> (T, out_features)."""
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def pack_for_cpu(self, batch_hint: int) -> bool:
        """Prepack the weight for oneDNN (CPU, float32/bfloat16 only); returns whether it did.

        The packed copy is extra memory (one more copy of the weight); ``self.weight``
        stays valid, but the packed copy does not follow later in-place edits of it: call
        this again (``load_weights`` does) after changing weights.
        """
        w = self.weight
        if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16) \
                or not torch.backends.mkldnn.is_available():
            return False
        try:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_hint)
        except (RuntimeError, AttributeError):  # a torch build without this private op: stay plain
            self.packed_weight = None
        return self.packed_weight is not None

    def unpack(self) -> None:
        """Back to the plain ``F.linear`` path."""
        self.packed_weight = None


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich, 2019), optionally fused with a residual add.

    ``forward(x)`` returns ``weight * x / sqrt(mean(x**2) + eps)`` (statistics in float32),
    x: (T, hidden). ``forward(x, residual)`` first adds ``residual`` and returns
    ``(normed, x + residual)`` — the new residual stream.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual  # in the model dtype, as transformers does
            residual = x
        out = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight
        return out if residual is None else (out, residual)


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's rotary-embedding parameters as one dict with ``rope_type`` and ``rope_theta``.

    transformers >= 5 keeps them in ``config.rope_parameters``; 4.x in ``config.rope_theta`` and
    ``config.rope_scaling`` (whose type key may be ``type``). Raises ValueError for rope types
    this model does not implement.
    """
    params = getattr(config, "rope_parameters", None)
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(_SUPPORTED_ROPE_TYPES)})")
    params["rope_type"] = rope_type
    return params


def rope_inv_freq(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (head_dim // 2,) float32 and the cos/sin scale ("attention factor").

    ``default``: ``1 / theta ** (2i / head_dim)`` (Su et al., RoFormer). Scaled types
    (``linear``, ``dynamic``, ``yarn``, ``llama3``) use transformers' own init functions so
    the frequencies match the reference exactly. ``dynamic`` (NTK) is evaluated at the
    model's trained length, i.e. unscaled: transformers rescales only past
    ``max_position_embeddings``, which a served sequence never reaches here.
    """
    params = rope_parameters(config)
    if params["rope_type"] == "default":
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (float(params["rope_theta"]) ** exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"))
    return inv_freq.float(), float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary position embedding with a precomputed cos/sin table.

    The table ``cos_sin`` is (max_positions, 2, head_dim) in the model dtype: row p holds
    ``cat(cos, cos)`` and ``cat(-sin, sin)`` of ``p * inv_freq`` (times the attention
    factor), so rotating is ``x * cos + roll(x, head_dim / 2) * sin`` — equal to
    transformers' ``x * cos + rotate_half(x) * sin``.
    """

    def __init__(self, inv_freq: torch.Tensor, attention_factor: float, max_positions: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq.float())  # (max_positions, head_dim // 2)
        cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
        table = torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], 1)  # (max_pos, 2, head_dim)
        self.register_buffer("cos_sin", table.to(dtype=dtype, device=device), persistent=False)
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor) -> torch.Tensor:
        """positions: (T,) int64 in [0, max_positions) -> (T, 2, head_dim) cos/sin rows."""
        return self.cos_sin.index_select(0, positions)

    @staticmethod
    def apply(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """Rotate x: (T, num_heads, head_dim) by cos_sin: (T, 2, head_dim) -> (T, num_heads, head_dim)."""
        cos, sin = cos_sin[:, 0].unsqueeze(1), cos_sin[:, 1].unsqueeze(1)  # (T, 1, head_dim)
        rotated = torch.roll(x, x.shape[-1] // 2, dims=-1)  # (T, num_heads, head_dim): cat(x2, x1)
        return torch.addcmul(x * cos, rotated, sin)


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with a fused qkv projection and rotary embeddings."""

    def __init__(self, config: Any, head_dim: int, backend) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, hidden, bias=bias)
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, head_dim**-0.5, backend)

    def forward(self, hidden: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """hidden: (T, hidden), cos_sin: (T, 2, head_dim) -> (T, hidden)."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # (T, q_size + 2 * kv_size)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)  # (T, heads + kv_heads, head_dim)
        qk = RotaryEmbedding.apply(qk, cos_sin)  # q and k rotated in one pass
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # (T, heads, hd), (T, kv_heads, hd)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # (T, kv_heads, head_dim)
        out = self.attn(q, k, v)  # (T, heads, head_dim)
        return self.o_proj(out.reshape(num_tokens, self.q_size))  # (T, hidden)


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward (Shazeer, 2020): ``down(silu(gate(x)) * up(x))`` with gate/up fused."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act must be 'silu' for a Llama model, got {act!r}")
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size, bias=bias)
        self.down_proj = Linear(self.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) -> (T, hidden)."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # each (T, intermediate)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm transformer block: attention then MLP, each with a residual connection."""

    def __init__(self, config: Any, head_dim: int, backend) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, head_dim, backend)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden, residual: (T, hidden) (residual None for the first layer) -> (mlp_out, residual)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos_sin)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm (the HF ``model.`` prefix)."""

    def __init__(self, config: Any, head_dim: int, backend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, head_dim, backend)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """input_ids: (T,) int64, cos_sin: (T, 2, head_dim) -> final hidden states (T, hidden)."""
        hidden = self.embed_tokens(input_ids)  # (T, hidden)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos_sin)
        hidden, _ = self.norm(hidden, residual)
        return hidden


# HF projection name -> (fused parameter, shard index) inside each layer.
_FUSED_SHARDS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints still carry


class LlamaForCausalLM(nn.Module):
    """A Llama-architecture causal LM over the paged KV cache.

    Args:
        config: a transformers ``LlamaConfig`` (or any config with the same fields:
            vocab_size, hidden_size, intermediate_size, num_hidden_layers,
            num_attention_heads, num_key_value_heads, head_dim (optional), rms_norm_eps,
            max_position_embeddings, tie_word_embeddings, rope_parameters or
            rope_theta/rope_scaling, attention_bias, mlp_bias).
        dtype: parameter and activation dtype (float32, bfloat16, float16).
        device: where parameters, the rope table and activations live.
        attn_backend: the paged-attention backend every layer calls (the model runner
            chooses it for the device); default :class:`TorchPagedAttention`.

    Parameters are allocated uninitialized: call :meth:`load_weights` before use. The rope
    table covers positions ``[0, max_position_embeddings)``.

    Attributes the model runner uses: ``num_layers``, ``num_heads``, ``num_kv_heads``,
    ``head_dim``, ``vocab_size``, ``max_positions``, ``dtype``, ``device``.
    """

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.vocab_size = config.vocab_size
        self.max_positions = config.max_position_embeddings
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        inv_freq, attention_factor = rope_inv_freq(config, self.head_dim)
        backend = attn_backend if attn_backend is not None else TorchPagedAttention()
        with torch.device("meta"):  # no time spent initialising weights load_weights overwrites
            self.model = LlamaModel(config, self.head_dim, backend)
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
            self.to(dtype)
        self.to_empty(device=self.device)
        self.requires_grad_(False)  # inference only
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary_emb = RotaryEmbedding(inv_freq, attention_factor, self.max_positions, dtype, self.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final hidden states of a flat batch.

        Args:
            input_ids: (T,) int64 token ids; positions: (T,) int64 positions within each
                request, each < ``max_positions``.
        Returns:
            (T, hidden_size) in the model dtype.

        The step's ``AttentionMetadata`` comes from ``set_forward_context``; with
        ``attn_metadata=None`` the T tokens are treated as one causal sequence and no KV
        cache is read or written (memory profiling, quick checks).
        """
        cos_sin = self.rotary_emb.lookup(positions)  # (T, 2, head_dim), shared by every layer
        return self.model(input_ids, cos_sin)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (N, hidden_size) -> logits (N, vocab_size) float32."""
        return self.lm_head(hidden).float()

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Give layer i the cache ``kv_caches[i]``, (2, num_blocks, block_size, num_kv_heads, head_dim).

        An empty list unbinds every layer. Raises ValueError for a wrong count or layout.
        """
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
        """Copy Hugging Face-named tensors into the (fused) parameters, casting to the model dtype.

        Names: ``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
        ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``,
        ``model.layers.{i}.{input,post_attention}_layernorm.weight``, ``model.norm.weight``,
        ``lm_head.weight`` (optional when embeddings are tied; it fills the shared matrix),
        and ``*_proj.bias`` when the config has biases. ``*rotary_emb.inv_freq`` is ignored.

        Raises:
            ValueError: an unknown name, a shape mismatch (naming both shapes), or, after
                the last tensor, the list of parameters that were never filled.
        """
        self.unpack_linears()
        params = dict(self.named_parameters(remove_duplicate=False))
        expected = self._expected_weight_keys()
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            target, key = self._weight_target(name, params)
            if target.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(key)
        if self.tie_word_embeddings and loaded & {"model.embed_tokens.weight", "lm_head.weight"}:
            loaded |= {"model.embed_tokens.weight", "lm_head.weight"}
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
            raise ValueError(f"weights missing from the checkpoint: {shown}")
        if os.environ.get(_PACKED_LINEAR_ENV, "1") != "0":
            self.pack_linears_for_cpu()

    def pack_linears_for_cpu(self, batch_hint: int = 64) -> int:
        """Prepack every projection for oneDNN when the model is on CPU (see :class:`Linear`).

        Called by :meth:`load_weights` (disable with ``PAGEDLLM_CPU_PACKED_LINEAR=0``). Costs
        one extra copy of the projection and lm_head weights in memory.
        Returns how many were packed (0 on CUDA or without oneDNN).
        """
        return sum(m.pack_for_cpu(batch_hint) for m in self.modules() if isinstance(m, Linear))

    def unpack_linears(self) -> None:
        """Undo :meth:`pack_linears_for_cpu` (plain weights back in the parameters)."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.unpack()

    def _weight_target(self, name: str, params: dict[str, nn.Parameter]) -> tuple[torch.Tensor, str]:
        """The parameter (or fused-parameter slice) an HF weight fills, and its bookkeeping key."""
        for hf_part, (fused_part, shard) in _FUSED_SHARDS.items():
            prefix, sep, suffix = name.partition(f".{hf_part}.")
            if sep and prefix.startswith("model.layers."):
                fused_name = f"{prefix}.{fused_part}.{suffix}"
                if fused_name not in params:
                    break
                offset, size = self._shard_range(fused_part, shard)
                return params[fused_name].narrow(0, offset, size), name
        if name not in params:
            raise ValueError(f"unknown weight {name!r} for {type(self).__name__} "
                             f"({self.num_layers} layers; expected Hugging Face Llama parameter names)")
        return params[name], name

    def _shard_range(self, fused_part: str, shard: int) -> tuple[int, int]:
        """(row offset, rows) of shard ``shard`` inside fused parameter ``fused_part``."""
        if fused_part == "self_attn.qkv_proj":
            q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            return [(0, q), (q, kv), (q + kv, kv)][shard]
        inter = self.config.intermediate_size
        return shard * inter, inter

    def _expected_weight_keys(self) -> set[str]:
        """Every HF name a complete checkpoint provides (fused parameters expanded to their parts)."""
        keys = set()
        fused_to_parts: dict[str, list[str]] = {}
        for hf_part, (fused_part, _) in _FUSED_SHARDS.items():
            fused_to_parts.setdefault(fused_part, []).append(hf_part)
        for name, _ in self.named_parameters(remove_duplicate=False):
            for fused_part, parts in fused_to_parts.items():
                if f".{fused_part}." in name:
                    keys.update(name.replace(fused_part, part) for part in parts)
                    break
            else:
                keys.add(name)
        return keys
