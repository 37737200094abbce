"""ModelRunner: the only owner of device tensors (weights, KV cache, step inputs).

Each step turns a :class:`SchedulerOutput` into one flat ragged batch (``input_ids[T]``,
``positions[T]``, ``slot_mapping[T]``, ``query_start_loc[B+1]``, ``seq_lens[B]``,
``block_tables[B, max_blocks]``), runs the model, and samples the rows that need logits.
Per-request state stays in host numpy buffers by row, so inputs are vectorized gathers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from pagedllm.attention import Attention, get_attention_backend
from pagedllm.attention.backend import AttentionMetadata, set_forward_context
from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_groups import layers_per_block, make_kv_cache_groups
from pagedllm.core.kv_offload import KVOffloadSpec
from pagedllm.core.swap_space import SwapSpace
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.loader.model_files import ModelFiles
from pagedllm.models.layers.linear import packed_copy_bytes
from pagedllm.quantization import (QuantizationConfig, create_quantized_weights, get_prequantized_config,
                                   get_quantization_config, process_quantized_weights, weight_bytes)
from pagedllm.quantization.kv_cache import resolve_kv_cache_dtype
from pagedllm.sampling_params import SamplingParams
from pagedllm.sizing import KVCacheSpec, format_bytes, kv_bytes_per_block, num_blocks_for_budget
from pagedllm.structured_output.bitmask import apply_grammar_bitmask
from pagedllm.structured_output.manager import GrammarBitmask
from pagedllm.utils import cdiv, resolve_device
from pagedllm.worker.cpu_graph import CpuDecodeGraphs
from pagedllm.worker.cuda_graph import DecodeGraphRunner, capture_sizes, cuda_graph_mode
from pagedllm.worker.rejection_sampler import accept_point_mass_drafts

logger = logging.getLogger("pagedllm")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` → float32 on CPU (exact greedy parity), bfloat16 on CUDA."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def attention_layers(model: torch.nn.Module) -> list[Attention]:
    """The model's Attention modules in layer order; ValueError when not ``model.num_layers``."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if len(layers) != model.num_layers:
        raise ValueError(f"{type(model).__name__} has {len(layers)} Attention modules for {model.num_layers} layers")
    return layers


def layer_sliding_windows(model: torch.nn.Module) -> list[int | None]:
    """Per layer, its attention's sliding window in tokens, or None for full attention."""
    return [getattr(a, "sliding_window", None) for a in attention_layers(model)]


def _ranges(counts: np.ndarray) -> np.ndarray:
    """``concat(arange(c) for c in counts)`` as int64."""
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(int(counts.sum()), dtype=np.int64) - starts


@dataclass
class CachedRequestState:
    """What the runner remembers about one running request between steps."""

    req_id: str
    row: int  # row in the persistent token / block-table buffers
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    num_blocks: int  # length of its block table (the same in every KV-cache group)
    num_computed_tokens: int
    generator: torch.Generator | None
    num_prompt_logprob_positions_done: int = 0
    lora_int_id: int = 0  # its adapter, 0 for the base model

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class _StepBatch:
    """Host-side description of one step's batch, in batch order (decodes first)."""

    req_ids: list[str]
    num_scheduled: np.ndarray  # [B] int64
    num_computed: np.ndarray  # [B] int64, before this step
    rows: np.ndarray  # [B] int64
    sample_mask: np.ndarray  # [B] bool: request samples this step
    prompt_logprob_reqs: list[int] = field(default_factory=list)  # batch indices asking for prompt logprobs
    drafts: dict[str, list[int]] = field(default_factory=dict)  # request id -> draft tokens to verify


