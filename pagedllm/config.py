"""Engine configuration: one frozen dataclass, validated in ``__post_init__``.

``LLM(**kwargs)`` and the command-line flags of ``pagedllm serve|generate`` are both
derived from the fields of :class:`EngineConfig` (see ``engine_arg_names`` and
``pagedllm.entrypoints.cli``), so the two cannot drift apart.

This module imports no torch: the core (scheduler, KV-cache manager) reads it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from pagedllm import envs

DEFAULT_MODEL = "smollm2-135m-instruct"
# `serve` on CPU: prompt tokens a step may carry while requests decode (each decoding stream waits for
# them; too small a cap spends the CPU on many weight-bound steps; figures: benchmarks/README.md). Offline: no cap.
SERVING_CPU_PREFILL_TOKENS_WHILE_DECODING = 256
# `serve` on CPU with the time-aware budget on: the step's first prompt chunk may always take
# this many tokens (the floor that keeps every prompt progressing; the former fixed cap).
SERVING_CPU_MIN_PREFILL_TOKENS_WHILE_DECODING = 64
# Weight formats kept at run time (pagedllm.quantization) and KV-cache dtypes (vLLM's names).
QUANTIZATION_METHODS = ("int8", "w8a8", "int4", "gguf")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # the group sizes torch's int4 CPU kernel accepts
DATA_PARALLEL_ROUTERS = ("prefix", "least_loaded", "round_robin")
# Who runs the tensor-parallel workers (vLLM's names): processes on this machine, or Ray actors.
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")
ATTENTION_BACKENDS = envs.ATTENTION_BACKEND.choices

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
          "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(value: int | float | str, field_name: str = "kv_cache_memory") -> int:
    """Parse a byte size such as ``4294967296``, ``"4GiB"``, ``"512MB"`` or ``"1.5g"``.

    Returns the size in bytes (int). Raises ValueError naming ``field_name`` when the
    value cannot be parsed or is not positive.
    """
    if isinstance(value, bool):
        raise ValueError(f"{field_name} must be a byte count or a size like '4GiB', got {value!r}")
    if isinstance(value, (int, float)):
        num = float(value)
    else:
        m = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{field_name} must be a byte count or a size like '4GiB', got {value!r}")
        num = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if num <= 0:
        raise ValueError(f"{field_name} must be positive, got {value!r}")
    return int(num)


def validate_block_size(block_size: object) -> None:
    """Raise ValueError unless ``block_size`` is a power of two from 1 to 256 (the one rule)."""
    bs = block_size
    if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1 or bs > 256 or bs & (bs - 1):
        raise ValueError(f"block_size must be a power of two from 1 to 256, got {bs!r}")


def _f(default, help: str, **kw):
    """A dataclass field carrying its command-line help text."""
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class EngineConfig:
    """Every engine option. Units: tokens unless stated; memory in bytes.

    Raises ValueError from ``__post_init__`` naming the field for any invalid value.
    ``max_model_len=None`` is resolved from the model's config when the engine loads
    it (``dataclasses.replace``).
    """

    model: str = _f(DEFAULT_MODEL, "model alias, path to a .gguf file, or a Hugging Face model folder")
    tokenizer: str | None = _f(None, "tokenizer folder or .gguf (default: the model's own)")
    dtype: str = _f("auto", "weights and activations: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16")
    device: str = _f("auto", "auto, cpu or cuda")
    quantization: str | None = _f(None, "keep weights quantized at run time: int8 (weight-only), w8a8 (int8 weights and activations), int4 or gguf (default: float weights in dtype, or as stored for a checkpoint with a quantization_config)")
    quantization_group_size: int | None = _f(
        None, "int4 group size in input features: 32, 64, 128 or 256 (default per layer: 32 for a GGUF file's "
              "quantized weights, their own grid; else 128, or the largest of these that divides in_features)")
    kv_cache_dtype: str = _f("auto", "KV-cache storage: auto (the model dtype), bfloat16, fp8 (= fp8_e4m3), fp8_e5m2, int8")
    seed: int = _f(0, "global random seed (requests without their own seed)")
    max_model_len: int | None = _f(None, "maximum tokens per sequence, prompt + output (default: the model's context length)")
    block_size: int = _f(16, "tokens per KV-cache block (power of two, 1..256)")
    gpu_memory_utilization: float = _f(0.9, "fraction of GPU memory the engine may use (CUDA only)")
    kv_cache_memory: int | str | None = _f(None, "KV pool size on CPU in bytes or like '2GiB' (default 1GiB)")
    attention_backend: str | None = _f(
        None, "attention kernels: auto, torch, cpu, triton or flashinfer (default: $PAGEDLLM_ATTENTION_BACKEND, "
              "else auto)")
    enforce_eager: bool = _f(False, "run every step eagerly: no CUDA graphs for decode, no torch.compile")
    compilation_config: int | str | dict | None = _f(
        None, "torch.compile the forward (CPU): 0 = eager, 3 = compiled, or a JSON object of vLLM's "
              "fields; enforce_eager wins (default: eager)")
    num_kv_blocks: int | None = _f(None, "override the number of KV blocks (tests, benchmarks)")
    enable_prefix_caching: bool = _f(True, "share KV blocks between requests with a common prompt prefix")
    enable_chunked_prefill: bool = _f(True, "split long prompts across steps under the token budget")
    max_num_seqs: int = _f(128, "most sequences running at once")
    max_num_batched_tokens: int | None = _f(None, "token budget per step (default 2048 with chunked prefill, else max_model_len)")
    max_prefill_tokens_while_decoding: int | None = _f(
        None, "at most this many prompt tokens per step while requests decode (default: off offline, "
              f"{SERVING_CPU_PREFILL_TOKENS_WHILE_DECODING} for `serve` on CPU)")
    max_step_time_ratio: float | None = _f(
        None, "time-aware budget: prompt tokens join a decoding step while its predicted time stays within "
              "this multiple of the step without them (a number >= 1; 0 = off; default: off)")
    max_step_time_ms: float | None = _f(None, "time-aware budget: a decoding step may also grow to this many milliseconds (0 = off; default: off)")
    min_prefill_tokens_while_decoding: int | None = _f(
        None, "time-aware budget: prompt tokens a decoding step may always take (default: block_size; "
              f"{SERVING_CPU_MIN_PREFILL_TOKENS_WHILE_DECODING} for `serve` on CPU)")
    long_prefill_token_threshold: int = _f(
        0, "a prompt with more tokens left than this is long and computes at most this many per step "
           "(0 = off; default: off, or 4% of max_model_len when max_num_partial_prefills > 1)")
    max_num_partial_prefills: int = _f(1, "most requests whose prompt is partly computed at the end of a step")
    max_long_partial_prefills: int = _f(1, "most long prompts partly computed at once (shorter prompts pass them)")
    scheduling_policy: str = _f("fcfs", "fcfs or priority")
    batching: str = _f("continuous", "continuous, or static (admit a batch, wait for all of it; benchmarks only)")
    max_logprobs: int = _f(20, "largest logprobs / prompt_logprobs a request may ask for")
    max_waiting_requests: int | None = _f(None, "reject new requests (HTTP 503) beyond this many waiting")
    max_connections: int | None = _f(None, "`serve`: most concurrent connections and requests; beyond, HTTP 503 (default: no limit)")
    max_header_bytes: int = _f(16384, "`serve`: largest request head (path, query, headers) in bytes; beyond, HTTP 431")
    keep_alive_timeout_s: int = _f(5, "`serve`: seconds an idle keep-alive connection stays open")
    request_head_timeout_s: int = _f(10, "`serve`: seconds a client may take to send a request head; then it is disconnected")
    request_body_timeout_s: int = _f(60, "`serve`: seconds a client may take to send a request body once its head arrived; then 408 and disconnected")
    debug_integrity_checks: bool = _f(False, "check block pool and scheduler invariants after every step (slow)")
    kv_offload_memory: int | str | None = _f(None, "host-RAM tier of the prefix cache, in bytes or like '4GiB' (default: off)")
    kv_offload_dir: str | None = _f(None, "folder of the prefix cache's disk tier, which survives restarts (default: off)")
    kv_offload_disk_space: int | str | None = _f(None, "most bytes the disk tier keeps (default: the smaller of 8 GiB and half the folder's free space)")
    preemption_mode: str = _f("recompute", "when blocks run out: recompute, swap (to swap_space) or auto (whichever costs less)")
    swap_space: int | str = _f("4GiB", "swap space for preemption_mode swap/auto, in bytes or like '4GiB' (host memory)")
    usage_metrics: bool = _f(True, "add usage.metrics to responses: cached tokens by tier, preemptions, queue / prefill / decode time")
    usage_cached_tokens: bool = _f(True, "report cached-token counts in usage (a side channel across tenants: docs/robustness.md)")
    structured_outputs_compile_timeout_s: float = _f(30.0, "seconds one grammar's conversion and compile may take (in its own process) before its request fails")
    structured_outputs_compile_memory_mb: int | None = _f(2048, "MiB of address space a grammar compile may add to its process; a compile needing more fails its request (None: no limit)")
    chat_template_timeout_s: float = _f(10.0, "seconds rendering one conversation's chat template may take; past it that request fails (400)")
    trust_request_chat_template: bool = _f(False, "render a chat_template sent in a request (else 400): a template is code the server runs")
    tensor_parallel_size: int = _f(1, "ranks (processes; GPUs on CUDA) the weights and KV heads are split across; divides the heads")
    worker_timeout_s: float = _f(300.0, "tensor parallelism: seconds a call may wait on a worker before the engine fails naming it")
    data_parallel_size: int = _f(1, "`serve`: engine replicas, each a process with its own KV cache, behind one front end")
    data_parallel_router: str = _f("prefix", "`serve` with replicas: how a request picks one: prefix, least_loaded or round_robin")
    distributed_executor_backend: str = _f("mp", "tensor parallelism: mp (processes on this machine) or ray (Ray actors, the `ray` extra)")
    runner: str = _f("auto", "generate, pooling (embeddings, scores: encoders without a KV cache, a decoder's last "
                             "token), or auto: pooling for encoder-only checkpoints and sentence-transformers folders")
    pooler_config: str | dict | None = _f(None, "pooling runner: JSON like '{\"pooling_type\": \"MEAN\", \"normalize\": true}' "
                                                "(MEAN, CLS, LAST) (default: sentence-transformers' files, else CLS "
                                                "(encoders) or LAST (decoders), normalized)")
    disable_hybrid_kv_cache_manager: bool = _f(False, "keep every KV block of sliding-window layers instead of freeing those outside the window")
    reasoning_parser: str | None = _f(None, "`serve`: deepseek_r1 or qwen3, how the text marks its reasoning (default: from the chat template)")
    default_chat_template_kwargs: str | dict | None = _f(None, "`serve`: JSON object of chat-template variables for every request, like '{\"enable_thinking\": false}'")
    structured_outputs_config: str | dict | None = _f(
        None, "JSON like '{\"enable_in_reasoning\": true}': with a reasoning parser the grammar then covers the "
              "reasoning too (default: it starts after the reasoning's end tag)")
    generation_config: str = _f("auto", "`serve`: defaults for omitted sampling fields: auto (generation_config.json), vllm (none) or a folder")
    speculative_config: str | dict | None = _f(
        None, "speculative decoding: a JSON object of vLLM's fields, like '{\"method\": \"ngram\", "
              "\"num_speculative_tokens\": 4}' (methods: ngram, suffix, draft_model; "
              "docs/speculative-decoding.md) (default: off)")
    enable_lora: bool = _f(False, "serve LoRA adapters (PEFT folders) over the base model, chosen per request (docs/lora.md)")
    max_loras: int = _f(1, "LoRA: most adapters in one batch (device slots); requests of others wait")
    max_lora_rank: int = _f(16, "LoRA: largest adapter rank r accepted (slot size)")
    max_cpu_loras: int | None = _f(None, "LoRA: loaded adapters kept in host memory, least recently used dropped (default: max_loras)")
    lora_modules: list[str] | None = _f(None, "LoRA: adapters at start as name=path (several: --lora-modules a=DIR1 b=DIR2)")
    allow_runtime_lora_updating: bool = _f(False, "`serve`: allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
    lora_allowed_dirs: list[str] | None = _f(None, "`serve`: folders /v1/load_lora_adapter may read adapters from (required for run-time loading)")

    def __post_init__(self) -> None:
        validate_block_size(self.block_size)
        CompilationConfig.parse(self.compilation_config)
        StructuredOutputsConfig.parse(self.structured_outputs_config)
        SpeculativeConfig.parse(self.speculative_config)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or None, "
                             f"got {self.quantization!r}")
        if self.quantization_group_size is not None and self.quantization_group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"quantization_group_size must be one of {INT4_GROUP_SIZES}, "
                             f"got {self.quantization_group_size!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.attention_backend is None:
            object.__setattr__(self, "attention_backend", envs.attention_backend())
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {u!r}")
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory)
        if self.kv_offload_memory is not None:
            parse_bytes(self.kv_offload_memory, "kv_offload_memory")
        if self.kv_offload_disk_space is not None:
            parse_bytes(self.kv_offload_disk_space, "kv_offload_disk_space")
        parse_bytes(self.swap_space, "swap_space")
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            raise ValueError(f"preemption_mode must be recompute, swap or auto, got {self.preemption_mode!r}")
        if self.kv_offload_dir is not None and (not isinstance(self.kv_offload_dir, str) or not self.kv_offload_dir):
            raise ValueError(f"kv_offload_dir must be a folder path, got {self.kv_offload_dir!r}")
        self._positive("max_model_len", allow_none=True)
        self._positive("num_kv_blocks", allow_none=True)
        self._positive("max_num_seqs")
        self._positive("max_num_batched_tokens", allow_none=True)
        self._positive("max_prefill_tokens_while_decoding", allow_none=True)
        self._check_step_time_targets()
        self._positive("min_prefill_tokens_while_decoding", allow_none=True)
        self._positive("max_waiting_requests", allow_none=True)
        for name in ("max_connections", "max_header_bytes", "keep_alive_timeout_s", "request_head_timeout_s",
                     "request_body_timeout_s"):
            self._positive(name, allow_none=name == "max_connections")
        self._check_partial_prefills()
        self._check_lora()
        self._positive("tensor_parallel_size")
        self._positive("data_parallel_size")
        if self.data_parallel_router not in DATA_PARALLEL_ROUTERS:
            raise ValueError(f"data_parallel_router must be one of {', '.join(DATA_PARALLEL_ROUTERS)}, "
                             f"got {self.data_parallel_router!r}")
        if self.tensor_parallel_size > 1 and self.quantization == "gguf":
            raise ValueError("quantization='gguf' is not supported with tensor_parallel_size > 1 (GGUF blocks "
                             "cannot be split along input features); use int8 or int4")
        if self.tensor_parallel_size > 1 and self.kv_offload_dir is not None:
            raise ValueError("kv_offload_dir (the disk tier) is not supported with tensor_parallel_size > 1: "
                             "every rank would write its shard's blocks to the same files")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}, "
                             f"got {self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError("distributed_executor_backend='ray' needs Ray, which is not installed: "
                             "pip install 'pagedllm[ray]'")
        for name in ("chat_template_timeout_s", "structured_outputs_compile_timeout_s"):
            t = getattr(self, name)
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {t!r}")
        t = self.structured_outputs_compile_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"structured_outputs_compile_timeout_s must be a positive number of seconds, got {t!r}")
        self._positive("structured_outputs_compile_memory_mb", allow_none=True)
        if isinstance(self.worker_timeout_s, bool) or not isinstance(self.worker_timeout_s, (int, float)) \
                or not self.worker_timeout_s > 0:
            raise ValueError(f"worker_timeout_s must be a positive number of seconds, got {self.worker_timeout_s!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be 'auto', 'generate' or 'pooling', got {self.runner!r}")
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching must be 'continuous' or 'static', got {self.batching!r}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        if (self.max_num_batched_tokens is not None and self.max_model_len is not None
                and not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when enable_chunked_prefill is off, or a long prompt could never run")

    def _check_lora(self) -> None:
        """The LoRA fields: positive sizes, ``max_cpu_loras >= max_loras``, ``name=path`` modules with
        distinct names; any of them set without ``enable_lora`` is an error naming it."""
        for name in ("max_loras", "max_lora_rank"):
            self._positive(name)
        if self.max_lora_rank > 512:
            raise ValueError(f"max_lora_rank must be at most 512, got {self.max_lora_rank}")
        self._positive("max_cpu_loras", allow_none=True)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        self.lora_module_paths()
        if not self.enable_lora:
            for name in ("lora_modules", "allow_runtime_lora_updating", "lora_allowed_dirs"):
                if getattr(self, name):
                    raise ValueError(f"{name} needs enable_lora")
        if self.allow_runtime_lora_updating and not self.lora_allowed_dirs:
            raise ValueError("allow_runtime_lora_updating needs lora_allowed_dirs (the folders adapters may be read from)")
        if self.lora_allowed_dirs is not None and (not isinstance(self.lora_allowed_dirs, (list, tuple)) or not all(
                isinstance(d, str) and d for d in self.lora_allowed_dirs)):
            raise ValueError(f"lora_allowed_dirs must be a list of folder paths, got {self.lora_allowed_dirs!r}")

    def lora_module_paths(self) -> dict[str, str]:
        """``lora_modules`` as ``{name: path}`` (entries ``name=path``, or a dict); ValueError naming the field."""
        value = self.lora_modules
        if value is None:
            return {}
        if isinstance(value, dict):
            items = list(value.items())
        elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            items = [v.partition("=")[::2] for v in value]
        else:
            raise ValueError(f"lora_modules must be a list of name=path entries, got {value!r}")
        paths: dict[str, str] = {}
        for name, path in items:
            if not name or not path or not isinstance(name, str) or not isinstance(path, str):
                raise ValueError(f"lora_modules entries must be name=path, got {name!r}={path!r}")
            if name in paths:
                raise ValueError(f"lora_modules names adapter {name!r} twice")
            paths[name] = path
        return paths

    @property
    def resolved_max_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    def _check_step_time_targets(self) -> None:
        """``max_step_time_ratio``: None, 0 (off) or a finite number >= 1; ``max_step_time_ms``:
        None, 0 (off) or a finite positive number. Each error names the field."""
        for name, lowest in (("max_step_time_ratio", 1.0), ("max_step_time_ms", 0.0)):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or (v != 0 and not v >= lowest) or v < 0:
                rule = "a number >= 1" if lowest else "a positive number of milliseconds"
                raise ValueError(f"{name} must be 0 (off) or {rule}, got {v!r}")

    @property
    def is_step_time_budget_on(self) -> bool:
        """Whether the time-aware token budget applies (a target set, chunked prefill on)."""
        return self.enable_chunked_prefill and bool(self.max_step_time_ratio or self.max_step_time_ms)

    def _check_partial_prefills(self) -> None:
        """vLLM's rules for ``long_prefill_token_threshold`` / ``max_num_partial_prefills`` /
        ``max_long_partial_prefills`` (vllm/config/scheduler.py), each error naming the field."""
        self._positive("max_num_partial_prefills")
        self._positive("max_long_partial_prefills")
        t = self.long_prefill_token_threshold
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ValueError(f"long_prefill_token_threshold must be a non-negative integer (0 = off), got {t!r}")
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ValueError(f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be <= "
                             f"max_num_partial_prefills ({self.max_num_partial_prefills})")
        if self.max_num_partial_prefills > 1 and not self.enable_chunked_prefill:
            raise ValueError("max_num_partial_prefills > 1 needs enable_chunked_prefill")
        if t and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold needs enable_chunked_prefill (it splits prompts)")
        if self.max_model_len is not None and t > self.max_model_len:
            raise ValueError(f"long_prefill_token_threshold ({t}) must be <= max_model_len ({self.max_model_len})")

    def _positive(self, name: str, allow_none: bool = False) -> None:
        v = getattr(self, name)
        if v is None and allow_none:
            return
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")

    @property
    def compilation(self) -> CompilationConfig:
        """``compilation_config`` parsed; mode 0 (eager) with ``enforce_eager``, as in vLLM."""
        parsed = CompilationConfig.parse(self.compilation_config)
        return dataclasses.replace(parsed, mode=0) if self.enforce_eager and parsed.is_compiled else parsed

    @property
    def structured_outputs(self) -> StructuredOutputsConfig:
        """``structured_outputs_config`` parsed."""
        return StructuredOutputsConfig.parse(self.structured_outputs_config)

    @property
    def speculative(self) -> "SpeculativeConfig | None":
        """``speculative_config`` parsed; None when speculative decoding is off."""
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def kv_cache_memory_bytes(self) -> int:
        """The CPU KV pool budget in bytes (default 1 GiB)."""
        return parse_bytes(self.kv_cache_memory) if self.kv_cache_memory is not None else 1024**3

    @property
    def kv_offload_memory_bytes(self) -> int:
        """The host tier's size in bytes (0 when off)."""
        return parse_bytes(self.kv_offload_memory, "kv_offload_memory") if self.kv_offload_memory is not None else 0

    @property
    def kv_offload_disk_space_bytes(self) -> int:
        """The disk tier's bound in bytes (the default needs ``kv_offload_dir`` to exist)."""
        if self.kv_offload_disk_space is None:
            import shutil

            return min(8 << 30, shutil.disk_usage(self.kv_offload_dir).free // 2)
        return parse_bytes(self.kv_offload_disk_space, "kv_offload_disk_space")

    @property
    def swap_space_bytes(self) -> int:
        """The swap space in bytes (allocated only when ``preemption_mode`` is not recompute)."""
        return parse_bytes(self.swap_space, "swap_space")

    @property
    def long_prefill_threshold(self) -> int:
        """``long_prefill_token_threshold`` resolved (0 = off): unset with ``max_num_partial_prefills``
        > 1 it is 4% of ``max_model_len``, as vLLM resolves it."""
        if self.long_prefill_token_threshold or self.max_num_partial_prefills == 1:
            return self.long_prefill_token_threshold
        assert self.max_model_len is not None, "max_model_len must be resolved first"
        return max(1, int(self.max_model_len * 0.04))

    @property
    def token_budget(self) -> int:
        """Tokens the scheduler may schedule in one step (``max_num_batched_tokens`` resolved)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.enable_chunked_prefill:
            return 2048
        assert self.max_model_len is not None, "max_model_len must be resolved first"
        return max(self.max_model_len, 2048)

    def with_serving_defaults(self, device_type: str) -> "EngineConfig":
        """The config a server runs with on ``device_type`` ("cpu", "cuda"). On CPU, with the
        time-aware budget on (``max_step_time_ratio`` / ``max_step_time_ms`` set), an unset
        ``min_prefill_tokens_while_decoding`` becomes SERVING_CPU_MIN_PREFILL_TOKENS_WHILE_DECODING;
        with it off (the default) an
        unset ``max_prefill_tokens_while_decoding`` becomes SERVING_CPU_PREFILL_TOKENS_WHILE_DECODING
        instead. A value set explicitly is kept (the cap and the budget both apply then)."""
        if device_type != "cpu":
            return self
        config = self
        if not config.is_step_time_budget_on:
            if config.max_prefill_tokens_while_decoding is None:
                config = config.replace(max_prefill_tokens_while_decoding=SERVING_CPU_PREFILL_TOKENS_WHILE_DECODING)
        elif config.min_prefill_tokens_while_decoding is None:
            config = config.replace(min_prefill_tokens_while_decoding=SERVING_CPU_MIN_PREFILL_TOKENS_WHILE_DECODING)
        return config

    def replace(self, **changes) -> "EngineConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


def engine_arg_names() -> list[str]:
    """Names of every EngineConfig field: the keyword arguments ``LLM`` accepts."""
    return [f.name for f in dataclasses.fields(EngineConfig)]


# ---------------------------------------------------------------- structured_outputs_config
_STRUCTURED_FIELD = "structured_outputs_config"


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's ``--structured-outputs-config`` (the keys this engine implements).

    Attributes:
        enable_in_reasoning: with a reasoning parser, the grammar covers the reasoning block too;
            False (vLLM's default): the grammar starts after the block's end tag, reasoning is free.
        backend: ``auto`` or ``xgrammar`` (the one backend).

    Raises ValueError naming the field (``structured_outputs_config.<name>``) for a bad value.
    """

    enable_in_reasoning: bool = False
    backend: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.enable_in_reasoning, bool):
            raise ValueError(f"{_STRUCTURED_FIELD}.enable_in_reasoning must be true or false, "
                             f"got {self.enable_in_reasoning!r}")
        if self.backend not in ("auto", "xgrammar"):
            raise ValueError(f"{_STRUCTURED_FIELD}.backend must be auto or xgrammar, got {self.backend!r}")

    @classmethod
    def parse(cls, value: "StructuredOutputsConfig | dict | str | None") -> "StructuredOutputsConfig":
        """The config for None, a dict, a JSON object string or a config; ValueError naming the field."""
        if value is None or isinstance(value, cls):
            return value or cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{_STRUCTURED_FIELD} must be a JSON object, got {value!r} ({e.msg})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{_STRUCTURED_FIELD} must be a JSON object, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"{_STRUCTURED_FIELD} has unknown keys {unknown}; known: {', '.join(sorted(known))}")
        return cls(**value)


