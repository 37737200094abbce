"""The model's forward compiled once at start-up with torch.compile (inductor), each layer's paged attention
an opaque op (:mod:`~pagedllm.compilation.attention_op`). Fused float32 rounds differently from eager: opt-in.
After :meth:`CompiledModel.warm_up` a step no graph fits runs eagerly; ``compute_logits`` and sampling stay eager."""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import torch
from torch import nn

from pagedllm.attention.backend import AttentionMetadata, set_forward_context
from pagedllm.compilation.attention_op import register_attention_layers
from pagedllm.config import CompilationConfig

logger = logging.getLogger("pagedllm")

# dynamic: T == 1 specialises; other T traced at 64, the batch hint freezing prepacks the weights for
_DYNAMIC_WARMUP_SIZES = (1, 64)
_LM_HEAD_BATCH_HINT = 64


class CompiledModel:
    """``model.forward`` compiled (``config.mode`` 3), the eager model as fallback. Raises ValueError naming
    ``compilation_config.inductor_compile_config`` for an option inductor does not know."""

    def __init__(self, model: nn.Module, config: CompilationConfig) -> None:
        if not config.is_compiled:
            raise ValueError("CompiledModel needs compilation_config.mode 3")
        self.model = model
        self.config = config
        self.compile_seconds = 0.0
        self.num_eager_fallbacks = 0
        self.is_warm = False
        register_attention_layers(model)
        _unpack_compiled_linears(model)
        options = None
        if config.backend == "inductor":
            options = _inductor_options(config.inductor_compile_config)
            _patch_inductor_linear_bias_check()
        self._compiled = torch.compile(model.forward, backend=config.backend, dynamic=config.dynamic,
                                       fullgraph=True, options=options)

    @property
    def warmup_sizes(self) -> tuple[int, ...]:
        if self.config.dynamic:
            return tuple(sorted(set(_DYNAMIC_WARMUP_SIZES) | set(self.config.compile_sizes)))
        return self.config.compile_sizes

    def runs_compiled(self, num_tokens: int) -> bool:
        return self.config.dynamic or num_tokens in self.config.compile_sizes

    def warm_up(self, make_metadata: Callable[[int], Sequence[AttentionMetadata]], device: torch.device) -> float:
        """Compile every graph now, one forward per :attr:`warmup_sizes`; returns the seconds."""
        t0 = time.perf_counter()
        # one graph per size with dynamic=False: more than dynamo's default limit of 8
        limit = max(torch._dynamo.config.recompile_limit, len(self.warmup_sizes) + 1)
        for num_tokens in self.warmup_sizes:
            # inference tensors, as the runner's step inputs are: guards check the dispatch keys
            with torch._dynamo.config.patch(recompile_limit=limit), torch.inference_mode(), \
                    set_forward_context(list(make_metadata(num_tokens))):
                ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
                positions = torch.zeros(num_tokens, dtype=torch.int64, device=device)
                self._compiled(ids, positions)
        self.compile_seconds = time.perf_counter() - t0
        self.is_warm = True
        logger.info("torch.compile (%s%s): %d graph sizes compiled in %.1f s", self.config.backend,
                    ", dynamic token count" if self.config.dynamic else "", len(self.warmup_sizes),
                    self.compile_seconds)
        return self.compile_seconds

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not self.runs_compiled(input_ids.shape[0]):
            return self.model(input_ids, positions)
        if not self.is_warm:
            self.num_eager_fallbacks += 1
            return self.model(input_ids, positions)
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return self._compiled(input_ids, positions)
        except RuntimeError as e:  # raised before anything ran: no graph fits this step
            if "fail_on_recompile" not in str(e):
                raise
            self.num_eager_fallbacks += 1
            if self.num_eager_fallbacks == 1:
                logger.warning("a step of %d tokens fits no compiled graph; it and any such step run eagerly: %s",
                               input_ids.shape[0], e)
            return self.model(input_ids, positions)


def _unpack_compiled_linears(model: nn.Module) -> None:
    """Plain weights for the linears the graph traces (a oneDNN-packed weight is opaque to it); not lm_head."""
    if not hasattr(model, "unpack_linears"):
        return
    head = getattr(model, "lm_head", None)
    head_was_packed = getattr(head, "is_packed", False)
    model.unpack_linears()
    if head_was_packed:
        head.pack_for_cpu(_LM_HEAD_BATCH_HINT)


def _inductor_options(options: dict) -> dict:
    """``options`` checked against ``torch._inductor.config``. Raises ValueError naming the field."""
    import torch._inductor.config as inductor_config

    unknown = sorted(k for k in options if not hasattr(inductor_config, k.split(".")[0]))
    if unknown:
        raise ValueError(f"compilation_config.inductor_compile_config has unknown inductor options {unknown}")
    return dict(options)


def _patch_inductor_linear_bias_check() -> None:
    """Work around an inductor freezing bug (torch 2.13, CPU): its linear + add -> linear-with-bias pattern
    asserts on weights constant folding already froze; answer "not a bias add" for those. Idempotent."""
    try:
        from torch._inductor.fx_passes import mkldnn_fusion
        device_op = mkldnn_fusion.CpuMkldnnDeviceOp
    except (ImportError, AttributeError):
        return
    original = device_op.get_linear_transpose_weight
    if getattr(original, "_pagedllm_patched", False):
        return
    reorder = torch.ops.mkldnn._reorder_linear_weight

    def get_linear_transpose_weight(self, weight_node):
        if weight_node.target != reorder:  # a folded constant: make the bias check answer False
            return _NoMetaNode()
        return original(self, weight_node)

    get_linear_transpose_weight._pagedllm_patched = True
    device_op.get_linear_transpose_weight = get_linear_transpose_weight


class _NoMetaNode:

    class _Arg:
        meta: dict = {}

    args = (_Arg(),)