class ModelRunner:
    """Owns the model, the KV cache and per-request device-side state. Built from a resolved
    config (``max_model_len`` set) and the model's files; :meth:`initialize_kv_cache` must run
    before the first step. Raises ValueError for an unsupported architecture, a missing or
    misshapen weight, or a device that is not available."""

    def __init__(self, config: EngineConfig, model_files: ModelFiles) -> None:
        from pagedllm.worker.sampler import Sampler

        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.attn_backend = get_attention_backend(self.device, config.attention_backend)
        # decode steps: "graphs" (CUDA), "pad" (the same buffers, eager: tests), "off"
        self.graph_mode = cuda_graph_mode(config.enforce_eager, self.device, self.attn_backend)
        self.decode_graphs: DecodeGraphRunner | None = None
        self.memory_profile = None  # worker.memory_profiler.MemoryProfile after CUDA sizing
        self.kv_dtype = self._resolve_kv_dtype()
        self.model = self._load_model(model_files)
        self.lora_manager = self._new_lora_manager()
        self.compiled_model = self._compile_model()
        self.cpu_graphs = self._new_cpu_graphs()
        self._init_lengths(model_files)
        self.sampler = Sampler()
        self._init_request_buffers()
        self._layout_kv_cache()
        self._init_kv_cache_slots()
        # test hook: called with each sampling request id; raising fails that request only
        self.fault_injector: Callable[[str], None] | None = None

    def _resolve_kv_dtype(self):
        """The KV cache's element format; raises ValueError when the backend cannot store it."""
        config = self.config
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        if kv_dtype.is_quantized and not getattr(self.attn_backend, "supports_quantized_kv", False):
            raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r} is not supported by the "
                             f"{type(self.attn_backend).__name__} backend; use auto or bfloat16, or the torch, cpu or "
                             f"triton attention backend")
        return kv_dtype

    def _new_lora_manager(self):
        """Adapter slots on every target projection when ``enable_lora`` (pagedllm.lora), else None."""
        config = self.config
        if not config.enable_lora:
            return None
        from pagedllm.lora.manager import LoRAManager

        manager = LoRAManager(self.model, config.max_loras, config.max_lora_rank, config.resolved_max_cpu_loras,
                              self.dtype, self.device)
        logger.info("LoRA: %d slots of rank %d on %d projections, %s", config.max_loras, config.max_lora_rank,
                    len(manager.layers), format_bytes(manager.slot_bytes))
        return manager

    def add_lora(self, lora_request) -> bool:
        """Load and check an adapter (pagedllm.lora.LoRARequest); False when already loaded. Raises
        LoRAError (a ValueError) naming the problem, ValueError without ``enable_lora``."""
        if self.lora_manager is None:
            raise ValueError("LoRA adapters need enable_lora")
        return self.lora_manager.add_adapter(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.lora_manager is not None and self.lora_manager.remove_adapter(lora_int_id)

    def list_loras(self) -> list[int]:
        return [] if self.lora_manager is None else self.lora_manager.list_adapters()

    def _prepare_lora(self, b: _StepBatch) -> bool:
        """Give the LoRA layers this step's rows by adapter; whether any row uses one."""
        if self.lora_manager is None:
            return False
        per_request = np.fromiter((self.requests[r].lora_int_id for r in b.req_ids), dtype=np.int64,
                                  count=len(b.req_ids))
        return self.lora_manager.prepare_step(np.repeat(per_request, b.num_scheduled))

    def _new_cpu_graphs(self) -> CpuDecodeGraphs | None:
        config = self.config
        return (CpuDecodeGraphs(self.model) if self.device.type == "cpu" and not config.enforce_eager
                and self.compiled_model is None and CpuDecodeGraphs.supports(self.model) else None)

    def _init_lengths(self, model_files: ModelFiles) -> None:
        config = self.config
        self.vocab_size = int(model_files.hf_config.vocab_size)
        self.eos_token_id = model_files.eos_token_id
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.max_blocks_per_seq = cdiv(self.max_model_len, self.block_size)

    def _init_request_buffers(self) -> None:
        """Per-request state, and the token buffer ``[max_num_seqs, max_model_len]`` int64 by row."""
        config = self.config
        self.requests: dict[str, CachedRequestState] = {}
        self._free_rows = list(range(config.max_num_seqs - 1, -1, -1))
        self.token_buf = np.zeros((config.max_num_seqs, self.max_model_len), dtype=np.int64)

    def _init_kv_cache_slots(self) -> None:
        self.kv_caches: list[torch.Tensor] = []
        self.kv_scales: list[torch.Tensor | None] = []
        self.kv_spec: KVCacheSpec | None = None
        self.kv_offloader = None

    def _load_model(self, model_files: ModelFiles) -> torch.nn.Module:
        from pagedllm.models.registry import get_model_class

        torch.manual_seed(self.config.seed)
        model_cls = get_model_class(model_files.hf_config)
        with torch.device(self.device):
            model = model_cls(model_files.hf_config, dtype=self.dtype, device=self.device,
                              attn_backend=self.attn_backend)
        quant = self._quantization_config(model_files, model)
        if quant is None:
            model.load_weights(model_files.weights(self.dtype))
            return model.eval()
        num_quantized = create_quantized_weights(model, quant)
        model.load_weights(quant.convert_checkpoint(model_files.weights(self.dtype, quant.packed_weight_names)))
        process_quantized_weights(model)
        logger.info("weights: %d linear layers kept as %s, %.1f MiB in all", num_quantized, quant.describe(),
                    weight_bytes(model) / 2**20)
        return model.eval()

    def _compile_model(self):
        """A CompiledModel when ``compilation_config`` asks (compiled at :meth:`initialize_kv_cache`),
        else None. Raises ValueError on a device or with tensor parallelism it does not support."""
        compilation = self.config.compilation
        if not compilation.is_compiled:
            return None
        if self.device.type != "cpu":
            raise ValueError(f"compilation_config mode 3 runs on the CPU device only, got {self.device.type!r}; "
                             f"use enforce_eager or leave compilation_config unset")
        if self.config.tensor_parallel_size > 1:
            raise ValueError("compilation_config mode 3 is not supported with tensor_parallel_size > 1")
        from pagedllm.compilation.compiled_model import CompiledModel

        return CompiledModel(self.model, compilation)

    def _warmup_metadata(self, num_tokens: int) -> list[AttentionMetadata]:
        """Compile warm-up metadata: one-token requests at block 0, before any request owns it."""
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=dev),
            query_start_loc=torch.arange(num_tokens + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.ones(num_tokens, dtype=torch.int32, device=dev),
            block_tables=torch.zeros((num_tokens, 1), dtype=torch.int32, device=dev),
            num_decodes=num_tokens, num_decode_tokens=num_tokens, max_query_len=1, max_seq_len=1,
            query_start_loc_cpu=list(range(num_tokens + 1)), seq_lens_cpu=[1] * num_tokens)
        return [meta] * len(self.kv_cache_groups)

    def _quantization_config(self, model_files: ModelFiles, model: torch.nn.Module) -> QuantizationConfig | None:
        """The weight format for ``config.quantization`` or the checkpoint's ``quantization_config``
        (None: float weights). Raises ValueError when both are given."""
        name = self.config.quantization
        fused_parts: dict[str, list[str]] = {}
        for part, (fused, _) in getattr(model, "packed_modules", {}).items():
            fused_parts.setdefault(fused, []).append(part)
        stored = model_files.checkpoint_quantization
        if stored is not None:
            if name is not None:
                raise ValueError(f"quantization={name!r} cannot apply to {model_files.source!r}: its weights are "
                                 f"already quantized ({stored.describe()}); leave quantization unset")
            return get_prequantized_config(stored, fused_parts)
        if name is None:
            return None
        return get_quantization_config(name, self.config.quantization_group_size, model_files.gguf_tensor_types,
                                       fused_parts)

    def bytes_per_block(self) -> int:
        """Bytes one block takes across all KV tensors (:func:`pagedllm.sizing.kv_bytes_per_block`)."""
        kv = self.kv_dtype
        elem = torch.tensor([], dtype=kv.storage).element_size()
        return kv_bytes_per_block(self.model, self.block_size, elem, self.num_kv_tensors,
                                  scale_bytes=4 if kv.has_token_scales else 0)

    def determine_num_blocks(self) -> int:
        """KV blocks: ``num_kv_blocks``, else from ``kv_cache_memory`` (CPU) or the memory profile
        (CUDA). Raises ValueError when the pool cannot hold one ``max_model_len`` sequence."""
        per_block = self.bytes_per_block()
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            num_blocks, source = cfg.num_kv_blocks, "num_kv_blocks"
        elif self.device.type == "cuda":
            num_blocks, source = self._profile_cuda_num_blocks(per_block), "gpu_memory_utilization"
        else:
            num_blocks, source = num_blocks_for_budget(cfg.kv_cache_memory_bytes, per_block), "kv_cache_memory"
        error = self._new_kv_spec(num_blocks).too_small_message(source)
        if error:
            raise ValueError(error)
        return num_blocks

    def _profile_cuda_num_blocks(self, per_block: int) -> int:
        from pagedllm.worker.memory_profiler import profile_memory

        num_tokens = min(self.config.token_budget, self.max_model_len)
        measure_graphs = self._measure_graph_memory if self.graph_mode == "graphs" else None
        profile = profile_memory(self.device, self.config.gpu_memory_utilization, num_tokens,
                                 lambda: self._dummy_forward(num_tokens), measure_graphs)
        logger.info(profile.describe())
        self.memory_profile = profile
        return num_blocks_for_budget(profile.kv_cache_bytes, per_block)

    def _measure_graph_memory(self) -> int:
        """Bytes the decode graphs take, captured on a one-block temporary cache."""
        caches = self._new_kv_caches(1)
        self._bind_kv_caches(caches, self._new_kv_scales(1))
        graphs = self._new_decode_graphs(padding_block=0)
        used = graphs.capture()
        self.model.bind_kv_caches([])
        del graphs, caches
        return used

    def _new_decode_graphs(self, padding_block: int) -> DecodeGraphRunner:
        return DecodeGraphRunner(self.model, capture_sizes(self.config.max_num_seqs), self.max_blocks_per_seq,
                                 self.block_size, padding_block, self.max_model_len, self.device,
                                 use_graphs=self.graph_mode == "graphs", num_groups=len(self.kv_cache_groups))

    def _dummy_forward(self, num_tokens: int) -> None:
        """One prefill of ``num_tokens`` tokens through a temporary KV cache (memory profiling)."""
        num_blocks = cdiv(num_tokens, self.block_size)
        caches = self._new_kv_caches(num_blocks)
        self._bind_kv_caches(caches, self._new_kv_scales(num_blocks))
        block_table = torch.arange(num_blocks, dtype=torch.int32, device=self.device).view(1, -1)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=self.device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            block_tables=block_table, num_decodes=0, num_decode_tokens=0,
            max_query_len=num_tokens, max_seq_len=num_tokens,
            query_start_loc_cpu=[0, num_tokens], seq_lens_cpu=[num_tokens])
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        pos = torch.arange(num_tokens, dtype=torch.int64, device=self.device)
        with torch.inference_mode(), set_forward_context([meta] * len(self.kv_cache_groups)):
            hidden = self.model(ids, pos)
            self.model.compute_logits(hidden[-min(num_tokens, self.config.max_num_seqs):])
        self.model.bind_kv_caches([])
        del caches

    def _new_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        """``layers_per_block`` tensors (2, num_blocks, block_size, num_kv_heads, head_dim)."""
        m = self.model
        shape = (2, num_blocks, self.block_size, m.num_kv_heads, m.head_dim)
        # zeros: padded block-table entries read block 0 masked out, and 0 × NaN would be NaN
        return [torch.zeros(shape, dtype=self.kv_dtype.storage, device=self.device)
                for _ in range(self.num_kv_tensors)]

    def _new_kv_scales(self, num_blocks: int) -> list[torch.Tensor | None]:
        """An int8 cache's scales, (2, num_blocks, block_size, num_kv_heads) float32 per tensor; else Nones."""
        if not self.kv_dtype.has_token_scales:
            return [None] * self.num_kv_tensors
        shape = (2, num_blocks, self.block_size, self.model.num_kv_heads)
        return [torch.ones(shape, dtype=torch.float32, device=self.device) for _ in range(self.num_kv_tensors)]

    def _bind_kv_caches(self, caches: list[torch.Tensor], scales: list[torch.Tensor | None] | None = None) -> None:
        """Give layer ``group.layer_ids[j]`` tensor ``j`` (and its scales) and tell its attention its group."""
        per_layer: list[torch.Tensor | None] = [None] * self.model.num_layers
        layers = attention_layers(self.model)
        for g, group in enumerate(self.kv_cache_groups):
            for j, layer in enumerate(group.layer_ids):
                per_layer[layer] = caches[j]
                layers[layer].kv_cache_group = g
                layers[layer].kv_scales = scales[j] if scales else None
        self.model.bind_kv_caches(per_layer)
        if getattr(self, "cpu_graphs", None) is not None:
            self.cpu_graphs.clear()  # a native replay holds the caches' addresses

    def _new_kv_spec(self, num_blocks: int) -> KVCacheSpec:
        return KVCacheSpec(num_blocks, self.block_size, self.bytes_per_block(), self.max_model_len,
                           self.kv_cache_groups, self.config.token_budget, self.kv_storage_name())

    def kv_storage_name(self) -> str:
        """What the KV cache stores: ``kv_cache_dtype``, or for ``auto`` the model dtype's name."""
        name = self.config.kv_cache_dtype
        return str(self.dtype).removeprefix("torch.") if name == "auto" else name

    def _layout_kv_cache(self) -> None:
        self.kv_cache_groups = tuple(make_kv_cache_groups(layer_sliding_windows(self.model),
                                                          hybrid=not self.config.disable_hybrid_kv_cache_manager))
        self.num_kv_tensors = layers_per_block(self.kv_cache_groups)
        self.block_table_buf = np.zeros((len(self.kv_cache_groups), self.config.max_num_seqs,
                                         self.max_blocks_per_seq), dtype=np.int64)

    def weight_bytes(self) -> int:
        """Bytes of the model's parameters on the device (what ``pagedllm plan`` calls weights)."""
        return weight_bytes(self.model)

    def initialize_kv_cache(self) -> KVCacheSpec:
        """Group the layers, size, allocate and bind the KV cache; call before the first step."""
        self._layout_kv_cache()
        from pagedllm.distributed.communication import all_reduce_min

        # one scheduler hands out block ids for every rank: all use the smallest pool
        num_blocks = all_reduce_min(self.determine_num_blocks())
        padded = self.graph_mode != "off"  # one extra block, past the scheduler's pool, for padding rows
        self.kv_caches = self._new_kv_caches(num_blocks + int(padded))
        self.kv_scales = self._new_kv_scales(num_blocks + int(padded))
        self._bind_kv_caches(self.kv_caches, self.kv_scales)
        self.kv_spec = self._new_kv_spec(num_blocks)
        if padded:
            self.decode_graphs = self._new_decode_graphs(padding_block=num_blocks)
            try:
                self.decode_graphs.capture()
            except RuntimeError as e:  # a model or backend op that cannot be captured: stay eager
                logger.warning("CUDA graph capture failed (%s); decode runs eagerly", e)
                self.decode_graphs = None
        if self.compiled_model is not None:
            self.compiled_model.warm_up(self._warmup_metadata, self.device)
        packed = packed_copy_bytes(self.model)
        logger.info("weights: %s%s; %s", format_bytes(self.weight_bytes()),
                    f" (+ {format_bytes(packed)} packed for the CPU matmul kernels)" if packed else "",
                    self.kv_spec.describe())
        return self.kv_spec

    def initialize_kv_offload(self) -> KVOffloadSpec:
        """Build the offload tiers (after :meth:`initialize_kv_cache`); ValueError for an unwritable dir."""
        from pagedllm.worker.kv_offload import build_kv_offload

        m = self.model
        identity = {"model": str(self.config.model), "block_size": str(self.block_size),
                    "kv_dtype": self.kv_storage_name(),
                    "shape": json.dumps([self.num_kv_tensors, 2, self.block_size, m.num_kv_heads, m.head_dim]),
                    "num_layers": str(m.num_layers)}
        spec, self.kv_offloader = build_kv_offload(self.config, self.kv_caches, self.bytes_per_block(),
                                                   len(self.kv_cache_groups), identity, self.kv_scales)
        return spec

    def initialize_swap_space(self) -> SwapSpace:
        """The swap space's index for the scheduler (after :meth:`initialize_kv_offload`)."""
        num_slots = len(self.kv_offloader.swap) if self.kv_offloader is not None else 0
        bandwidth = self.kv_offloader.measure_copy_bandwidth() if num_slots else 0.0
        if num_slots:
            logger.info("swap space: %d blocks (%s), copy bandwidth %.2f GB/s", num_slots,
                        format_bytes(num_slots * self.bytes_per_block()), bandwidth / 1e9)
        return SwapSpace(num_slots, self.config.preemption_mode, self.bytes_per_block(), bandwidth)

    def reset_state(self) -> None:
        """Forget every request (after a failed step; the scheduler resends them in full)."""
        self.requests.clear()
        self._free_rows = list(range(self.config.max_num_seqs - 1, -1, -1))

    def _update_states(self, so: SchedulerOutput) -> None:
        """Drop finished/preempted requests, add new ones, append new blocks to cached ones."""
        for req_id in so.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self._free_rows.append(state.row)
        for new in so.scheduled_new_reqs:
            if new.req_id in self.requests:  # resumed within the same step it was preempted
                self._free_rows.append(self.requests.pop(new.req_id).row)
            row = self._free_rows.pop()
            params = new.sampling_params
            gen = torch.Generator(device=self.device) if params.seed is not None else None
            prompt = list(new.token_ids[:new.num_prompt_tokens])
            output = list(new.token_ids[new.num_prompt_tokens:])
            num_blocks = len(new.block_ids[0])
            state = CachedRequestState(new.req_id, row, prompt, output, params, num_blocks,
                                       new.num_computed_tokens, gen, lora_int_id=self._lora_id(params.lora_request))
            n = len(new.token_ids)
            self.token_buf[row, :n] = new.token_ids
            for g, ids in enumerate(new.block_ids):
                self.block_table_buf[g, row, :num_blocks] = ids
            self.requests[new.req_id] = state
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.num_blocks -= cached.num_dropped_blocks  # rejected drafts' blocks, returned
            num_new = len(cached.new_block_ids[0])
            if num_new:
                start = state.num_blocks
                for g, ids in enumerate(cached.new_block_ids):
                    self.block_table_buf[g, state.row, start:start + num_new] = ids
                state.num_blocks += num_new
            state.num_computed_tokens = cached.num_computed_tokens
        for req_id, draft in so.scheduled_spec_decode_tokens.items():  # read as inputs after the last token
            state = self.requests[req_id]
            self.token_buf[state.row, state.num_tokens:state.num_tokens + len(draft)] = draft

    def _lora_id(self, lora_request) -> int:
        """A new request's adapter id (loaded here first if this rank has not seen it), 0 for none."""
        if lora_request is None:
            return 0
        self.add_lora(lora_request)
        return lora_request.lora_int_id

    @staticmethod
    def _reseed(state: CachedRequestState) -> None:
        """Seed from (seed, output position): output token i's draw depends on nothing else,
        so batch order, a preemption and recompute, or speculation cannot change it."""
        ModelRunner._seed_for_position(state.generator, state, len(state.output_token_ids))

    @staticmethod
    def _seed_for_position(generator: torch.Generator, state: CachedRequestState, position: int) -> None:
        seed = state.sampling_params.seed
        generator.manual_seed((seed * 1_000_003 + position) % (2**63 - 1))

    def _order_batch(self, so: SchedulerOutput) -> _StepBatch:
        """Batch order: decodes (1 query token) first, then prefills, as AttentionMetadata requires; with
        LoRA, each part by adapter (an adapter's rows one run: the LoRA op slices instead of gathering)."""
        req_ids = list(so.num_scheduled_tokens)
        num_sched = np.fromiter((so.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        if self.lora_manager is None:
            order = np.argsort(num_sched > 1, kind="stable")
        else:
            lora_ids = np.fromiter((self.requests[r].lora_int_id for r in req_ids), dtype=np.int64, count=len(req_ids))
            order = np.lexsort((lora_ids, num_sched > 1))
        req_ids = [req_ids[i] for i in order]
        num_sched = num_sched[order]
        states = [self.requests[r] for r in req_ids]
        num_computed = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(states))
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        num_tokens = np.fromiter((s.num_tokens for s in states), dtype=np.int64, count=len(states))
        sample_mask = num_computed + num_sched >= num_tokens
        plp = [i for i, s in enumerate(states) if s.sampling_params.prompt_logprobs is not None
               and num_computed[i] < len(s.prompt_token_ids)]
        return _StepBatch(req_ids, num_sched, num_computed, rows, sample_mask, plp, so.scheduled_spec_decode_tokens)

    def _prepare_inputs(self, b: _StepBatch) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata], np.ndarray]:
        """Flat token ids, positions, and per KV-cache group the attention metadata."""
        total = int(b.num_scheduled.sum())
        cu = np.zeros(len(b.req_ids) + 1, dtype=np.int64)
        np.cumsum(b.num_scheduled, out=cu[1:])
        req_idx = np.repeat(np.arange(len(b.req_ids)), b.num_scheduled)  # [T] batch index of each token
        positions = np.arange(total, dtype=np.int64) - cu[req_idx] + b.num_computed[req_idx]
        rows = b.rows[req_idx]
        input_ids = self.token_buf[rows, positions]
        block_idx, offsets = positions // self.block_size, positions % self.block_size
        seq_lens = b.num_computed + b.num_scheduled
        max_blocks = int(cdiv(seq_lens.max(), self.block_size))
        num_decodes = int((b.num_scheduled == 1).sum())
        dev = self.device
        metas = []
        for table_buf in self.block_table_buf:
            slot_mapping = table_buf[rows, block_idx] * self.block_size + offsets
            block_tables = torch.from_numpy(table_buf[b.rows, :max_blocks].astype(np.int32)).to(dev)
            if metas:
                metas.append(dataclasses.replace(metas[0], slot_mapping=torch.from_numpy(slot_mapping).to(dev),
                                                 block_tables=block_tables))
                continue
            metas.append(AttentionMetadata(
                slot_mapping=torch.from_numpy(slot_mapping).to(dev),
                query_start_loc=torch.from_numpy(cu.astype(np.int32)).to(dev),
                seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
                block_tables=block_tables,
                num_decodes=num_decodes, num_decode_tokens=num_decodes,
                max_query_len=int(b.num_scheduled.max()), max_seq_len=int(seq_lens.max()),
                query_start_loc_cpu=cu.tolist(), seq_lens_cpu=seq_lens.tolist()))
        return (torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), metas, cu)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None) -> ModelRunnerOutput:
        """Run one step; ``grammar_bitmask`` constrains its requests' logits before sampling."""
        self._update_states(so)
        if self.kv_offloader is not None and not so.kv_transfers.is_empty:
            self.kv_offloader.apply(so.kv_transfers)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput()
        b = self._order_batch(so)
        input_ids, positions, metas, cu = self._prepare_inputs(b)
        try:
            hidden = self._forward(input_ids, positions, metas, is_eager=self._prepare_lora(b))  # (T, hidden)
        finally:
            if self.lora_manager is not None:
                self.lora_manager.finish_step()
        out = ModelRunnerOutput()
        self._compute_prompt_logprobs(b, hidden, cu, out)
        self._sample(b, hidden, cu, out, grammar_bitmask)
        if self.kv_offloader is not None:
            out.failed_tier_keys = self.kv_offloader.take_failed_saves()
        return out

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 metas: list[AttentionMetadata], is_eager: bool = False) -> torch.Tensor:
        """``is_eager``: no graph or compiled model (a step with LoRA rows: they hold no adapter op)."""
        if not is_eager and self.decode_graphs is not None and self.decode_graphs.can_run(metas[0]):
            return self.decode_graphs.run(input_ids, positions, metas)
        with set_forward_context(metas):
            if not is_eager and self.cpu_graphs is not None and self.cpu_graphs.can_run(metas):
                return self.cpu_graphs.run(input_ids, positions)
            if not is_eager and self.compiled_model is not None:
                return self.compiled_model(input_ids, positions)
            return self.model(input_ids, positions)

    def _sample(self, b: _StepBatch, hidden: torch.Tensor, cu: np.ndarray, out: ModelRunnerOutput,
                grammar_bitmask: GrammarBitmask | None = None) -> None:
        from pagedllm.worker.sampling_metadata import SamplingMetadata

        idx = np.nonzero(b.sample_mask)[0]
        states = [self.requests[b.req_ids[i]] for i in idx]
        keep = []
        for i, s in zip(idx, states):
            try:
                if self.fault_injector is not None:
                    self.fault_injector(s.req_id)
                keep.append(i)
            except Exception as e:  # noqa: BLE001 — one request's failure must not fail the batch
                out.failed[s.req_id] = f"{type(e).__name__}: {e}"
        if not keep:
            return
        idx = np.asarray(keep, dtype=np.int64)
        states = [self.requests[b.req_ids[i]] for i in idx]
        drafts = [b.drafts.get(s.req_id, []) for s in states]
        for s in states:
            if s.generator is not None:
                self._reseed(s)
        # one logits row per sampled position: a verify request's k drafts and the token after them
        num_rows = np.fromiter((len(d) + 1 for d in drafts), dtype=np.int64, count=len(drafts))
        last = cu[idx + 1] - 1
        first_rows = last - num_rows + 1  # (len(states),) the row of the token before the drafts
        logits_rows = np.repeat(first_rows, num_rows) + _ranges(num_rows)
        self._return_hidden_states(states, hidden, torch.from_numpy(first_rows).to(self.device), out)
        logits = self.model.compute_logits(hidden.index_select(0, torch.from_numpy(logits_rows).to(self.device)))
        row_states = np.repeat(np.arange(len(states)), num_rows).tolist()  # (R,) index into states
        row_outputs = [s.output_token_ids + d[:j] for s, d in zip(states, drafts) for j in range(len(d) + 1)]
        if grammar_bitmask is not None:
            apply_grammar_bitmask(logits, [states[i].req_id for i in row_states], grammar_bitmask)
        md = SamplingMetadata.build(
            params=[states[i].sampling_params for i in row_states],
            prompt_token_ids=[states[i].prompt_token_ids for i in row_states],
            output_token_ids=row_outputs,
            generators=self._row_generators(states, drafts),
            eos_token_ids=[self.eos_token_id] * len(row_states),
            vocab_size=self.vocab_size, device=self.device)
        sampler_out = self.sampler(logits, md)
        sampled = sampler_out.sampled_token_ids.tolist()
        lp_list = None
        if sampler_out.logprobs is not None:
            lp_list = sampler_out.logprobs.to_sample_logprobs([states[i].sampling_params.logprobs for i in row_states])
        start = 0
        for s, d in zip(states, drafts):
            n = len(d) + 1
            tokens = accept_point_mass_drafts(sampled[start:start + n], d) if d else sampled[start:start + 1]
            self._append_tokens(s, tokens)
            out.req_ids.append(s.req_id)
            out.sampled_token_ids.append(tokens)
            if lp_list is not None and lp_list[start] is not None:
                lps = lp_list[start:start + len(tokens)]
                out.logprobs[s.req_id] = lps if d else lps[0]
            start += n

    def _append_tokens(self, state: CachedRequestState, tokens: list[int]) -> None:
        """Record sampled tokens; they overwrite the drafts read as inputs this step."""
        pos = state.num_tokens
        end = min(pos + len(tokens), self.max_model_len)
        if end > pos:
            self.token_buf[state.row, pos:end] = tokens[:end - pos]
        state.output_token_ids.extend(tokens)

    def _row_generators(self, states: list[CachedRequestState], drafts: list[list[int]]) -> list:
        """One generator per sampled row; a verify request's row j draws as output position
        ``len(output) + j`` would without speculation."""
        gens: list = []
        for s, d in zip(states, drafts):
            gens.append(s.generator)
            for j in range(1, len(d) + 1):
                gen = None
                if s.generator is not None:
                    gen = torch.Generator(device=self.device)
                    self._seed_for_position(gen, s, len(s.output_token_ids) + j)
                gens.append(gen)
        return gens

    @staticmethod
    def _return_hidden_states(states: list[CachedRequestState], hidden: torch.Tensor, rows: torch.Tensor,
                              out: ModelRunnerOutput) -> None:
        """The pooling runner's decoders: the last prompt token's hidden state, at the first sample."""
        wanted = [j for j, s in enumerate(states) if s.sampling_params.return_hidden_states and not s.output_token_ids]
        if not wanted:
            return
        vectors = hidden.index_select(0, rows[wanted]).float().cpu()  # (len(wanted), hidden_size)
        for j, vector in zip(wanted, vectors):
            out.hidden_states[states[j].req_id] = vector.tolist()

    def _compute_prompt_logprobs(self, b: _StepBatch, hidden: torch.Tensor, cu: np.ndarray,
                                 out: ModelRunnerOutput) -> None:
        """Prompt logprobs of the positions computed this step; entry j is prompt token j (0: None)."""
        from pagedllm.worker.sampler import compute_prompt_logprobs

        for i in b.prompt_logprob_reqs:
            s = self.requests[b.req_ids[i]]
            start, n = int(b.num_computed[i]), int(b.num_scheduled[i])
            num_prompt = len(s.prompt_token_ids)
            entries: list = [None] if start == 0 else []
            # hidden row of position p predicts token p + 1; keep targets inside the prompt
            last = min(start + n, num_prompt - 1)
            if last > start:
                rows = torch.arange(int(cu[i]), int(cu[i]) + (last - start), device=self.device)
                targets = torch.tensor(s.prompt_token_ids[start + 1:last + 1], dtype=torch.int64, device=self.device)
                logits = self.model.compute_logits(hidden.index_select(0, rows))
                lpt = compute_prompt_logprobs(logits, targets, s.sampling_params.prompt_logprobs)
                entries.extend(lpt.to_sample_logprobs([s.sampling_params.prompt_logprobs] * (last - start)))
            out.prompt_logprobs[s.req_id] = entries
