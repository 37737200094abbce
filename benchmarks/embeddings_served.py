"""Served embeddings: ``pagedllm serve --model all-minilm-l6-v2`` vs infinity-emb's server, ``/v1/embeddings``.

Both servers load the same folder (the ``all-minilm-l6-v2`` alias's extracted sentence-transformers
folder), float32 on CPU, with the same thread environment (``--threads`` for OMP/MKL, the OpenMP wait
policy PASSIVE, which pagedllm sets by default). One server is up at a time, each started here as a
subprocess on a free port (infinity: ``infinity_emb v2 --engine torch --device cpu
--dtype float32 --no-bettertransformer`` from its own venv, ``--infinity-bin``, its default batch size); they
alternate for ``--rounds`` rounds, the order reversing every round (A B B A ...).

The load: the corpus of ``benchmarks/embeddings.py`` (``--num-sentences`` sentences of 5..250 tokens,
fixed seed), posted ONE sentence per request by ``--concurrency`` async httpx workers that each take
the next sentence as soon as their previous answer arrives (a closed loop). pagedllm is posted to
``/v1/embeddings``, infinity to ``/embeddings`` (the route it serves; the OpenAI body is the same).
Reported per server: embeddings/s over a pass (medians over rounds), p50/p99 request latency (all
rounds pooled), and the smallest cosine between the two servers' vectors of each sentence.

    python benchmarks/embeddings_served.py                                  # 2,000 sentences x 2 servers x 2 rounds (~12 min)
    python benchmarks/embeddings_served.py --num-sentences 200 --rounds 1   # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pagedllm  # noqa: F401  before torch: the engine's OpenMP wait policy is set only before libgomp loads
import httpx
import numpy as np

import common
from embeddings import MODEL, corpus
from serving import free_port, percentiles, wait_healthy

from pagedllm.loader import resolve_model  # noqa: E402

INFINITY_BIN = "/work/peers/infinity/bin/infinity_emb"
SERVERS = ("pagedllm", "infinity")


def server_env(threads: int) -> dict[str, str]:
    """The environment both servers run with: the same threads and OpenMP wait policy, no network."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1",
            "INFINITY_ANONYMOUS_USAGE_STATS": "0"}


def launch(name: str, folder: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str, str]:
    """Start server ``name`` on a free port; return the process, its base URL and embeddings route."""
    port = free_port()
    if name == "pagedllm":
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--model", MODEL, "--port", str(port),
               "--served-model-name", MODEL, "--disable-log-requests"]
        route = "/v1/embeddings"
    else:
        cmd = [args.infinity_bin, "v2", "--model-id", str(folder), "--served-model-name", MODEL, "--port", str(port),
               "--device", "cpu", "--engine", "torch", "--dtype", "float32", "--no-bettertransformer", "--log-level", "warning"]
        route = "/embeddings"
    proc = subprocess.Popen(cmd, env=server_env(args.threads), cwd=tempfile.gettempdir())
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, name, 300)
    return proc, url, route


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def run_pass(url: str, route: str, sentences: list[str], concurrency: int) -> dict:
    """Post every sentence once (one per request) with ``concurrency`` workers; vectors, latencies, wall time."""
    vectors: list[list[float] | None] = [None] * len(sentences)
    latencies: list[float] = []
    errors: list[str] = []
    queue = iter(range(len(sentences)))

    async def worker(client: httpx.AsyncClient) -> None:
        for i in queue:
            t0 = time.perf_counter()
            r = await client.post(url + route, json={"model": MODEL, "input": [sentences[i]]})
            latencies.append(time.perf_counter() - t0)
            if r.status_code != 200:
                errors.append(f"{r.status_code}: {r.text[:200]}")
                continue
            vectors[i] = r.json()["data"][0]["embedding"]

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "latencies": latencies, "errors": errors, "vectors": vectors}


def min_cosine(a: list, b: list) -> float:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    cos = (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))
    return float(cos.min())


def schedule(rounds: int) -> list[str]:
    """A B B A A B ...: each round reverses the order of the one before."""
    return [name for r in range(rounds) for name in (SERVERS if r % 2 == 0 else SERVERS[::-1])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-sentences", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--infinity-bin", default=INFINITY_BIN)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not Path(args.infinity_bin).exists():
        raise SystemExit(f"infinity-emb not found at {args.infinity_bin}: create its venv (see benchmarks/README.md)")

    from transformers import AutoTokenizer

    folder = resolve_model(MODEL).path
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    sentences = corpus(tokenizer, args.num_sentences, args.seed)
    lens = [len(ids) for ids in tokenizer(sentences)["input_ids"]]
    load_before = [round(x, 2) for x in os.getloadavg()]
    rates = {name: [] for name in SERVERS}
    latencies = {name: [] for name in SERVERS}
    errors = {name: [] for name in SERVERS}
    last_vectors = {}
    for name in schedule(args.rounds):
        proc, url, route = launch(name, folder, args)
        try:
            asyncio.run(run_pass(url, route, sentences[:64], args.concurrency))  # warm-up
            res = asyncio.run(run_pass(url, route, sentences, args.concurrency))
        finally:
            stop(proc)
        rates[name].append(len(sentences) / res["seconds"])
        latencies[name] += res["latencies"]
        errors[name] += res["errors"]
        last_vectors[name] = res["vectors"]
        print(f"  {name}: {rates[name][-1]:.1f} embeddings/s, {len(res['errors'])} errors", flush=True)
    load_after = [round(x, 2) for x in os.getloadavg()]
    both = [i for i in range(len(sentences)) if all(last_vectors[n][i] is not None for n in SERVERS)]
    cosine = min_cosine([last_vectors["pagedllm"][i] for i in both], [last_vectors["infinity"][i] for i in both])
    median = {k: statistics.median(v) for k, v in rates.items()}
    ratio = median["pagedllm"] / median["infinity"]
    record = {"model": MODEL, "model_folder": str(folder), "num_sentences": len(sentences),
              "tokens_total": sum(lens), "tokens_min_max": [min(lens), max(lens)], "sentences_per_request": 1,
              "concurrency": args.concurrency, "rounds": args.rounds, "threads": args.threads,
              "server_thread_env": {k: v for k, v in server_env(args.threads).items() if k.startswith(("OMP_", "MKL_"))},
              "routes": {"pagedllm": "/v1/embeddings", "infinity": "/embeddings"},
              "load_average_before": load_before, "load_average_after": load_after,
              "embeddings_per_s": rates, "median_embeddings_per_s": median, "ratio": ratio,
              "latency_ms": {k: percentiles(v, (50, 99)) for k, v in latencies.items()},
              "num_errors": {k: len(v) for k, v in errors.items()}, "first_errors": {k: v[:3] for k, v in errors.items()},
              "min_cosine_last_round": cosine, "num_compared": len(both)}
    path = common.write_result("embeddings_served", record, args.out)
    lat = record["latency_ms"]
    print(f"embeddings_served: pagedllm {median['pagedllm']:.1f} vs infinity {median['infinity']:.1f} embeddings/s "
          f"= {ratio:.2f}x; p50/p99 ms pagedllm {lat['pagedllm']['p50']:.0f}/{lat['pagedllm']['p99']:.0f}, "
          f"infinity {lat['infinity']['p50']:.0f}/{lat['infinity']['p99']:.0f}; min cosine {cosine:.7f} "
          f"({len(sentences)} sentences, concurrency {args.concurrency}, load {load_before} -> {load_after}) -> {path}")


if __name__ == "__main__":
    main()
