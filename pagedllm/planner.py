"""``pagedllm plan``: how many sequences fit, at what context, on which device, before starting anything.

The arithmetic is :mod:`pagedllm.sizing`'s, the engine's own, so both report the same blocks.
Without ``device_memory``/``gpu`` it plans this machine's CPU, as the engine sizes itself there.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm import sizing
from pagedllm.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS, EngineConfig, engine_arg_names, parse_bytes
from pagedllm.core.kv_cache_groups import KVCacheGroupSpec
from pagedllm.sizing import GiB, ModelShape

MiB = 2**20


def _shape(name, layers, hidden, heads, kv_heads, inter, vocab, ctx, tied=False, bias=False) -> ModelShape:
    return ModelShape(name, layers, hidden, heads, kv_heads, hidden // heads, inter, vocab, ctx,
                      tie_word_embeddings=tied, attention_bias=bias)


# From each model's published config.json.
MODEL_SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    _shape("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    _shape("llama-2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    _shape("llama-2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    _shape("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    _shape("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
    _shape("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256, 131072),
    _shape("llama-3.1-70b", 80, 8192, 64, 8, 28672, 128256, 131072),
    _shape("mistral-7b", 32, 4096, 32, 8, 14336, 32768, 32768),
    _shape("qwen2.5-0.5b", 24, 896, 14, 2, 4864, 151936, 32768, tied=True, bias=True),
    _shape("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, 32768, bias=True),
    _shape("qwen2.5-14b", 48, 5120, 40, 8, 13824, 152064, 32768, bias=True),
    _shape("smollm2-135m", 30, 576, 9, 3, 1536, 49152, 8192, tied=True),
)}


@dataclass(frozen=True)
class GPU:
    """A named device; ``memory_bytes`` as the driver reports it."""

    name: str
    memory_bytes: int
    description: str


GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("24gb", 24 * GiB, "24 GB consumer GPU (RTX 3090 / 4090)"),
    GPU("a100-40", 40 * GiB, "NVIDIA A100 40GB"),
    GPU("a100-80", 80 * GiB, "NVIDIA A100 80GB"),
    GPU("h100-80", 80 * GiB, "NVIDIA H100 80GB"),
    GPU("h200", 143771 * MiB, "NVIDIA H200 141GB"),
)}
_GPU_ALIASES = {"rtx-4090": "24gb", "rtx-3090": "24gb", "a100": "a100-80", "h100": "h100-80", "h200-141": "h200"}

# plan() options that are not EngineConfig fields.
PLAN_OPTIONS = ("device_memory", "gpu", "quantization", "kv_cache_dtype", "context_lens")


@dataclass
class ContextRow:
    """Capacity at one context length; ``max_concurrency`` = usable blocks ÷ blocks per sequence."""

    context_len: int
    blocks_per_seq: int
    max_concurrency: float
    max_seqs: int
    contiguous_max_seqs: int


@dataclass
class Plan:
    """The planner's answer. Bytes per device (per rank with tensor parallelism)."""

    model: str
    model_source: str  # "named shape", "gguf", "hf"
    num_params: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    device: str  # "cpu", a GPU name or "gpu"
    device_memory_bytes: int | None
    gpu_memory_utilization: float | None
    dtype: str
    kv_cache_dtype: str
    quantization: str
    tensor_parallel_size: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    weight_bytes: int
    activation_bytes: int
    activation_tokens: int
    kv_bytes_per_token: int
    kv_cache_groups: list[KVCacheGroupSpec]
    max_chunk_tokens: int  # the step's token budget
    bytes_per_block: int
    kv_budget_bytes: int
    kv_budget_source: str
    num_blocks: int
    num_tokens: int
    max_concurrency: float  # at max_model_len
    contiguous_max_seqs: int
    rows: list[ContextRow]
    fits: bool
    problems: list[str] = field(default_factory=list)
    suggested_flags: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # CPU: copies of the linear weights packed for the matmul kernels, beside weight_bytes
    packed_weight_bytes: int = 0
    lora_bytes: int = 0  # enable_lora: the max_loras adapter slots, beside weight_bytes

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def kv_cache_spec(self) -> sizing.KVCacheSpec:
        return sizing.KVCacheSpec(self.num_blocks, self.block_size, self.bytes_per_block, self.max_model_len,
                                  tuple(self.kv_cache_groups), self.max_chunk_tokens, self.kv_cache_dtype)

    def render(self) -> str:
        return render_plan(self)