# ---------------------------------------------------------------- compilation_config
# vLLM's option and names. Accepted forms, as vLLM accepts them: None (eager), a mode (0 or 3),
# a dict or a JSON object string (the --compilation-config flag), or a CompilationConfig.
COMPILATION_BACKENDS = ("inductor", "aot_eager", "eager")
_COMPILATION_FIELD = "compilation_config"


class CompilationMode(IntEnum):
    """vLLM's ``CompilationMode`` values this engine implements."""

    NONE = 0  # eager
    VLLM_COMPILE = 3  # the model compiled around the opaque paged-attention op


@dataclass(frozen=True)
class CompilationConfig:
    """How the model runner compiles the model's forward (``pagedllm.compilation``).

    Attributes:
        mode: 0 (eager, the default) or 3 (torch.compile of the whole forward, paged attention an
            opaque custom op; vLLM's ``VLLM_COMPILE``).
        backend: ``inductor`` (fused C++ kernels), or ``aot_eager`` / ``eager`` (trace only: debugging).
        dynamic: one graph with the token count symbolic (default); False compiles a graph per
            size in ``compile_sizes`` and runs other sizes eagerly.
        compile_sizes: positive token counts compiled and warmed up at start-up (with ``dynamic``
            the sizes that specialise, 1 and one size >= 2, are added).
        inductor_compile_config: ``torch._inductor.config`` options while compiling; default
            ``{"freezing": True}`` (weights become constants, folded and prepacked for oneDNN).

    Raises ValueError naming the field (``compilation_config.<name>``) for a bad value.
    """

    mode: int = CompilationMode.NONE
    backend: str = "inductor"
    dynamic: bool = True
    compile_sizes: tuple[int, ...] = ()
    inductor_compile_config: dict[str, Any] = field(default_factory=lambda: {"freezing": True})

    def __post_init__(self) -> None:
        f = _COMPILATION_FIELD
        if isinstance(self.mode, bool) or not isinstance(self.mode, int) or self.mode not in tuple(CompilationMode):
            raise ValueError(f"{f}.mode must be 0 (eager) or 3 (compiled), got {self.mode!r}")
        object.__setattr__(self, "mode", CompilationMode(self.mode))
        if self.backend not in COMPILATION_BACKENDS:
            raise ValueError(f"{f}.backend must be one of {', '.join(COMPILATION_BACKENDS)}, got {self.backend!r}")
        if not isinstance(self.dynamic, bool):
            raise ValueError(f"{f}.dynamic must be true or false, got {self.dynamic!r}")
        sizes = self.compile_sizes
        if not isinstance(sizes, (list, tuple)) or any(
                isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"{f}.compile_sizes must be a list of positive integers, got {sizes!r}")
        object.__setattr__(self, "compile_sizes", tuple(sorted(set(sizes))))
        if not self.dynamic and not self.compile_sizes and self.is_compiled:
            raise ValueError(f"{f}.compile_sizes must not be empty when {f}.dynamic is false")
        if not isinstance(self.inductor_compile_config, dict) or not all(
                isinstance(k, str) for k in self.inductor_compile_config):
            raise ValueError(f"{f}.inductor_compile_config must be an object of inductor option names, "
                             f"got {self.inductor_compile_config!r}")

    @property
    def is_compiled(self) -> bool:
        return self.mode == CompilationMode.VLLM_COMPILE

    @classmethod
    def parse(cls, value: "CompilationConfig | dict | int | str | None") -> "CompilationConfig":
        """The config for any accepted form. Raises ValueError naming ``compilation_config``
        (or the bad key) for anything else."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            value = _parse_compilation_text(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(mode=value)
        if not isinstance(value, dict):
            raise ValueError(f"{_COMPILATION_FIELD} must be a mode (0 or 3), an object or a JSON object string, "
                             f"got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"{_COMPILATION_FIELD} has unknown keys {unknown}; known: {', '.join(sorted(known))}")
        options = dict(value)
        if "inductor_compile_config" in options and isinstance(options["inductor_compile_config"], dict):
            options["inductor_compile_config"] = {"freezing": True, **options["inductor_compile_config"]}
        return cls(**options)


def _parse_compilation_text(text: str) -> Any:
    """A command-line value: a bare mode (``"3"``) or a JSON object."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{_COMPILATION_FIELD} must be a mode (0 or 3) or a JSON object, "
                         f"got {text!r} ({e.msg})") from None


