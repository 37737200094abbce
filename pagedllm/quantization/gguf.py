"""``quantization="gguf"``: a GGUF file's blocks kept packed at run time, as the file stores them.

Every block type ``native/gguf_dot.c`` handles stays packed (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: the
types inside Q4_K_M / Q5_K_M / Q8_0 files), a fused layer (q/k/v, gate/up) as one segment of rows per part, each of
its own type. On a CPU with AVX512-VNNI each segment is repacked once at load (:mod:`pagedllm.ops.gguf_repack`:
tiles of 16 outputs, 4-bit codes kept 4-bit) and every step's rows are quantized to int8 blocks once and run
through the repacked GEMM, a prefill chunk as well as a decode batch. Elsewhere the blocks stay as the file stores
them: a step's rows up to :data:`DOT_MAX_ROWS` are dotted with the blocks (decode); more rows (prefill chunks,
large decode batches) dequantize each segment once per call into a reused panel, a tile of rows at a time, for
one matmul per tile: bfloat16 where oneDNN runs bfloat16 natively (:func:`bf16_panels`), else float32. Other
types (F16, BF16, I-quants...) load dequantized to float. An LM head tied to a Q8_0 embedding keeps Q8_0 blocks
beside the embedding's float rows; repacked, the embedding looks its rows up in the head's codes instead and drops
its float rows (where their values agree bit for bit).
"""

from __future__ import annotations

import functools
import logging
import threading

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from pagedllm.distributed.parallel_state import get_tensor_parallel_size
from pagedllm.ops import gguf_dot, gguf_repack, kernel_threads, recording
from pagedllm.quantization.base import LinearMethod, QuantizationConfig, replace_weight

logger = logging.getLogger("pagedllm")

Q = GGMLQuantizationType
KEPT_TYPES = tuple(Q[name] for name in gguf_dot.BLOCK_TYPES.values())
# Rows up to which the block dot product runs; above, a dequantized panel's matmul is faster (one dequantization
# per call costs about a float32 matmul of a few dozen rows; the crossing: benchmarks/gguf_kernels.py).
DOT_MAX_ROWS = 32
# float32 elements of one dequantized tile (16 MiB): a weight larger than this is dequantized a tile at a time.
_PANEL_ELEMENTS = 4 << 20


def row_bytes(in_features: int, kind: GGMLQuantizationType) -> int:
    block_size, type_size = GGML_QUANT_SIZES[kind]
    return in_features // block_size * type_size


