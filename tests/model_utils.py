"""Test helpers for models and paged attention, shared by several test files.

- :func:`tiny_llama_config`: a 2-layer GQA Llama config (fast on CPU).
- :func:`make_hf_llama` / :func:`make_llama_pair`: a transformers reference model with
  well-scaled random weights, and a pagedllm model carrying the same weights.
- :func:`random_llama_weights`: HF-named random tensors for any Llama shape (benchmarks).
- :func:`write_random_llama_folder`: a Hugging Face folder (config, safetensors, a word-level
  tokenizer) of random weights for any Llama shape, needing no tokenizer files from elsewhere.
- :func:`make_metadata`: an :class:`AttentionMetadata` from per-request
  (context_len, query_len, block_table) lists.
- :func:`allocate_block_tables`: shuffled, disjoint block tables.
- :func:`kv_rounding_error_bound`: how far attention may move when a KV cache rounds K/V.
- :func:`run_paged`: drive a model through prefill (optionally chunked) and decode steps
  through a paged KV cache, mixing requests in one batch, and collect every position's logits.
"""

from __future__ import annotations

import os
from typing import Iterator, Sequence

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pagedllm.attention.backend import AttentionMetadata, set_forward_context  # noqa: E402
from pagedllm.utils import cdiv  # noqa: E402


def tiny_llama_config(vocab_size: int = 512, **overrides):
    """A transformers ``LlamaConfig``: 2 layers, hidden 64, 4 heads / 2 KV heads (head_dim 16),
    intermediate 128, 256 positions, float32. ``overrides`` replace any field
    (e.g. ``tie_word_embeddings=True``, ``rope_parameters={...}``)."""
    from transformers import LlamaConfig

    fields = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, dtype="float32", bos_token_id=1,
                  eos_token_id=2)
    fields.update(overrides)
    return LlamaConfig(**fields)


def _init_(params: Iterator[tuple[str, torch.Tensor]], generator: torch.Generator) -> None:
    """Fill tensors in place with values that make attention and the MLP non-trivial:
    norm weights ~ 1 ± 0.2, matrices ~ N(0, 1/sqrt(fan_in)), embeddings ~ N(0, 1)."""
    for name, p in params:
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=generator))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=generator))
        elif p.dim() == 2:
            p.copy_(torch.randn(p.shape, generator=generator) / p.shape[1] ** 0.5)
        else:  # biases
            p.copy_(0.1 * torch.randn(p.shape, generator=generator))


def make_hf_llama(config, seed: int = 0):
    """transformers ``LlamaForCausalLM`` (float32, eval, SDPA attention) with seeded weights."""
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(seed)
    model = HFLlama(config).eval()
    with torch.no_grad():
        _init_(model.named_parameters(), torch.Generator().manual_seed(seed))
    return model