def resolve_gpu(name: str) -> GPU:
    """A GPU of :data:`GPUS` by name or alias, case-insensitive. Raises ValueError listing the names."""
    key = name.strip().lower()
    key = _GPU_ALIASES.get(key, key)
    if key not in GPUS:
        known = ", ".join(f"{g.name} ({g.description})" for g in GPUS.values())
        raise ValueError(f"gpu: unknown GPU {name!r}; known: {known}; or pass device_memory (bytes or '80GiB')")
    return GPUS[key]


def resolve_model_shape(model: str) -> tuple[ModelShape, str]:
    """``(shape, source)`` of a named shape or a model, from headers only. Raises ValueError listing the shapes."""
    key = model.strip().lower()
    if key in MODEL_SHAPES:
        return MODEL_SHAPES[key], "named shape"
    from pagedllm.loader.resolve import ModelNotFoundError, resolve_model

    try:
        resolved = resolve_model(model)
    except ModelNotFoundError as e:
        raise ModelNotFoundError(f"{e}\nNamed shapes for planning: {', '.join(MODEL_SHAPES)}") from None
    if resolved.format == "gguf":
        return _gguf_shape(resolved.path, model), "gguf"
    return _hf_shape(resolved.path, model), "hf"


def _gguf_shape(path: Path, name: str) -> ModelShape:
    from pagedllm.loader import gguf as gguf_loader

    f = gguf_loader.GGUFFile(path)
    config = gguf_loader.gguf_config(f.metadata, {t.name for t in f.tensors}, gguf_loader.read_rope_freqs(f))
    arch = f.metadata.get("general.architecture", "")
    params = [t.shape for t in f.tensors if gguf_loader.hf_tensor_name(t.name, arch) is not None]
    return _with_max_len(ModelShape.from_hf_config(config, name, sizing.sum_params(params)), config)


def _hf_shape(folder: Path, name: str) -> ModelShape:
    from safetensors import safe_open

    from pagedllm.loader import hf as hf_loader

    config = hf_loader.load_hf_config(folder)
    is_tied = bool(getattr(config, "tie_word_embeddings", False))
    shapes = []
    for file in hf_loader.safetensors_files(folder):
        with safe_open(str(file), framework="numpy") as f:
            for key in f.keys():  # the engine's own skip rules
                if key.endswith(hf_loader._SKIPPED_SUFFIXES) or (is_tied and key == "lm_head.weight"):
                    continue
                shapes.append(f.get_slice(key).get_shape())
    return _with_max_len(ModelShape.from_hf_config(config, name, sizing.sum_params(shapes)), config)


def _with_max_len(shape: ModelShape, config: Any) -> ModelShape:
    from pagedllm.loader.model_files import max_model_len_of

    return dataclasses.replace(shape, max_position_embeddings=max_model_len_of(config))


def plan(model: str | None = None, **options: Any) -> Plan:
    """Plan the KV cache for ``model`` (or a :data:`MODEL_SHAPES` key) without loading weights.

    ``options``: EngineConfig fields and :data:`PLAN_OPTIONS` (``device_memory`` or ``gpu`` plan a GPU).
    ``fits`` is False, ``problems`` saying why, when one ``max_model_len`` sequence does not fit.
    Raises ValueError naming the option.
    """
    unknown = set(options) - set(PLAN_OPTIONS) - set(engine_arg_names())
    if unknown:
        raise ValueError(f"unknown plan option(s): {', '.join(sorted(unknown))}")
    engine_kw = {k: v for k, v in options.items() if k in engine_arg_names()}
    if model is not None:
        engine_kw["model"] = model
    config = EngineConfig(**engine_kw)
    return plan_from_config(config, **{k: v for k, v in options.items() if k in PLAN_OPTIONS})


