"""KV-cache memory waste: paged blocks vs contiguous worst-case reservation, on one trace.

Replays a seeded trace of chat requests through four admission policies sharing one
KV byte budget, one decode iteration at a time (no model: memory only):

- ``paged``: the engine's real :class:`pagedllm.core.kv_cache_manager.KVCacheManager`
  (blocks of ``--block-size`` tokens allocated as sequences grow; FCFS admission when
  the pool holds the prompt; when a decode cannot get a block the latest-admitted
  sequence is preempted by recompute, as the engine's scheduler does);
- ``contiguous_max_model_len``: each sequence reserves ``max_model_len`` slots at
  admission (the worst case; what pre-paging servers such as FasterTransformer and Orca
  do, Kwon et al. 2023 §3);
- ``contiguous_max_tokens``: each sequence reserves prompt + ``max_tokens`` slots;
- ``contiguous_oracle``: each sequence reserves exactly the slots it will ever fill
  (prompt + output − 1): a lower bound no real server reaches, since output lengths are
  unknown at admission.

The trace is modelled on ShareGPT as characterized in the vLLM paper (Kwon et al., SOSP
2023, §6.1 / Fig. 11): mean prompt 161 tokens, mean output 338 tokens. Lengths are drawn
from log-normals with those means and shape sigma = 1.0 (our assumption, giving medians
of 98 and 205 tokens); as in vLLM's benchmark filter, prompts longer than max_model_len/2
and sequences longer than max_model_len are redrawn, and lengths under 4 are redrawn.
Every request asks for ``max_tokens`` (default 1024) and stops at min(natural length,
max_tokens). The realized statistics are in the JSON record.

Metrics, each policy, time-weighted over the iterations until the trace drains:

- utilization = Σ live K/V slots ÷ Σ reserved slots (live = tokens whose K/V is stored);
  waste = 1 − utilization, split into *reservation* (reserved slots the sequence fills
  later) and *internal fragmentation* (reserved slots it never fills);
- pool utilization = Σ live ÷ (iterations × budget slots);
- peak and mean concurrent sequences within the budget; requests that could not be
  admitted on arrival (queued) and that can never fit; preemptions (paged only);
- iterations to drain the trace (a memory-only proxy for throughput: every iteration
  advances every running sequence by one token).

Presets (``--scenario``): ``smollm2`` (default: the engine's model, float32 K/V, the
engine's default 1 GiB pool, max_model_len 2048) and ``seeds`` (the design brief's
13B Llama at 2,048 context; see :func:`seeds_scenarios` for the byte budgets).

    python benchmarks/memory_waste.py                    # smollm2 preset, 1,000 requests
    python benchmarks/memory_waste.py --scenario seeds
    python benchmarks/memory_waste.py --quick            # 100 requests, < 2 s
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

import common

sys.path.insert(0, str(common.REPO_ROOT))
from pagedllm.core.kv_cache_manager import KVCacheManager  # noqa: E402
from pagedllm.core.request import Request  # noqa: E402
from pagedllm.planner import MODEL_SHAPES  # noqa: E402
from pagedllm.sampling_params import SamplingParams  # noqa: E402
from pagedllm.sizing import kv_bytes_per_token  # noqa: E402

GiB = 1024**3
# ShareGPT as characterized by Kwon et al. 2023 (vLLM paper, §6.1, Fig. 11), in tokens.
SHAREGPT_MEAN_PROMPT = 161.31
SHAREGPT_MEAN_OUTPUT = 337.99


# ---- scenarios --------------------------------------------------------------------------

@dataclass(frozen=True)
class Scenario:
    """A model's K/V geometry and the byte budget its KV cache gets.

    ``kv_bytes_per_token`` = 2 (K and V) × layers × KV heads × head_dim × element bytes.
    """

    name: str
    description: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype_bytes: int
    kv_budget_bytes: int
    max_model_len: int
    derivation: dict = field(default_factory=dict)

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self, self.kv_dtype_bytes)  # the engine's and the planner's formula

    @property
    def capacity_tokens(self) -> int:
        """K/V slots the budget holds."""
        return self.kv_budget_bytes // self.kv_bytes_per_token


def smollm2_scenario(kv_budget_bytes: int = GiB, max_model_len: int = 2048) -> Scenario:
    """SmolLM2-135M (30 layers, 3 KV heads × 64, float32 K/V) with the engine's default 1 GiB pool."""
    return Scenario("smollm2", "SmolLM2-135M, float32 K/V, the engine's default CPU KV pool",
                    30, 3, 64, 4, kv_budget_bytes, max_model_len,
                    {"kv_budget": f"{kv_budget_bytes / GiB:g} GiB (EngineConfig.kv_cache_memory default)"})


