"""The model's forward compiled once at start-up with torch.compile (inductor), never per step.

What is compiled: ``model.forward(input_ids, positions) -> hidden`` as one graph (embedding,
every decoder layer, the final norm), the paged attention of each layer an opaque op
(:mod:`pagedllm.compilation.attention_op`). Inductor fuses the element-wise work around the
matmuls (residual add + RMSNorm, rotary, SiLU-and-mul) into generated C++ loops and, with
``freezing``, treats the weights as constants: folded and prepacked for oneDNN once. The
fused loops round float32 differently from the eager ops (same math, other order), hence
opt-in.

Shapes: with ``dynamic=True`` the token count T is symbolic, so one graph serves every
step (traced at 64 tokens: the weights are prepacked for that batch size); torch
specialises T == 1, so a second graph is compiled for it. Both are compiled
by :meth:`CompiledModel.warm_up` at start-up. With ``dynamic=False`` one graph per size
in ``compile_sizes``, and other sizes run eagerly. After warm-up every call runs under
torch's ``fail_on_recompile`` stance: a step that would need a new graph runs eagerly
instead of compiling in the middle of serving (counted in :attr:`num_eager_fallbacks`).

Only model code reachable from ``forward`` is compiled; ``compute_logits`` (the lm_head
matmul on the sampled rows) and sampling stay eager.
"""

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

# A dynamic graph is compiled separately for T == 1 (torch's 0/1 specialisation) and traced
# at 64 tokens for every other T: freezing prepacks the linear weights for oneDNN with the
# traced token count as its batch hint, and 64 is the hint the eager path packs with.
_DYNAMIC_WARMUP_SIZES = (1, 64)
_LM_HEAD_BATCH_HINT = 64  # pack_linears_for_cpu's default


class CompiledModel:
    """``model.forward`` compiled, with the eager model as fallback.

    Args:
        model: a pagedllm model (``forward(input_ids, positions)``, ``unpack_linears()``).
            Its linear layers but the lm_head are unpacked (the compiled graph needs plain
            weights; freezing packs its own copy), so the eager fallback runs ``F.linear``.
        config: a compiled :class:`CompilationConfig` (``mode`` 3).

    Raises ValueError naming ``compilation_config.inductor_compile_config`` for an
    option inductor does not know.
    """

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
        """Token counts :meth:`warm_up` compiles."""
        if self.config.dynamic:
            return tuple(sorted(set(_DYNAMIC_WARMUP_SIZES) | set(self.config.compile_sizes)))
        return self.config.compile_sizes

    def runs_compiled(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` tokens runs the compiled graph (else eagerly)."""
        return self.config.dynamic or num_tokens in self.config.compile_sizes

    def warm_up(self, make_metadata: Callable[[int], Sequence[AttentionMetadata]], device: torch.device) -> float:
        """Compile every graph now: one forward per size in :attr:`warmup_sizes`, with
        ``make_metadata(num_tokens)`` (per KV-cache group) as the step's metadata (it must
        describe a valid batch of that many tokens on the bound caches: the attention runs,
        K/V are written). Returns the seconds it took, also in :attr:`compile_seconds`."""
        t0 = time.perf_counter()
        # one graph per size with dynamic=False: more than dynamo's default limit of 8 may be asked for
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
        """Same contract as ``model.forward`` (inside the step's ``set_forward_context``)."""
        if not self.runs_compiled(input_ids.shape[0]):
            return self.model(input_ids, positions)
        if not self.is_warm:  # never compile lazily in the middle of serving
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
    """Plain weights for the linears the graph traces (a oneDNN-packed weight is an opaque
    tensor torch.compile cannot trace; freezing packs its own copy). The lm_head stays as
    it was: ``compute_logits`` runs eagerly."""
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
    """Work around an inductor freezing bug (torch 2.13, CPU): its "linear + add -> linear with
    bias" pattern asserts that every oneDNN linear's weight is a ``_reorder_linear_weight``
    node, but constant folding has already turned some into frozen constants, and the
    assertion fails the whole compile. Answer "not a bias add" for those (the add then stays a
    fused element-wise op). Idempotent; a no-op on torch builds without the check."""
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
    """Stands in for the transposed-weight node: ``args[0].meta`` has no ``val``, which the
    bias check reads as "not a bias add"."""

    class _Arg:
        meta: dict = {}

    args = (_Arg(),)
