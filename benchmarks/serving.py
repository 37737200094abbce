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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

RESULTS = Path(__file__).resolve().parent / "results"


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


async def probe_health(client: httpx.AsyncClient, interval_s: float, stop: asyncio.Event, latencies: list[float]) -> None:
    """GET /health every ``interval_s`` until ``stop``; append each response time (s), failures as inf.

    The server's event loop answers /health without the engine: its latency under load is
    how long the HTTP loop is kept from running (engine work holding the GIL, or blocking calls).
    """
    while not stop.is_set():
        t = time.perf_counter()
        try:
            r = await client.get("/health")
            latencies.append(time.perf_counter() - t if r.status_code == 200 else math.inf)
        except httpx.HTTPError:
            latencies.append(math.inf)
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except asyncio.TimeoutError:
            pass


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

        stop = asyncio.Event()
        prober = None
        if health_latencies is not None:
            prober = asyncio.create_task(probe_health(client, args.health_interval, stop, health_latencies))
        start = time.perf_counter()
        tasks = []
        for prompt, n_out in work:
            tasks.append(asyncio.create_task(limited(prompt, n_out)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        stop.set()
        if prober is not None:
            await prober
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
    ``--long-prompt-tokens`` tokens arrives. Records the streaming client's inter-token gaps
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
        long_res = await one_request(client, args, long_prompt, args.long_prompt_output_tokens)
        done.set()
        await streamer
    gaps = [b - a for a, b in zip(times, times[1:])]
    during = [b - a for a, b in zip(times, times[1:]) if b > sent and a < sent + (long_res.e2e_s or 0)]
    return {"long_prompt": {"ok": long_res.ok, "error": long_res.error, "prompt_tokens": len(long_prompt),
                            "ttft_ms": None if long_res.ttft_s is None else 1000.0 * long_res.ttft_s,
                            "e2e_ms": None if long_res.e2e_s is None else 1000.0 * long_res.e2e_s},
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


def launch_server(args: argparse.Namespace, engine_flags: list[str]) -> tuple[subprocess.Popen, str]:
    """Start ``python -m pagedllm.entrypoints.openai.api_server`` on a free port; wait for /health."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", args.launch_model, "--port", str(port),
           "--served-model-name", args.model, "--disable-log-requests", "--log-level", "warning", *engine_flags]
    proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not become healthy within 300 s")


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
    p.add_argument("--long-prompt-stream-tokens", type=int, default=4096, help="max_tokens of the streaming client")
    p.add_argument("--label", default="pagedllm", help="system name recorded in the JSON")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/serving_<label>_<time>.json)")
    args = p.parse_args(argv)

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
          f"(median {st['median_gap_ms'] or 0:.0f} ms, {st['num_tokens']} tokens) -> {out}")
    return record


if __name__ == "__main__":
    main()