def seeds_scenarios(activation_reserve_bytes: int = GiB, gpu_memory_utilization: float = 0.9) -> list[Scenario]:
    """The design brief's 13B Llama (40 layers, hidden 5120 = 40 heads × 128, fp16 K/V,
    800 KiB per token) at 2,048 context, on two GPUs.

    fp16 weights are 13.0e9 × 2 B = 26.0 GB, more than a 24 GiB (25.8 GB) GPU holds, so
    the brief's "24 GB GPU" cannot run them at all. We give the two honest readings:

    - ``seeds_24gib_int8``: a 24 GiB GPU with 8-bit weights (13.0 GB);
    - ``seeds_a100_40gib_fp16``: the vLLM paper's own setting (Fig. 1: a 13B model on an
      A100 40 GB, 26 GB of fp16 weights).

    KV budget = gpu_memory_utilization × GPU memory − weights − activation reserve
    (vLLM's sizing rule; the activation peak of a 2,048-token step is under 1 GiB for
    this model, so 1 GiB is a generous reserve).
    """
    params = 13.0e9
    shape = MODEL_SHAPES["llama-2-13b"]  # 40 layers, 40 KV heads x 128 (`pagedllm plan` has the same)
    out = []
    for name, gpu_gib, wbytes, label in (("seeds_24gib_int8", 24, 1, "24 GiB GPU, 8-bit weights"),
                                          ("seeds_a100_40gib_fp16", 40, 2, "A100 40 GiB, fp16 weights (vLLM paper)")):
        weights = int(params * wbytes)
        budget = int(gpu_memory_utilization * gpu_gib * GiB) - weights - activation_reserve_bytes
        out.append(Scenario(name, f"13B Llama, 2,048 context, {label}", shape.num_layers, shape.num_kv_heads,
                            shape.head_dim, 2, budget, 2048, {
            "gpu_bytes": gpu_gib * GiB, "gpu_memory_utilization": gpu_memory_utilization,
            "weight_bytes": weights, "activation_reserve_bytes": activation_reserve_bytes,
            "kv_budget_bytes": budget,
            "formula": "gpu_memory_utilization * gpu_bytes - weight_bytes - activation_reserve_bytes",
            "fp16_weights_fit_24gib": 2 * params < 0.9 * 24 * GiB}))
    return out


# ---- the trace --------------------------------------------------------------------------

@dataclass(frozen=True)
class TraceRequest:
    """One request of the trace: lengths in tokens, arrival in iterations."""

    prompt_len: int
    output_len: int  # tokens it generates: min(natural length, max_tokens)
    max_tokens: int
    arrival_step: int


def lognormal_mu(mean: float, sigma: float) -> float:
    """The log-space location giving a log-normal of this mean: ln(mean) − σ²/2."""
    return math.log(mean) - sigma * sigma / 2