# ---------------------------------------------------------------- speculative_config
# vLLM's option and field names. Accepted forms: None (off), a dict, a JSON object string (the
# --speculative-config flag) or a SpeculativeConfig.
SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")
_SPECULATIVE_FIELD = "speculative_config"


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``pagedllm.spec_decode``): a proposer drafts tokens, one batched
    forward of the target verifies them.

    Attributes:
        method: ``ngram`` (prompt lookup over the prompt and the output so far), ``suffix``
            (suffix decoding over this request and recent requests' outputs) or ``draft_model``
            (a smaller model with the target's vocabulary drafts greedily, with its own KV cache).
        model: ``draft_model``: the draft model (a path or an alias, as ``EngineConfig.model``);
            its vocabulary size must equal the target's.
        num_speculative_tokens: most draft tokens per request and step (k; the verify step
            computes 1 + k query tokens per request).
        prompt_lookup_min / prompt_lookup_max: ``ngram``: the shortest / longest n-gram matched
            (vLLM's defaults: both 5 when neither is set, else the one set).
        suffix_decoding_max_tree_depth: ``suffix``: longest context (tokens) the suffix trees index.
        suffix_decoding_max_cached_requests: ``suffix``: finished requests' outputs kept (0 = this
            request only).
        suffix_decoding_max_spec_factor: ``suffix``: a draft is at most this × the matched length.
        suffix_decoding_min_token_prob: ``suffix``: a draft stops at a token whose estimated
            probability (its count among the continuations) is below this.
        disable_by_batch_size: never speculate in a step with at least this many running requests
            (vLLM's ``disable_by_batch_size``); the step-cost model also switches it off on its own.

    Raises ValueError naming the field (``speculative_config.<name>``) for a bad value.
    """

    method: str = "ngram"
    num_speculative_tokens: int | None = None
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        f = _SPECULATIVE_FIELD
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"{f}.method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if self.num_speculative_tokens is None:
            raise ValueError(f"{f}.num_speculative_tokens must be set (a positive integer)")
        _spec_int(self, "num_speculative_tokens", 1)
        self._check_model()
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        _spec_int(self, "prompt_lookup_min", 1)
        _spec_int(self, "prompt_lookup_max", 1)
        if hi < lo:
            raise ValueError(f"{f}.prompt_lookup_max ({hi}) must be >= {f}.prompt_lookup_min ({lo})")
        _spec_int(self, "suffix_decoding_max_tree_depth", 1)
        _spec_int(self, "suffix_decoding_max_cached_requests", 0)
        for name, lo_v, hi_v in (("suffix_decoding_max_spec_factor", 0.0, math.inf),
                                 ("suffix_decoding_min_token_prob", 0.0, 1.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo_v <= v <= hi_v or math.isnan(v):
                raise ValueError(f"{f}.{name} must be a number in [{lo_v}, {hi_v}], got {v!r}")
        if self.disable_by_batch_size is not None:
            _spec_int(self, "disable_by_batch_size", 1)

    def _check_model(self) -> None:
        f = _SPECULATIVE_FIELD
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model.strip():
                raise ValueError(f"{f}.model must name the draft model (a path or an alias) for method "
                                 f"'draft_model', got {self.model!r}")
        elif self.model is not None:
            raise ValueError(f"{f}.model applies to method 'draft_model' only, got method {self.method!r}")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """The config for any accepted form (None: off). Raises ValueError naming
        ``speculative_config`` (or the bad key) for anything else."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{_SPECULATIVE_FIELD} must be a JSON object, got {value!r} ({e.msg})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{_SPECULATIVE_FIELD} must be an object or a JSON object string, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"{_SPECULATIVE_FIELD} has unknown keys {unknown}; known: {', '.join(sorted(known))}")
        return cls(**value)


def _spec_int(config: SpeculativeConfig, name: str, lowest: int) -> None:
    v = getattr(config, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < lowest:
        raise ValueError(f"{_SPECULATIVE_FIELD}.{name} must be an integer >= {lowest}, got {v!r}")
