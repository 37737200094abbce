"""The native replay of a CPU decode graph (pagedllm/ops/graph_replay.py, native/graph_replay.c): every kernel's
task form, run by a team of 1, 2 or 3 threads (uneven shares), writes bitwise what the kernel's own call wrote;
a failing task is named; a recording with a call that has no task form gets no program."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pagedllm.ops import graph_replay, gguf_dot, gguf_repack, int8_gemm, recording, skinny_gemm
from pagedllm.ops.activation import act_and_mul
from pagedllm.ops.library import cpu_ops
from pagedllm.ops.norm import fused_add_rms_norm_, rms_norm
from pagedllm.ops.rotary import rope_qk
from tests.gguf_blocks import random_blocks

pytestmark = pytest.mark.skipif(graph_replay.kernel() is None or cpu_ops() is None,
                                reason="the native replay or the fused CPU kernels cannot be built here")
THREADS = [1, 2, 3]


class _KeepTensors(TorchDispatchMode):
    """Keeps every tensor made while recording alive (the wrappers' intermediates: the recorded calls point into
    them), as the CPU decode graph's capture guard does."""

    def __init__(self, rec: recording.Recording) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.rec.keep.extend(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def _replay_matches(record, outputs_of, threads: int, restore=lambda: None) -> None:
    """Run ``record()`` under a recording (eager values), overwrite the outputs, run the program on ``threads``
    threads and compare bitwise. ``restore`` puts in-place inputs back first."""
    rec = recording.Recording()
    with recording.recording(rec), _KeepTensors(rec):
        results = record()
    expected = [t.clone() for t in outputs_of(results)]
    assert rec.tasks is not None and len(rec.tasks) == len(rec.calls)
    for t in outputs_of(results):
        t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-1)
    restore()
    graph_replay.Program(rec, threads).run()
    for got, want in zip(outputs_of(results), expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
def test_elementwise_kernels(threads, dtype, rows):
    """RMSNorm (plain and fused with the residual add, in place), gated activation and rotary with q/k norms."""
    g = torch.Generator().manual_seed(rows)
    dim, heads, kv_heads, head_dim = 64, 4, 2, 16
    x = torch.randn(rows, dim, generator=g).to(dtype)
    w = torch.randn(dim, generator=g).to(dtype)
    residual = torch.randn(rows, dim, generator=g).to(dtype)
    hidden = torch.randn(rows, dim, generator=g).to(dtype)
    gate_up = torch.randn(rows, 2 * 96, generator=g).to(dtype)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    cos_sin = torch.randn(rows, 2, head_dim, generator=g).to(dtype)
    qw, kw = (torch.randn(head_dim, generator=g).to(dtype) for _ in range(2))
    inputs = [t.clone() for t in (residual, hidden, qkv)]

    def record():
        normed = rms_norm(x, w, 1e-6, False)
        assert fused_add_rms_norm_(hidden, residual, w, 1e-6, True)
        act = act_and_mul(gate_up, "silu")
        q = rope_qk(qkv, cos_sin, heads, kv_heads, head_dim, qw, kw, 1e-6)
        return normed, act, q

    def restore():
        for t, saved in zip((residual, hidden, qkv), inputs):
            t.copy_(saved)

    _replay_matches(record, lambda r: [*r, hidden, residual, qkv], threads, restore)


@pytest.mark.skipif(not gguf_repack.available(), reason="the repacked GEMM needs AVX512-VNNI")
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("rows", [1, 4, 9])
def test_repacked_gguf_linear(threads, rows):
    """Activation quantization and the repacked products of a fused layer's two parts (Q4_1 and Q8_0), with a bias:
    80 + 50 outputs, tiles split unevenly."""
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(rows)
    k = 256
    parts = [gguf_repack.repack(int(kind), torch.from_numpy(random_blocks(kind, n, k, rng)), k)
             for kind, n in ((Q.Q4_1, 80), (Q.Q8_0, 50))]
    x, bias = torch.randn(rows, k), torch.randn(130)
    _replay_matches(lambda: gguf_repack.linear(parts, x, bias), lambda out: [out], threads)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("path", [p for p in gguf_dot.ISAS.values() if gguf_dot.kernel().isa_available(p)])
def test_gguf_block_dot(threads, path):
    """The block dot product on the file's own blocks (every path this CPU runs), as quantization='gguf' records it."""
    from gguf import GGMLQuantizationType as Q

    k, n, m = 256, 70, 3
    blocks = torch.from_numpy(random_blocks(Q.Q4_K, n, k, np.random.default_rng(0)))
    x, bias = torch.randn(m, k), torch.randn(n)
    kern = gguf_dot.kernel()

    def record():
        rows = gguf_dot.quantize_rows(x, path=path)
        out = torch.empty(m, n)
        recording.call(kern.dot, int(Q.Q4_K), blocks.data_ptr(), blocks.stride(0), n, k, rows.q.data_ptr(),
                       rows.d.data_ptr(), rows.s.data_ptr(), rows.s16.data_ptr(), m, bias.data_ptr(), out.data_ptr(),
                       out.stride(0), path, 1, task=(kern.dot_task, recording.TEAM))
        return rows, out

    _replay_matches(record, lambda r: [r[0].q, r[0].d, r[0].s, r[0].s16, r[1]], threads)


@pytest.mark.skipif(int8_gemm.load_kernel() is None, reason="the W8A8 kernel cannot be built here")
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("group", [None, 64])
@pytest.mark.parametrize("rows", [1, 6])
def test_int8_gemm(threads, group, rows):
    """W8A8 over 200 outputs (four panels, the last ragged) and K = 320 (a ragged last activation group)."""
    g = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (200, 320), dtype=torch.int8, generator=g)
    packed = int8_gemm.pack(q, torch.rand(200, generator=g) / 100, torch.randn(200, generator=g), group)
    x = torch.randn(rows, 320, generator=g)
    _replay_matches(lambda: int8_gemm.int8_linear(x, packed), lambda out: [out], threads)