def plan_from_config(config: EngineConfig, *, device_memory: int | str | None = None, gpu: str | None = None,
                     quantization: str | None = None, kv_cache_dtype: str = "auto",
                     context_lens: list[int] | None = None) -> Plan:
    """:func:`plan` for a validated EngineConfig (the CLI's path). Raises as :func:`plan`."""
    inputs = _PlanInputs.build(config, device_memory, gpu, quantization, kv_cache_dtype, config.tensor_parallel_size)
    shape, source = resolve_model_shape(config.model)
    return _compute(config, inputs, shape, source, context_lens)


@dataclass
class _PlanInputs:
    device: str
    device_memory_bytes: int | None  # None: the CPU plan
    quantization: str
    kv_cache_dtype: str | None  # None: the model dtype
    tensor_parallel_size: int

    @classmethod
    def build(cls, config, device_memory, gpu, quantization, kv_cache_dtype, tp) -> "_PlanInputs":
        if device_memory is not None and gpu is not None:
            raise ValueError("give either device_memory or gpu, not both")
        device, mem = "cpu", None
        if gpu is not None:
            g = resolve_gpu(gpu)
            device, mem = g.name, g.memory_bytes
        elif device_memory is not None:
            device, mem = "gpu", parse_bytes(device_memory, "device_memory")
        elif config.device == "cuda":
            raise ValueError("device cuda: pass gpu (a named GPU) or device_memory to plan for a GPU")
        quantization = quantization or "none"
        if quantization != "none" and quantization not in sizing.QUANTIZATION_BITS:
            raise ValueError(f"quantization must be none or one of {', '.join(sizing.QUANTIZATION_BITS)}, "
                             f"got {quantization!r}")
        if kv_cache_dtype != "auto":
            sizing.kv_dtype_bytes(kv_cache_dtype)
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        return cls(device, mem, quantization, None if kv_cache_dtype == "auto" else kv_cache_dtype, tp)