def sharegpt_like_trace(num_requests: int, seed: int, max_model_len: int, max_tokens: int,
                        arrival_rate: float = 0.0, mean_prompt: float = SHAREGPT_MEAN_PROMPT,
                        mean_output: float = SHAREGPT_MEAN_OUTPUT, sigma: float = 1.0) -> list[TraceRequest]:
    """A seeded ShareGPT-like trace (see the module docstring for the model and filter).

    ``arrival_rate``: mean requests per iteration (Poisson arrivals); 0 = all at iteration 0.
    Raises ValueError for non-positive counts or lengths.
    """
    if num_requests < 1 or max_model_len < 8 or max_tokens < 1:
        raise ValueError("num_requests, max_model_len (>= 8) and max_tokens must be positive")
    rng = np.random.default_rng(seed)
    out: list[TraceRequest] = []
    step, mu_p, mu_o = 0.0, lognormal_mu(mean_prompt, sigma), lognormal_mu(mean_output, sigma)
    while len(out) < num_requests:
        p = int(round(rng.lognormal(mu_p, sigma)))
        o_natural = int(round(rng.lognormal(mu_o, sigma)))
        o = min(o_natural, max_tokens)
        if p < 4 or o_natural < 4 or p > max_model_len // 2 or p + o > max_model_len:
            continue
        if arrival_rate > 0:
            step += rng.exponential(1.0 / arrival_rate)
        out.append(TraceRequest(p, o, min(max_tokens, max_model_len - p), int(step)))
    return out


def trace_summary(trace: list[TraceRequest]) -> dict:
    p = np.array([r.prompt_len for r in trace])
    o = np.array([r.output_len for r in trace])
    return {"num_requests": len(trace),
            "prompt_len": {"mean": round(float(p.mean()), 1), "median": float(np.median(p)), "max": int(p.max())},
            "output_len": {"mean": round(float(o.mean()), 1), "median": float(np.median(o)), "max": int(o.max())},
            "last_arrival_step": trace[-1].arrival_step}


# ---- policies ---------------------------------------------------------------------------

class PagedPolicy:
    """Blocks from the engine's real KVCacheManager (prefix caching off: distinct prompts)."""

    name = "paged"

    def __init__(self, scenario: Scenario, block_size: int) -> None:
        self.block_size = block_size
        num_blocks = scenario.capacity_tokens // block_size
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False,
                                 max_model_len=scenario.max_model_len)

    def can_ever_fit(self, req: Request) -> bool:
        return self.kv.num_blocks_for(req.num_tokens) <= self.kv.num_total_blocks

    def admit(self, req: Request, final_kv_len: int) -> bool:
        return self.kv.allocate_slots(req, req.num_tokens - req.num_computed_tokens) is not None

    def grow(self, req: Request) -> bool:
        return self.kv.allocate_slots(req, 1) is not None

    def release(self, req: Request) -> None:
        self.kv.free(req)

    def reserved_of(self, req: Request) -> int:
        return len(self.kv.get_block_ids(req)) * self.block_size


class ContiguousPolicy:
    """One contiguous reservation per sequence, sized at admission, never grown.

    Modelled with a perfect allocator (no external fragmentation between reservations),
    so its waste here is a lower bound for a real contiguous server.
    """

    def __init__(self, name: str, scenario: Scenario, reservation) -> None:
        self.name, self.capacity, self.reservation = name, scenario.capacity_tokens, reservation
        self.reserved: dict[str, int] = {}
        self.total = 0

    def can_ever_fit(self, req: Request) -> bool:
        return self._size(req) <= self.capacity

    def _size(self, req: Request) -> int:
        return self.reservation(req)

    def admit(self, req: Request, final_kv_len: int) -> bool:
        size = self._size(req)
        assert size >= final_kv_len, f"{self.name}: reservation {size} < final length {final_kv_len}"
        if self.total + size > self.capacity:
            return False
        self.reserved[req.request_id] = size
        self.total += size
        return True

    def grow(self, req: Request) -> bool:
        return True

    def release(self, req: Request) -> None:
        self.total -= self.reserved.pop(req.request_id, 0)

    def reserved_of(self, req: Request) -> int:
        return self.reserved.get(req.request_id, 0)


def make_policies(scenario: Scenario, block_size: int, trace_by_id: dict[str, TraceRequest]) -> list:
    """The four policies of the module docstring, each with a fresh budget."""
    mml = scenario.max_model_len
    return [
        PagedPolicy(scenario, block_size),
        ContiguousPolicy("contiguous_max_model_len", scenario, lambda r: mml),
        ContiguousPolicy("contiguous_max_tokens", scenario,
                         lambda r: r.num_prompt_tokens + trace_by_id[r.request_id].max_tokens),
        ContiguousPolicy("contiguous_oracle", scenario,
                         lambda r: r.num_prompt_tokens + trace_by_id[r.request_id].output_len - 1),
    ]