class _Panel(threading.local):
    """One buffer per thread and dtype, grown to the largest tile asked for and reused by every layer."""

    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, torch.Tensor] = {}

    def take(self, rows: int, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        buffer = self.buffers.get(dtype)
        if buffer is None or buffer.numel() < rows * cols:
            buffer = self.buffers[dtype] = torch.empty(rows * cols, dtype=dtype)
        return buffer[:rows * cols].view(rows, cols)


_panel = _Panel()


def bf16_panels() -> bool:
    """Whether prefill panels are bfloat16: where oneDNN's bfloat16 matmul runs natively (AVX512-BF16 or AMX),
    it does the same products in about half the time of float32's; elsewhere float32."""
    if not _bf16_panels:
        # the instructions themselves: oneDNN also "supports" bfloat16 on plain AVX-512, by a slower emulation
        native = [getattr(torch.cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported",
                                                                          "_is_amx_tile_supported")]
        _bf16_panels.append(any(native) and torch.backends.mkldnn.is_available())
    return _bf16_panels[0]


_bf16_panels: list[bool] = []


def panel_linear(x: torch.Tensor, kind: int, blocks: torch.Tensor, in_features: int, out: torch.Tensor,
                 dtype: torch.dtype = torch.float32) -> None:
    """``out = x @ W.T``: x (T, K) of ``dtype`` (float32 or bfloat16), W the (N, row bytes) blocks of ggml type
    ``kind``, dequantized a tile of rows at a time into the reused panel of ``dtype``. float32 runs oneDNN's
    matmul on a packed tile where torch has it (its float32 code beats MKL's on non-Intel CPUs and matches it on
    Intel), else ``torch.mm``; bfloat16 sums in float32 and rounds each output once. out (T, N) float32, may be
    a view."""
    tile = max(16, _PANEL_ELEMENTS // in_features)
    for s in range(0, blocks.shape[0], tile):
        e = min(s + tile, blocks.shape[0])
        panel = gguf_dot.dequantize_rows(kind, blocks[s:e], in_features, out=_panel.take(e - s, in_features, dtype))
        if dtype == torch.bfloat16:
            out[:, s:e].copy_(torch.mm(x, panel.t()))
        elif _ONEDNN:
            packed = torch.ops.mkldnn._reorder_linear_weight(panel, x.shape[0])
            out[:, s:e] = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        else:
            torch.mm(x, panel.t(), out=out[:, s:e]) if out.is_contiguous() else out[:, s:e].copy_(x @ panel.t())


_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class GGUFLinearMethod(LinearMethod):
    """``segments``: (GGUF type, rows) per part, in output order (one for a plain layer). The loader fills
    ``layer.weight`` (N, widest part's row bytes) uint8, each part's rows zero-padded on the right; after
    loading each part is a ``gguf_blocks_<i>`` buffer (rows, its row bytes), or, where
    :func:`gguf_repack.available`, its repacked ``gguf_codes_<i>``, ``gguf_scale_<i>`` and ``gguf_min_<i>``.
    Raises ValueError for a type without a kernel."""

    # decode rows are kernel calls on pool buffers: a CPU decode graph records and replays them (with the file's
    # blocks, larger steps take the panel's torch ops, which the capture refuses: those sizes run eagerly)
    records_cpu_graphs = True

    def __init__(self, segments: list[tuple[GGMLQuantizationType, int]]) -> None:
        for kind, _ in segments:
            if kind not in KEPT_TYPES:
                raise ValueError(f"GGUF type {kind.name} cannot be kept packed (kept: "
                                 f"{', '.join(k.name for k in KEPT_TYPES)})")
        self.segments = list(segments)

    def row_width(self, in_features: int) -> int:
        return max(row_bytes(in_features, kind) for kind, _ in self.segments)

    def create_weights(self, layer: nn.Module) -> None:
        if sum(rows for _, rows in self.segments) != layer.out_features:
            raise ValueError(f"GGUF segments cover {sum(r for _, r in self.segments)} rows, the layer has "
                             f"{layer.out_features}")
        layer.weight_dtype = layer.weight.dtype
        raw = torch.zeros(layer.out_features, self.row_width(layer.in_features), dtype=torch.uint8,
                          device=layer.weight.device)
        replace_weight(layer, raw)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        raw, start = layer.weight.detach().cpu(), 0
        for i, (kind, rows) in enumerate(self.segments):
            layer.register_buffer(f"gguf_blocks_{i}", raw[start:start + rows, :row_bytes(layer.in_features, kind)]
                                  .contiguous())
            start += rows
        replace_weight(layer, None)
        layer._gguf_bias = None if layer.bias is None else layer.bias.detach().float().contiguous()
        self.repack(layer)

    def repack(self, layer: nn.Module) -> None:
        """The ``gguf_blocks_<i>`` replaced by their repacked layout where :func:`gguf_repack.available`:
        consecutive segments of one layout joined (:func:`gguf_repack.concat_rows`; a fused q/k/v of one type is
        one product), each piece's ``gguf_codes_<j>``, ``gguf_scale_<j>`` and ``gguf_min_<j>``."""
        layer._gguf_repacked = None
        if not gguf_repack.available():
            return
        parts = list(self._parts(layer))
        repacked = gguf_repack.concat_rows([gguf_repack.repack(kind, blocks, layer.in_features)
                                            for kind, blocks, _ in parts])
        for i in range(len(parts)):
            del layer._buffers[f"gguf_blocks_{i}"]
        for j, w in enumerate(repacked):
            for name in ("codes", "scale", "min"):
                layer.register_buffer(f"gguf_{name}_{j}", getattr(w, name))
        layer._gguf_repacked = repacked

    def _parts(self, layer: nn.Module):
        """(ggml type id, blocks, first output row) per segment (before :meth:`repack`)."""
        start = 0
        for i, (kind, rows) in enumerate(self.segments):
            yield int(kind), getattr(layer, f"gguf_blocks_{i}"), start
            start += rows

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype not in (torch.float32, torch.bfloat16) or not x2.is_cpu:
            raise ValueError(f"quantization='gguf' runs float32/bfloat16 activations on the CPU, got {x2.dtype} "
                             f"on {x2.device}")
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if layer._gguf_repacked is not None:
            out = gguf_repack.linear(layer._gguf_repacked, x2, layer._gguf_bias)
        elif x2.shape[0] <= DOT_MAX_ROWS:
            out = self._dot(layer, x2)
        else:
            out = self._dequantized_matmul(layer, x2)
        out = out if out.dtype == x.dtype else out.to(x.dtype)
        return out.view(*x.shape[:-1], layer.out_features)

    def _dot(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The kernel called directly per segment (shapes were checked when the blocks were stored), each call
        recorded into an active CPU decode graph."""
        rows = gguf_dot.quantize_rows(x)
        m, k = x.shape
        out = torch.empty(m, layer.out_features)
        kernel, path = gguf_dot.kernel(), gguf_dot.process_isa()
        bias = layer._gguf_bias
        for kind, blocks, start in self._parts(layer):
            n = blocks.shape[0]
            rc = recording.call(kernel.dot, kind, blocks.data_ptr(), blocks.stride(0), n, k, rows.q.data_ptr(),
                                rows.d.data_ptr(), rows.s.data_ptr(), rows.s16.data_ptr(), m,
                                None if bias is None else bias.data_ptr() + 4 * start, out.data_ptr() + 4 * start,
                                out.stride(0), path, gguf_dot.num_threads(n * k), keep=(blocks, bias),
                                task=(kernel.dot_task, kernel_threads.num_threads(m, n, k, spinning=True)))
            if rc != 0:
                raise MemoryError(f"gguf_dot_rows: no memory for the activation scales of {m} rows")
        return out

    def panel_dtype(self) -> torch.dtype:
        """The dtype of this layer's dequantized tiles (:func:`bf16_panels`)."""
        return torch.bfloat16 if bf16_panels() else torch.float32

    def _dequantized_matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x (T, K) @ W.T through tiles of W dequantized to :meth:`panel_dtype` (the reused panel); out (T, N)
        float32."""
        dtype = self.panel_dtype()
        xp = x if x.dtype == dtype else x.to(dtype)
        out = torch.empty(x.shape[0], layer.out_features)
        for kind, blocks, start in self._parts(layer):
            panel_linear(xp, kind, blocks, layer.in_features, out[:, start:start + blocks.shape[0]], dtype)
        return out if layer._gguf_bias is None else out.add_(layer._gguf_bias)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        if layer._gguf_repacked is not None:
            return torch.cat([gguf_repack.values(w) for w in layer._gguf_repacked])
        return torch.cat([gguf_dot.dequantize_rows(kind, blocks, layer.in_features)
                          for kind, blocks, _ in self._parts(layer)])


class GGUFTiedHeadMethod(GGUFLinearMethod):
    """An LM head tied to the embedding, as Q8_0 blocks of its rows (a GGUF file's Q8_0 embedding; int4's tied head):
    the embedding keeps its float rows (the lookup), the head Q8_0 blocks rebuilt from those rows after loading
    (Q8_0's rule gives back the bytes llama.cpp writes exactly; a block written otherwise, or float rows, come back
    within Q8_0's rounding)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__([(Q.Q8_0, vocab_size)])
        self._embedding: torch.Tensor | None = None
        self._embedding_module: nn.Module | None = None

    def tie(self, embedding: nn.Module) -> None:
        self._embedding_module = embedding

    def create_weights(self, layer: nn.Module) -> None:
        self._embedding = layer.weight  # the embedding's parameter, filled by load_weights
        layer.weight_dtype = layer.weight.dtype
        replace_weight(layer, None)

    def panel_dtype(self) -> torch.dtype:
        """float32: the logits keep float32's precision whatever the panel dtype of the other layers."""
        return torch.float32

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        rows = self._embedding.detach().cpu().float().contiguous()
        layer.register_buffer("gguf_blocks_0", gguf_dot.quantize_q8_0(rows))
        self._embedding = None
        layer._gguf_bias = None
        self.repack(layer)
        self._serve_lookups(layer, rows)

    def _serve_lookups(self, layer: nn.Module, rows: torch.Tensor) -> None:
        """Where the head is repacked, its values equal the embedding's rows bit for bit (checked) and the
        embedding is a plain one (not a vocabulary shard), the embedding looks its rows up in the head's codes and
        drops its float weight: one copy of the vocabulary instead of two. Under tensor parallelism the embedding is a
        vocabulary shard and keeps its rows."""
        embedding, weight = self._embedding_module, layer._gguf_repacked
        self._embedding_module = None
        if weight is None or not callable(getattr(embedding, "use_lookup", None)) or embedding.weight is None \
                or get_tensor_parallel_size() != 1 or embedding.weight.shape != rows.shape:
            return
        dtype = embedding.weight.dtype
        if dtype not in (torch.float32, torch.bfloat16):
            return
        step = max(1, (1 << 22) // rows.shape[1])
        for start in range(0, rows.shape[0], step):  # the check a tile of rows at a time
            ids = torch.arange(start, min(start + step, rows.shape[0]))
            if not torch.equal(gguf_repack.values(weight[0], rows=ids), rows[start:start + step]):
                return
        embedding.use_lookup(functools.partial(_lookup, weight[0], dtype))


def _lookup(weight: gguf_repack.RepackedWeight, dtype: torch.dtype, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a repacked tied head, in ``dtype``: (*ids.shape, hidden)."""
    out = gguf_repack.values(weight, out=torch.empty(ids.numel(), weight.in_features, dtype=dtype), rows=ids)
    return out.view(*ids.shape, weight.in_features)


class GGUFConfig(QuantizationConfig):
    """Keeps a layer packed when each of its checkpoint tensors (``fused_parts``: leaf -> parts, in output
    order) has a kept type and its in_features is a multiple of that type's block."""

    name = "gguf"

    def __init__(self, tensor_types: dict[str, GGMLQuantizationType], fused_parts: dict[str, list[str]]) -> None:
        self.tensor_types = tensor_types
        self.fused_parts = fused_parts
        self._packed: dict[str, int] = {}
        self.num_kept = self.num_float = 0
        self.kept_types: dict[str, int] = {}

    def get_linear_method(self, prefix: str, layer: nn.Module) -> LinearMethod | None:
        parent, _, leaf = prefix.rpartition(".")
        parts = [f"{parent}.{p}.weight" if parent else f"{p}.weight" for p in self.fused_parts.get(leaf, [leaf])]
        sizes = list(getattr(layer, "output_sizes", [layer.out_features]))
        if not all(p in self.tensor_types for p in parts) or len(sizes) != len(parts):  # stored under its own name
            parts, sizes = [f"{prefix}.weight"], [layer.out_features]
        kinds = [self.tensor_types.get(p) for p in parts]
        if any(kind not in KEPT_TYPES or layer.in_features % GGML_QUANT_SIZES[kind][0] for kind in kinds) \
                or gguf_dot.kernel() is None:
            self.num_float += 1
            return None
        method = GGUFLinearMethod(list(zip(kinds, sizes)))
        width = method.row_width(layer.in_features)
        self._packed.update({p: width for p in parts})
        for kind in kinds:
            self.kept_types[kind.name] = self.kept_types.get(kind.name, 0) + 1
        self.num_kept += 1
        return method

    def get_tied_head_method(self, layer: nn.Module) -> LinearMethod | None:
        """Q8_0 blocks for a head tied to a Q8_0 embedding (``model.embed_tokens.weight``), else None."""
        if self.tensor_types.get("model.embed_tokens.weight") != Q.Q8_0 or layer.in_features % 32 \
                or gguf_dot.kernel() is None:
            return None
        self.kept_types["Q8_0"] = self.kept_types.get("Q8_0", 0) + 1
        self.num_kept += 1
        return GGUFTiedHeadMethod(layer.out_features)

    def describe(self) -> str:
        kept = ", ".join(f"{name} {count}" for name, count in sorted(self.kept_types.items()))
        layout = "; repacked for AVX512-VNNI" if self.num_kept and gguf_repack.available() else ""
        return f"gguf blocks (tensors: {kept or 'none'}; {self.num_float} linear layers float{layout})"

    @property
    def packed_weight_names(self) -> dict[str, int]:
        """The checkpoint names the loader yields as block bytes -> the row width they are zero-padded to."""
        return dict(self._packed)