def random_llama_weights(config, seed: int = 0, dtype: torch.dtype = torch.float32
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named random weights for a Llama config of any size (no transformers model built).

    Yields ``(name, tensor)`` in ``load_weights`` order; ``lm_head.weight`` only when untied.
    """
    g = torch.Generator().manual_seed(seed)
    h, inter = config.hidden_size, config.intermediate_size
    nh = config.num_attention_heads
    nkv = getattr(config, "num_key_value_heads", None) or nh
    hd = getattr(config, "head_dim", None) or h // nh
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (nh * hd, h), p + "self_attn.k_proj.weight": (nkv * hd, h),
                       p + "self_attn.v_proj.weight": (nkv * hd, h), p + "self_attn.o_proj.weight": (h, nh * hd),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    if not getattr(config, "tie_word_embeddings", False):
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for name, shape in shapes.items():
        t = torch.empty(shape)
        _init_([(name, t)], g)
        yield name, t.to(dtype)


def write_random_llama_folder(folder, dtype: torch.dtype = torch.float32, seed: int = 0, **shape):
    """Write a Llama folder the engine loads (config.json, model.safetensors, tokenizer files)
    with random weights of ``shape`` (``LlamaConfig`` fields) and a word-level tokenizer whose
    tokens are ``t0``..``t{vocab_size-1}`` (t1 BOS, t2 EOS). Returns the folder (a Path)."""
    from pathlib import Path

    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    folder = Path(folder)
    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, architectures=["LlamaForCausalLM"])
    config.save_pretrained(folder)
    save_file({name: t.contiguous() for name, t in random_llama_weights(config, seed, dtype)},
              str(folder / "model.safetensors"))
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="t1", eos_token="t2",
                            unk_token="t0").save_pretrained(folder)
    return folder


def make_llama_pair(config, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """(transformers reference model, pagedllm ``LlamaForCausalLM``) with identical weights."""
    from pagedllm.models.llama import LlamaForCausalLM

    hf = make_hf_llama(config, seed)
    model = LlamaForCausalLM(config, dtype, torch.device(device))
    model.load_weights(hf.state_dict().items())
    return hf, model.eval()


def allocate_block_tables(num_tokens: Sequence[int], block_size: int, seed: int = 0,
                          extra_blocks: int = 3) -> tuple[list[list[int]], int]:
    """Disjoint block tables in a shuffled pool: request i gets ceil(num_tokens[i] / block_size)
    blocks at random physical ids. Returns (block_tables, num_blocks in the pool)."""
    needed = [cdiv(n, block_size) for n in num_tokens]
    num_blocks = sum(needed) + extra_blocks
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(perm[start:start + n])
        start += n
    return tables, num_blocks


def make_metadata(context_lens: Sequence[int], query_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
                  block_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
    """AttentionMetadata for requests with ``context_lens[i]`` tokens already cached and
    ``query_lens[i]`` new tokens this step, in the given order (put query-length-1 requests
    first: ``num_decodes`` counts the leading ones). ``block_tables[i]`` must cover
    ``context_lens[i] + query_lens[i]`` tokens. Slots follow slot = block_id * block_size + offset.
    """
    if not (len(context_lens) == len(query_lens) == len(block_tables)):
        raise ValueError("context_lens, query_lens and block_tables must have one entry per request")
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    slots = []
    for c, s, table in zip(context_lens, seq_lens, block_tables):
        if len(table) * block_size < s:
            raise ValueError(f"block table {table} too short for {s} tokens at block_size {block_size}")
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, s)]
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    width = max(len(t) for t in block_tables)
    bt = torch.zeros(len(block_tables), width, dtype=torch.int32)
    for i, t in enumerate(block_tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=bt.to(device), num_decodes=num_decodes, num_decode_tokens=num_decodes,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)


@torch.inference_mode()
def run_paged(model, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], block_size: int = 16,
              chunk_size: int | None = None, seed: int = 0, garbage: float = 100.0,
              kv_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Run ``sequences`` through ``model`` with a paged KV cache and return every position's logits.

    Each request first prefills its ``prompt_lens[i]`` tokens (in chunks of ``chunk_size``
    tokens when given: chunked prefill reading earlier chunks back from the cache), then
    feeds its remaining tokens one per step (decode, teacher-forced). All unfinished
    requests share every step's batch, decodes first, so steps mix decode, prefill and
    chunked prefill. Block tables are shuffled; unwritten cache slots hold large finite
    garbage (``garbage``), so any read of a slot that should be masked shows in the logits.
    ``kv_dtype``: the caches' dtype (default the model's; float8 and other formats without
    scales).

    Returns: per request, (len(sequences[i]), vocab) float32 logits; row p predicts token p+1,
    so it equals a full causal forward's logits on the same sequence.
    """
    device = next(model.parameters()).device
    lens = [len(s) for s in sequences]
    tables, num_blocks = allocate_block_tables(lens, block_size, seed)
    g = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
    caches = [(garbage * (torch.rand(shape, generator=g) * 2 - 1)).to(kv_dtype or model.dtype).to(device)
              for _ in range(model.num_layers)]
    model.bind_kv_caches(caches)
    done = [0] * len(sequences)
    logits: list[list[torch.Tensor]] = [[] for _ in sequences]
    try:
        while any(d < n for d, n in zip(done, lens)):
            step = []  # (request, num_new_tokens)
            for i, (d, n) in enumerate(zip(done, lens)):
                if d >= n:
                    continue
                if d < prompt_lens[i]:
                    todo = prompt_lens[i] - d
                    step.append((i, min(todo, chunk_size) if chunk_size else todo))
                else:
                    step.append((i, 1))
            step.sort(key=lambda r: r[1] != 1)  # decodes (query length 1) first; stable otherwise
            reqs = [i for i, _ in step]
            meta = make_metadata([done[i] for i in reqs], [q for _, q in step], [tables[i] for i in reqs],
                                 block_size, device)
            ids = torch.tensor([t for i, q in step for t in sequences[i][done[i]:done[i] + q]], device=device)
            pos = torch.tensor([p for i, q in step for p in range(done[i], done[i] + q)], device=device)
            with set_forward_context(meta):
                hidden = model(ids, pos)
            out = model.compute_logits(hidden)
            for (i, q), start in zip(step, meta.query_start_loc_cpu):
                logits[i].append(out[start:start + q])
                done[i] += q
    finally:
        model.bind_kv_caches([])
    return [torch.cat(rows) for rows in logits]


def kv_rounding_error_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k2: torch.Tensor, v2: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """Per query row, a bound on |attn(q, k2, v2) - attn(q, k, v)| from rounding K/V to k2/v2 (a
    quantized KV cache): with score errors at most d = scale * max_i |q . (k2_i - k_i)|, softmax
    weights change by a factor within e^(±2d), so |p2 - p|_1 <= e^(2d) - 1, and the output error
    is at most max|v2 - v| + (e^(2d) - 1) * max|v|. q: (Q, H, D); k, v, k2, v2: (S, KV, D) -> (Q, H)
    float64 (holds for any causal mask, every row attending to a subset of the S keys)."""
    group = q.shape[1] // k.shape[1]
    dk = (k2 - k).double().repeat_interleave(group, dim=1)  # (S, H, D)
    d = (torch.einsum("qhd,khd->qhk", q.double(), dk).abs().amax(-1)) * scale  # (Q, H)
    return (v2 - v).abs().max().double() + (torch.exp(2 * d) - 1) * v.abs().max().double()


def write_truncated_copy(source: str, folder, layers):
    """Write a Hugging Face folder (config.json, model.safetensors, tokenizer files) holding the
    decoder layers ``layers`` (indices, in order; renumbered 0..) of the model at ``source`` (any
    format the loader reads), with its embeddings, final norm and LM head: a draft model sharing
    the source's vocabulary (layer skipping). Returns the folder (a Path)."""
    import copy
    from pathlib import Path

    from safetensors.torch import save_file

    from pagedllm.loader import load_model_files

    folder = Path(folder)
    files = load_model_files(source)
    config = copy.deepcopy(files.hf_config)
    renumber = {old: new for new, old in enumerate(layers)}
    config.num_hidden_layers = len(renumber)
    config.save_pretrained(folder)
    files.tokenizer.save_pretrained(folder)
    keep = {}
    for name, tensor in files.weights(torch.float32):
        parts = name.split(".")
        if name.startswith("model.layers."):
            if int(parts[2]) not in renumber:
                continue
            name = ".".join(parts[:2] + [str(renumber[int(parts[2])])] + parts[3:])
        keep[name] = tensor.contiguous()
    save_file(keep, str(folder / "model.safetensors"))
    return folder