# ---- the replay -------------------------------------------------------------------------

def simulate(policy, trace: list[TraceRequest], max_num_seqs: int) -> dict:
    """Replay ``trace`` through ``policy``, one decode iteration per step; returns the metrics.

    Each iteration: running sequences each grow by one token (a paged decode that cannot
    get a block preempts the latest-admitted sequence, recompute style, and no one is
    admitted that iteration); then waiting requests are admitted FCFS while the policy
    has room (a recomputed sequence re-enters at the head of the queue); admitted ones
    compute all their tokens (prefill). Time-weighted sums are taken after allocation,
    while the iteration's K/V is being written.
    """
    reqs = [Request(str(i), [0] * t.prompt_len, SamplingParams(max_tokens=t.output_len, ignore_eos=True))
            for i, t in enumerate(trace)]
    final_kv = {r.request_id: t.prompt_len + t.output_len - 1 for r, t in zip(reqs, trace)}
    pending = deque(zip(reqs, trace))
    waiting: deque[Request] = deque()
    running: list[Request] = []
    step = 0
    sums = dict(live=0, reserved=0, reservation=0, fragmentation=0, running=0, iterations=0)
    peak_running = queued_on_arrival = never_fit = preemptions = recomputed = 0
    admitted_step: dict[str, int] = {}
    queue_steps: list[int] = []
    while pending or waiting or running:
        if not waiting and not running and pending[0][1].arrival_step > step:
            step = pending[0][1].arrival_step  # idle: skip to the next arrival
        arrived = []
        while pending and pending[0][1].arrival_step <= step:
            arrived.append(pending.popleft()[0])
        waiting.extend(arrived)
        scheduled: dict[str, int] = {}
        preempted = _grow_running(policy, running, waiting, scheduled)
        preemptions += preempted
        if not preempted:
            while waiting and len(running) < max_num_seqs:
                req = waiting[0]
                if not policy.can_ever_fit(req):
                    waiting.popleft()
                    never_fit += 1
                    continue
                if not policy.admit(req, final_kv[req.request_id]):
                    break
                waiting.popleft()
                running.append(req)
                scheduled[req.request_id] = req.num_tokens - req.num_computed_tokens
                if req.request_id in admitted_step:
                    recomputed += req.num_tokens
                else:
                    admitted_step[req.request_id] = step
                    queue_steps.append(step - trace[int(req.request_id)].arrival_step)
        queued_on_arrival += sum(1 for r in arrived if r.request_id not in admitted_step)
        peak_running = max(peak_running, len(running))
        _account(policy, running, scheduled, final_kv, sums)
        running = _advance(policy, running, scheduled)
        step += 1
    cap = policy_capacity(policy)
    it = sums["iterations"]
    reserved = max(sums["reserved"], 1)
    return {
        "utilization": sums["live"] / reserved,
        "waste": 1 - sums["live"] / reserved,
        "waste_reservation": sums["reservation"] / reserved,
        "waste_internal_fragmentation": sums["fragmentation"] / reserved,
        "pool_utilization": sums["live"] / (it * cap) if it else 0.0,
        "pool_reserved": sums["reserved"] / (it * cap) if it else 0.0,
        "peak_concurrent_seqs": peak_running,
        "mean_concurrent_seqs": sums["running"] / it if it else 0.0,
        "num_queued_on_arrival": queued_on_arrival,
        "num_never_admittable": never_fit,
        "mean_queue_iterations": float(np.mean(queue_steps)) if queue_steps else 0.0,
        "num_preemptions": preemptions,
        "num_recomputed_tokens": recomputed,
        "iterations": it,
        "output_tokens_per_iteration": sum(t.output_len for t in trace) / it if it else 0.0,
        "capacity_tokens": cap,
    }