def _compute(config: EngineConfig, inp: _PlanInputs, shape: ModelShape, source: str,
             context_lens: list[int] | None, advise: bool = True) -> Plan:
    is_gpu = inp.device_memory_bytes is not None
    dtype = config.dtype if config.dtype != "auto" else ("bfloat16" if is_gpu else "float32")
    kv_dtype = inp.kv_cache_dtype or dtype
    tp = inp.tensor_parallel_size
    problems: list[str] = []
    if shape.num_attention_heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the {shape.num_attention_heads} attention heads")
    max_model_len = config.max_model_len or shape.max_position_embeddings
    if max_model_len > shape.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's context length "
                         f"{shape.max_position_embeddings}")
    config = config.replace(max_model_len=max_model_len)
    contexts = _context_lens(context_lens, max_model_len)
    dbytes = sizing.dtype_bytes(dtype)
    lora = sizing.lora_slot_bytes(shape, config.max_loras, config.max_lora_rank, dbytes, tp) if config.enable_lora else 0
    weights = sizing.weight_bytes(shape, dbytes, inp.quantization, tp) + lora
    packed = 0 if is_gpu else _cpu_packed_bytes(shape, dtype, inp.quantization, tp)
    act_tokens = min(config.token_budget, max_model_len)
    activations = sizing.activation_bytes(shape, act_tokens, min(act_tokens, config.max_num_seqs), dbytes, tp)
    kv_bytes, scale_bytes = sizing.kv_dtype_bytes(kv_dtype)
    per_token = sizing.kv_bytes_per_token(shape, kv_bytes, tp, scale_bytes)
    groups = tuple(sizing.kv_cache_groups_for(shape, hybrid=not config.disable_hybrid_kv_cache_manager))
    per_block = sizing.kv_bytes_per_block(shape, config.block_size, kv_bytes, sizing.layers_per_block(groups), tp,
                                          scale_bytes)

    if config.num_kv_blocks is not None:
        budget, budget_source = config.num_kv_blocks * per_block, "num_kv_blocks"
    elif is_gpu:
        budget = sizing.gpu_kv_budget_bytes(inp.device_memory_bytes, config.gpu_memory_utilization,
                                            weights, activations)
        budget_source = "gpu_memory_utilization"
    else:
        budget, budget_source = config.kv_cache_memory_bytes, "kv_cache_memory"
    num_blocks = sizing.num_blocks_for_budget(budget, per_block)
    spec = sizing.KVCacheSpec(num_blocks, config.block_size, per_block, max_model_len, groups, config.token_budget)

    memory = inp.device_memory_bytes if is_gpu else _host_memory_bytes()
    usable = int(memory * config.gpu_memory_utilization) if is_gpu else memory
    packed_text = f" + {sizing.format_bytes(packed)} packed for the CPU kernels" if packed else ""
    if weights + packed + activations > usable:
        what = f"{config.gpu_memory_utilization} x {sizing.format_bytes(memory)}" if is_gpu else "host RAM"
        problems.append(f"the weights ({sizing.format_bytes(weights)}{packed_text}) and activations "
                        f"({sizing.format_bytes(activations)}) do not fit in {sizing.format_bytes(usable)} ({what})")
    elif not is_gpu and weights + packed + activations + spec.num_bytes > usable:
        total = sizing.format_bytes(weights + packed + activations + spec.num_bytes)
        problems.append(f"weights{' + packed copies' if packed else ''} + activations + KV cache ({total})"
                        f" exceed the host RAM ({sizing.format_bytes(usable)})")
    too_small = spec.too_small_message(budget_source)
    if too_small and not problems:
        problems.append(too_small)

    contiguous = sizing.contiguous_max_sequences(
        budget, sizing.contiguous_bytes_per_sequence(shape, max_model_len, kv_bytes, tp, scale_bytes))
    rows = [ContextRow(c, spec.blocks_per_seq_at(c), spec.max_concurrency_at(c),
                       spec.num_usable_blocks // spec.blocks_per_seq_at(c), contiguous) for c in contexts]
    result = Plan(
        model=config.model, model_source=source, num_params=shape.param_count(), num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, device=inp.device,
        device_memory_bytes=memory, gpu_memory_utilization=config.gpu_memory_utilization if is_gpu else None,
        dtype=dtype, kv_cache_dtype=kv_dtype, quantization=inp.quantization, tensor_parallel_size=tp,
        block_size=config.block_size, max_model_len=max_model_len, max_num_seqs=config.max_num_seqs,
        weight_bytes=weights - lora, lora_bytes=lora, packed_weight_bytes=packed, activation_bytes=activations, activation_tokens=act_tokens,
        kv_bytes_per_token=per_token, kv_cache_groups=list(groups), max_chunk_tokens=config.token_budget,
        bytes_per_block=per_block, kv_budget_bytes=budget,
        kv_budget_source=budget_source, num_blocks=num_blocks, num_tokens=spec.num_tokens,
        max_concurrency=spec.max_concurrency,
        contiguous_max_seqs=contiguous,
        rows=rows, fits=not problems, problems=problems)
    if advise:
        result.suggested_flags = _suggest(result, shape, config, inp)
        result.notes = _notes(result, source)
    return result


def _cpu_packed_bytes(shape: ModelShape, dtype: str, quantization: str | None, tp: int) -> int:
    """Bytes of the CPU loader's packed copies of the linear weights (``Linear.pack_for_cpu``); imports torch."""
    if quantization not in (None, "none"):
        return 0
    import torch

    from pagedllm import envs
    from pagedllm.models.layers.linear import cpu_packed_copy_bytes

    if not envs.cpu_packed_linear():
        return 0

    torch_dtype = getattr(torch, dtype)
    *layer, lm_head = shape.linear_shapes()
    per_layer = sum(cpu_packed_copy_bytes(n, k, torch_dtype, bias) for n, k, bias in layer)
    head = cpu_packed_copy_bytes(lm_head[0], lm_head[1], torch_dtype, onednn_for_many_rows=False)
    return -(-(shape.num_layers * per_layer + head) // tp)


def _context_lens(context_lens: list[int] | None, max_model_len: int) -> list[int]:
    if context_lens:
        bad = [c for c in context_lens if not isinstance(c, int) or isinstance(c, bool) or c < 1]
        if bad:
            raise ValueError(f"context_lens must be positive integers, got {bad[0]!r}")
        over = [c for c in context_lens if c > max_model_len]
        if over:
            raise ValueError(f"context_lens: {over[0]} is longer than max_model_len ({max_model_len})")
        return sorted(set(context_lens))
    return sorted({max(1, max_model_len // d) for d in (8, 4, 2, 1)})


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _suggest(p: Plan, shape: ModelShape, config: EngineConfig, inp: _PlanInputs) -> list[str]:
    """Flags that make it fit (when it does not), or that use what fits (when it does)."""
    if not p.fits:
        return _suggest_fixes(p, shape, config, inp)
    flags = [f"--dtype {p.dtype}"]
    # without them `serve` would size a different (larger) model
    if p.quantization in QUANTIZATION_METHODS:
        flags.append(f"--quantization {p.quantization}")
    if p.kv_cache_dtype != p.dtype and p.kv_cache_dtype in KV_CACHE_DTYPES:
        flags.append(f"--kv-cache-dtype {p.kv_cache_dtype}")
    if p.tensor_parallel_size > 1:
        flags.append(f"--tensor-parallel-size {p.tensor_parallel_size}")
    flags += [f"--block-size {p.block_size}", f"--max-model-len {p.max_model_len}"]
    shortest = p.rows[0]
    # more would only preempt; fewer leave memory idle
    flags.append(f"--max-num-seqs {max(1, min(shortest.max_seqs, 1024))}")
    if p.kv_budget_source == "gpu_memory_utilization":
        flags.append(f"--gpu-memory-utilization {config.gpu_memory_utilization}")
    elif p.kv_budget_source == "kv_cache_memory":
        flags.append(f"--kv-cache-memory {sizing.format_bytes(p.kv_budget_bytes).replace(' ', '')}")
    else:
        flags.append(f"--num-kv-blocks {p.num_blocks}")
    return flags


def _suggest_fixes(p: Plan, shape: ModelShape, config: EngineConfig, inp: _PlanInputs) -> list[str]:
    fixes = []
    if p.weight_bytes + p.lora_bytes + p.activation_bytes > (p.device_memory_bytes or 0) * (p.gpu_memory_utilization or 1.0):
        for q in ("int8", "int4"):
            if _fits_with(config, inp, shape, quantization=q):
                fixes.append(f"--quantization {q}")
                break
        for tp in (2, 4, 8):
            if shape.num_attention_heads % tp == 0 and _fits_with(config, inp, shape, tensor_parallel_size=tp):
                fixes.append(f"--tensor-parallel-size {tp}")
                break
        if inp.device_memory_bytes is not None:
            for g in GPUS.values():
                if g.memory_bytes > inp.device_memory_bytes and _fits_with(config, inp, shape, device=g):
                    fixes.append(f"--gpu {g.name}")
                    break
        return fixes
    largest = _largest_max_model_len(p.kv_cache_spec())
    if largest:
        fixes.append(f"--max-model-len {largest}")
    if p.kv_budget_source == "kv_cache_memory":
        need = p.kv_cache_spec().num_blocks_needed * p.bytes_per_block
        fixes.append(f"--kv-cache-memory {-(-need // MiB)}MiB")
    elif p.kv_budget_source == "gpu_memory_utilization" and p.gpu_memory_utilization < 0.95:
        fixes.append("--gpu-memory-utilization 0.95")
    return fixes


def _largest_max_model_len(spec: sizing.KVCacheSpec) -> int:
    """The longest max_model_len (in whole blocks) one sequence of which the pool runs; 0 if none."""
    lo, hi = 0, spec.max_model_len // spec.block_size  # in blocks
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if dataclasses.replace(spec, max_model_len=mid * spec.block_size).too_small_message("") is None:
            lo = mid
        else:
            hi = mid - 1
    return lo * spec.block_size


def _fits_with(config: EngineConfig, inp: _PlanInputs, shape: ModelShape, device: GPU | None = None,
               **changes: Any) -> bool:
    changed = dataclasses.replace(inp, **changes)
    if device is not None:
        changed = dataclasses.replace(changed, device=device.name, device_memory_bytes=device.memory_bytes)
    return _compute(config, changed, shape, "", None, advise=False).fits


def _notes(p: Plan, source: str) -> list[str]:
    notes = []
    if source == "named shape":
        notes.append("named shape: parameters counted from its config numbers")
    if p.quantization not in ("none", *QUANTIZATION_METHODS):
        notes.append(f"planning only: the engine does not run --quantization {p.quantization} "
                     f"(it runs {', '.join(QUANTIZATION_METHODS)})")
    if p.kv_cache_dtype not in (p.dtype, *KV_CACHE_DTYPES):
        notes.append(f"planning only: the engine does not store K/V as {p.kv_cache_dtype} "
                     f"(it stores {', '.join(d for d in KV_CACHE_DTYPES if d != 'auto')} or the model dtype)")
    if p.kv_budget_source == "gpu_memory_utilization":
        notes.append(f"activations are an estimate for a {p.activation_tokens}-token step; the engine measures "
                     "them with a profiling forward pass")
    return notes


def render_plan(p: Plan) -> str:
    """The plan as a text report with one table row per context length."""
    fb = sizing.format_bytes
    if p.device_memory_bytes is not None and p.gpu_memory_utilization is not None:
        device = (f"{p.device}: {fb(p.device_memory_bytes)} x gpu_memory_utilization {p.gpu_memory_utilization}"
                  f" = {fb(int(p.device_memory_bytes * p.gpu_memory_utilization))}")
    else:
        device = f"cpu: host RAM {fb(p.device_memory_bytes or 0)}, KV pool from {p.kv_budget_source}"
    lines = [
        f"model      {p.model} ({p.model_source}): {p.num_params / 1e9:.2f} B parameters, {p.num_layers} layers, "
        f"{p.num_kv_heads} KV heads x {p.head_dim}",
        f"device     {device}" + (f", tensor_parallel_size {p.tensor_parallel_size} (bytes per device)"
                                  if p.tensor_parallel_size > 1 else ""),
        f"settings   dtype {p.dtype}, kv_cache_dtype {p.kv_cache_dtype}, quantization {p.quantization}, "
        f"block_size {p.block_size}, max_model_len {p.max_model_len}",
        "",
        f"  weights                 {fb(p.weight_bytes):>12}",
        *([f"  LoRA slots              {fb(p.lora_bytes):>12}   (max_loras adapters of rank max_lora_rank)"]
          if p.lora_bytes else []),
        *([f"  packed for CPU kernels  {fb(p.packed_weight_bytes):>12}   (copies of the linear weights: skinny GEMM"
           f" / oneDNN layouts)"] if p.packed_weight_bytes else []),
        f"  activations (estimate)  {fb(p.activation_bytes):>12}   ({p.activation_tokens}-token step)",
        f"  KV cache                {fb(max(p.num_blocks * p.bytes_per_block, 0)):>12}   = {p.num_blocks} blocks x "
        f"{p.block_size} tokens = {p.num_tokens} tokens",
        f"  KV per token            {fb(p.kv_bytes_per_token):>12}   (per block {fb(p.bytes_per_block)})",
    ]
    sliding = sorted({g.sliding_window for g in p.kv_cache_groups if g.sliding_window})
    if sliding:
        lines.append(f"  KV-cache groups         {len(p.kv_cache_groups):>12}   of "
                     f"{max(len(g.layer_ids) for g in p.kv_cache_groups)} layers; sliding windows "
                     f"{', '.join(map(str, sliding))} tokens hold only their window (null block reserved)")
    lines += [
        "",
    ]
    if p.num_blocks > 0:
        lines += ["  context   blocks/seq   max concurrent sequences",
                  "                         paged: whole (exact)   contiguous (reserves max_model_len)"]
        lines += [f"  {r.context_len:>7}   {r.blocks_per_seq:>10}   {r.max_seqs:>11} ({r.max_concurrency:>7.2f})"
                  f"   {r.contiguous_max_seqs:>11}" for r in p.rows]
    else:
        lines.append("  no memory is left for KV blocks")
    lines.append("")
    if p.fits:
        lines.append(f"fits: yes (max concurrency {p.max_concurrency:.2f} sequences at max_model_len "
                     f"{p.max_model_len})")
        lines.append("suggested: pagedllm serve " + (p.model if p.model_source != "named shape" else "MODEL")
                     + " " + " ".join(p.suggested_flags))
    else:
        lines.append("fits: NO")
        lines += [f"  - {problem}" for problem in p.problems]
        if p.suggested_flags:
            lines.append("would fit with any of: " + "; ".join(p.suggested_flags))
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)