@pytest.mark.skipif(skinny_gemm.load_kernel() is None, reason="the skinny GEMM cannot be built here")
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_gemm(threads, dtype):
    """The float32 panels and, where AVX512-BF16 runs, the bfloat16 pairs (both outputs); 300 outputs."""
    kern = skinny_gemm.load_kernel()
    if dtype == torch.bfloat16 and not kern.bf16_dp:
        pytest.skip("no AVX512-BF16 skinny kernel on this CPU")
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(300, 128, generator=g).to(dtype), torch.randn(300, generator=g)
    weight = (skinny_gemm.pack_panels(w, b, kern.panel_width) if dtype == torch.float32
              else skinny_gemm.pack_panels_bf16_pairs(w, b))
    x = torch.randn(7, 128, generator=g).to(dtype)

    def record():
        outs = [skinny_gemm.skinny_linear(x, weight, kern)]
        if dtype == torch.bfloat16:
            outs.append(skinny_gemm.skinny_linear(x, weight, kern, float32_out=True))
        return outs

    _replay_matches(record, lambda outs: outs, threads)


def test_failing_task_is_named():
    """A repacked product whose layout the kernel refuses (bits 3) fails the run with its call named."""
    if not gguf_repack.available():
        pytest.skip("the repacked GEMM needs AVX512-VNNI")
    rec = recording.Recording()
    kern = gguf_repack.kernel()
    args = (None, None, None, 0, 3, 32, 32, 16, 32, None, None, None, None, 1, None, None, 16, 1)
    rec.add(kern.dot, args, (kern.dot_task, 1))
    with pytest.raises(graph_replay.GraphReplayError, match="recorded call 0 \\(gguf_repack_dot\\)"):
        graph_replay.Program(rec, 2).run()


def test_a_call_without_a_task_form_leaves_no_program():
    rec = recording.Recording()
    rec.add_python(lambda: None)
    assert rec.tasks is None
    with pytest.raises(ValueError, match="without a task form"):
        graph_replay.Program(rec, 1)


def test_refresh_writes_every_struct_once_per_key_or_declines():
    """Hooks sharing a key run once per step and write each struct registered under it; one returning None makes
    the step decline (the caller replays from Python)."""

    class S(ctypes.Structure):
        _fields_ = [("v", ctypes.c_longlong)]

    calls, structs = [], [S(), S(), S()]
    value = [7]

    def hook():
        calls.append(1)
        return None if value[0] is None else {"v": value[0]}

    rec = recording.Recording()
    for s in structs:
        rec.add_python(lambda: None, [recording.Task(0, s, 1, "t")], ("key", hook))
    assert rec.refresh() and len(calls) == 1 and [s.v for s in structs] == [7, 7, 7]
    value[0] = None
    assert not rec.refresh()