def policy_capacity(policy) -> int:
    if isinstance(policy, PagedPolicy):
        return policy.kv.num_total_blocks * policy.block_size
    return policy.capacity


def _grow_running(policy, running: list[Request], waiting: deque, scheduled: dict[str, int]) -> int:
    """Give each running sequence one more slot, preempting from the tail on failure.

    Returns the number of preemptions. Preempted sequences lose their K/V (recompute)
    and go to the head of ``waiting``, latest-admitted first in line after earlier ones.
    """
    num_preempted = i = 0
    while i < len(running):
        req = running[i]
        if policy.grow(req):
            scheduled[req.request_id] = 1
            i += 1
            continue
        victim = running.pop()
        policy.release(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        scheduled.pop(victim.request_id, None)
        waiting.appendleft(victim)
        num_preempted += 1
    return num_preempted


def _account(policy, running: list[Request], scheduled: dict[str, int], final_kv: dict[str, int], sums: dict) -> None:
    """Add this iteration's live / reserved / reservation / fragmentation slots to ``sums``."""
    for req in running:
        live = req.num_computed_tokens + scheduled[req.request_id]
        reserved = policy.reserved_of(req)
        fillable = min(reserved, final_kv[req.request_id])
        sums["live"] += live
        sums["reserved"] += reserved
        sums["reservation"] += fillable - live
        sums["fragmentation"] += reserved - fillable
    sums["running"] += len(running)
    sums["iterations"] += 1


def _advance(policy, running: list[Request], scheduled: dict[str, int]) -> list[Request]:
    """The iteration's forward pass: K/V written, one token sampled each; frees finished ones."""
    still = []
    for req in running:
        req.num_computed_tokens += scheduled[req.request_id]
        req.append_output_token_ids([0])
        if req.num_output_tokens >= req.max_tokens:
            policy.release(req)
        else:
            still.append(req)
    return still


# ---- driver -----------------------------------------------------------------------------

def run_scenario(scenario: Scenario, num_requests: int, seed: int, max_tokens: int, block_size: int,
                 max_num_seqs: int, arrival_rate: float) -> dict:
    """Build the trace, replay it through every policy; a JSON-ready dict."""
    trace = sharegpt_like_trace(num_requests, seed, scenario.max_model_len, max_tokens, arrival_rate)
    by_id = {str(i): t for i, t in enumerate(trace)}
    results = {}
    for policy in make_policies(scenario, block_size, by_id):
        m = simulate(policy, trace, max_num_seqs)
        if isinstance(policy, PagedPolicy):
            policy.kv.check_integrity()
            assert policy.kv.num_used_blocks == 0, "blocks leaked after the trace drained"
        results[policy.name] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items()}
    return {"scenario": {**asdict(scenario), "kv_bytes_per_token": scenario.kv_bytes_per_token,
                         "capacity_tokens": scenario.capacity_tokens,
                         "contiguous_seqs_at_max_model_len": scenario.capacity_tokens // scenario.max_model_len},
            "trace": trace_summary(trace), "policies": results}


def plot(records: list[dict], path: Path) -> None:
    """Per scenario: stacked bars of reserved memory (live / reservation / fragmentation) and peak concurrency."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(records), 2, figsize=(10, 3.6 * len(records)), squeeze=False)
    for row, rec in zip(axes, records):
        names = list(rec["policies"])
        pol = [rec["policies"][n] for n in names]
        labels = [n.replace("contiguous_", "contig.\n") for n in names]
        live = [100 * p["utilization"] for p in pol]
        res = [100 * p["waste_reservation"] for p in pol]
        frag = [100 * p["waste_internal_fragmentation"] for p in pol]
        ax = row[0]
        ax.bar(labels, live, color="tab:green", label="live K/V")
        ax.bar(labels, res, bottom=live, color="tab:orange", label="reserved, filled later")
        ax.bar(labels, frag, bottom=[a + b for a, b in zip(live, res)], color="tab:red", label="internal fragmentation")
        for x, v in enumerate(live):
            ax.text(x, v / 2, f"{v:.0f}%", ha="center", va="center", fontsize=8)
        ax.set_ylabel("% of reserved KV memory (time-weighted)")
        ax.set_ylim(0, 118)
        ax.set_title(rec["scenario"]["description"], fontsize=9)
        ax.legend(fontsize=7, loc="upper center", ncol=3)
        ax = row[1]
        peaks = [p["peak_concurrent_seqs"] for p in pol]
        means = [p["mean_concurrent_seqs"] for p in pol]
        xs = np.arange(len(names))
        ax.bar(xs - 0.2, peaks, 0.4, label="peak")
        ax.bar(xs + 0.2, means, 0.4, label="mean (time-weighted)")
        for x, (pk, mn) in enumerate(zip(peaks, means)):
            ax.text(x - 0.2, pk, f"{pk}", ha="center", va="bottom", fontsize=7)
            ax.text(x + 0.2, mn, f"{mn:.0f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(xs, labels)
        ax.set_ylabel("concurrent sequences in the budget")
        ax.set_title(f"KV budget {rec['scenario']['kv_budget_bytes'] / GiB:.2f} GiB = "
                     f"{rec['scenario']['capacity_tokens']:,} tokens", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def result_line(rec: dict) -> str:
    p = rec["policies"]
    pg, mx, mt, orc = (p["paged"], p["contiguous_max_model_len"], p["contiguous_max_tokens"], p["contiguous_oracle"])
    return (f"{rec['scenario']['name']}: waste paged {100 * pg['waste']:.1f}% vs contiguous "
            f"{100 * mx['waste']:.1f}% (max_model_len) / {100 * mt['waste']:.1f}% (prompt+max_tokens) / "
            f"{100 * orc['waste']:.1f}% (oracle); utilization {100 * pg['utilization']:.1f}% vs "
            f"{100 * mx['utilization']:.1f}%; concurrent seqs peak/mean {_conc(pg)} vs {_conc(mx)} / "
            f"{_conc(mt)} / {_conc(orc)}; "
            f"iterations {pg['iterations']} vs {mx['iterations']}")


def _conc(m: dict) -> str:
    return f"{m['peak_concurrent_seqs']}/{m['mean_concurrent_seqs']:.1f}"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", choices=["smollm2", "seeds"], default="smollm2")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=1024, help="max_tokens every request asks for")
    p.add_argument("--max-model-len", type=int, default=2048, help="smollm2 preset only")
    p.add_argument("--kv-budget-gib", type=float, default=1.0, help="smollm2 preset only: KV pool in GiB")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=1024, help="sequence cap shared by every policy")
    p.add_argument("--arrival-rate", type=float, default=0.0,
                   help="mean requests per iteration (Poisson); 0 = all arrive at once (saturated)")
    p.add_argument("--quick", action="store_true", help="100 requests (for tests)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/memory_waste[_seeds].json)")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests = 100
    if args.scenario == "seeds":
        scenarios = seeds_scenarios()
    else:
        scenarios = [smollm2_scenario(int(args.kv_budget_gib * GiB), args.max_model_len)]
    records = [run_scenario(s, args.num_requests, args.seed, args.max_tokens, args.block_size,
                            args.max_num_seqs, args.arrival_rate) for s in scenarios]
    name = "memory_waste" if args.scenario == "smollm2" else "memory_waste_seeds"
    record = {"trace_model": {"source": "ShareGPT as characterized in Kwon et al. 2023 (vLLM paper) §6.1/Fig. 11",
                              "mean_prompt": SHAREGPT_MEAN_PROMPT, "mean_output": SHAREGPT_MEAN_OUTPUT,
                              "distribution": "log-normal, sigma 1.0 (assumed)", "max_tokens": args.max_tokens,
                              "seed": args.seed, "arrival_rate": args.arrival_rate},
              "block_size": args.block_size, "max_num_seqs": args.max_num_seqs, "scenarios": records}
    path = common.write_result(name, record, args.out)
    if not args.no_plot:
        plot(records, common.plot_path(path))
    print("memory_waste: " + " | ".join(result_line(r) for r in records) + f" -> {path}")
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
