"""pagedllm against llama.cpp on the same GGUF file (issue #39's peer for kept blocks).

``--part batch1``: decode tok/s of one sequence. llama.cpp: ``llama-bench -p 0 -n N`` (token generation from an
empty context, its own figure); pagedllm: ``LLM(model=FILE, quantization=...)`` on a short prompt, the time of
N + 1 tokens minus the time of 1 (prefill and first token excluded), greedy, EOS ignored. Rounds alternate.

``--part concurrent``: 32 clients (``--clients``) streaming the peers' workload shape (prompts of 20-200 random
token ids, 128 tokens each, EOS ignored) through ``benchmarks/serving.py``'s client against ``llama-server -np 32``
(one slot per client, ``-c`` = slots x 512) and against ``pagedllm serve --quantization gguf``, one server up at a
time. llama.cpp is built as ``/work/shared/peers.md`` says (``GGML_NATIVE=OFF``, AVX-512 on, AMX off)::

    cmake -B build -DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VNNI=ON \\
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF
    cmake --build build -j2 --target llama-server llama-bench

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/llamacpp_peer.py --llama-bin DIR/build/bin

``--wait-policy ACTIVE`` runs pagedllm with spinning OpenMP threads, as llama.cpp's own threads spin (a machine
pagedllm has to itself): each batch-1 timing in a child process of its own (spinning threads left in this process
would take a core from llama-bench), and ``pagedllm serve`` with the policy in its environment.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pagedllm  # noqa: F401  before torch: the engine's OpenMP wait policy is set only before libgomp loads
from pagedllm import envs

import common

BENCH_DIR = Path(__file__).resolve().parent


def peer_env() -> dict[str, str]:
    """The environment llama.cpp runs in: ours without the OpenMP wait policy pagedllm sets for itself (ggml's
    OpenMP threads run at their own defaults; PASSIVE halves its decode speed)."""
    return {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}


def llama_bench(bin_dir: Path, model: str, tokens: int, threads: int) -> float:
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", model, "-p", "0", "-n", str(tokens), "-t",
                          str(threads), "-r", "1", "-o", "json"], capture_output=True, text=True, check=True,
                         env=peer_env())
    return float(json.loads(out.stdout)[0]["avg_ts"])


def pagedllm_decode(llm, tokens: int) -> float:
    from pagedllm import SamplingParams

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        llm.generate(["Tell me a story about a dragon."], SamplingParams(temperature=0.0, max_tokens=n,
                                                                         ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t0

    return tokens / (timed(tokens + 1) - timed(1))


def _engine(model: str, quantization: str | None):
    from pagedllm import LLM

    llm = LLM(model=model, max_model_len=1024, kv_cache_memory="256MiB", quantization=quantization)
    pagedllm_decode(llm, 8)
    return llm


def _child_decode(args, quantization: str | None, env: dict[str, str] | None = None) -> float:
    """pagedllm's batch-1 tok/s measured in a child process under ``--wait-policy`` (and ``env``)."""
    cmd = [sys.executable, __file__, "--llama-bin", str(args.llama_bin), "--model", args.model, "--tokens",
           str(args.tokens), "--child-decode", quantization or "none"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_WAIT_POLICY": args.wait_policy, **(env or {})})
    return float(out.stdout.strip().splitlines()[-1])


_PYTHON_REPLAY = {envs.CPU_GRAPH_NATIVE_REPLAY.name: "0"}


def batch1_part(args) -> dict:
    in_child = args.wait_policy is not None
    engines = {q or "float32": (q if in_child else _engine(args.model, q)) for q in args.pagedllm_quantization}
    python_replay = [q for q in args.pagedllm_quantization if args.python_replay]
    tok_s: dict[str, list[float]] = {"llama.cpp": [], **{f"pagedllm {n}": [] for n in engines},
                                     **{f"pagedllm {q or 'float32'} (Python replay)": [] for q in python_replay}}
    for r in range(args.rounds):
        tok_s["llama.cpp"].append(round(llama_bench(args.llama_bin, args.model, args.tokens, args.threads), 2))
        for name, llm in engines.items():
            got = _child_decode(args, llm) if in_child else pagedllm_decode(llm, args.tokens)
            tok_s[f"pagedllm {name}"].append(round(got, 2))
        for q in python_replay:
            got = _child_decode(args, q, _PYTHON_REPLAY)
            tok_s[f"pagedllm {q or 'float32'} (Python replay)"].append(round(got, 2))
        print(f"batch 1 round {r}: " + ", ".join(f"{k} {v[-1]}" for k, v in tok_s.items()), flush=True)
    med = {k: sorted(v)[len(v) // 2] for k, v in tok_s.items()}
    return {"tok_s": tok_s, "over_llama_cpp": {k: round(v / med["llama.cpp"], 3) for k, v in med.items()}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _client(base_url: str | None, label: str, args, launch_flags: list[str] | None = None) -> dict:
    out = Path(tempfile.mkdtemp()) / f"{label}.json"
    cmd = [sys.executable, str(BENCH_DIR / "serving.py"), "--num-prompts", str(args.clients), "--max-concurrency",
           str(args.clients), "--input-len-min", "20", "--input-len-max", "200", "--output-len-min", str(args.tokens),
           "--output-len-max", str(args.tokens), "--label", label, "--out", str(out), "--model", args.model]
    if base_url is not None:
        cmd += ["--base-url", base_url]
    else:
        cmd += ["--launch", "--launch-model", args.model, "--", *launch_flags]
    env = None if args.wait_policy is None or base_url is not None \
        else {**os.environ, "OMP_WAIT_POLICY": args.wait_policy}
    subprocess.run(cmd, check=True, env=env)
    record = json.loads(out.read_text())
    keys = ("output_throughput_tok_s", "num_success", "num_failed", "first_errors", "ttft_ms", "itl_ms")
    return {k: record.get(k) for k in keys}


def concurrent_part(args) -> dict:
    port = _free_port()
    server = subprocess.Popen([str(args.llama_bin / "llama-server"), "-m", args.model, "-np", str(args.clients),
                               "-c", str(args.clients * 512), "-t", str(args.threads), "--port", str(port),
                               "--host", "127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=peer_env())
    try:
        for _ in range(300):
            try:
                import httpx

                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except Exception:
                pass
            time.sleep(0.5)
        peer = _client(f"http://127.0.0.1:{port}", "llamacpp_server", args)
    finally:
        server.terminate()
        server.wait(30)
    ours = {q: _client(None, f"pagedllm_{q}", args,
                       ["--quantization", q, "--max-model-len", "1024", "--served-model-name", args.model])
            for q in args.serve_quantization}
    result = {"llama-server": peer, **{f"pagedllm serve {q}": r for q, r in ours.items()}}
    base = peer["output_throughput_tok_s"]
    result["over_llama_server"] = {k: round(v["output_throughput_tok_s"] / base, 3) for k, v in result.items()
                                   if isinstance(v, dict) and v.get("output_throughput_tok_s")}
    print("concurrent:", result["over_llama_server"], flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bin", type=Path, required=True, help="llama.cpp's build/bin (llama-bench, llama-server)")
    ap.add_argument("--model", default=None, help="GGUF file (default: the installed SmolLM2 Q4_1)")
    ap.add_argument("--part", nargs="+", default=["batch1", "concurrent"], choices=["batch1", "concurrent"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--pagedllm-quantization", nargs="+", default=["gguf", None],
                    type=lambda s: None if s == "none" else s, help="engines to time (none: float32)")
    ap.add_argument("--serve-quantization", nargs="+", default=["gguf"])
    ap.add_argument("--wait-policy", choices=["PASSIVE", "ACTIVE"], default=None,
                    help="pagedllm's OMP_WAIT_POLICY (batch 1: each timing in a child process; serve: its environment)")
    ap.add_argument("--python-replay", action="store_true",
                    help="batch 1 also with CPU decode graphs replayed from Python (PAGEDLLM_CPU_GRAPH_NATIVE_REPLAY=0), "
                         "each timing in a child process under --wait-policy (default PASSIVE)")
    ap.add_argument("--child-decode", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.python_replay and args.wait_policy is None:
        args.wait_policy = "PASSIVE"
    if args.child_decode is not None:  # a --wait-policy child: one engine, one timing, printed
        print(pagedllm_decode(_engine(args.model, None if args.child_decode == "none" else args.child_decode),
                              args.tokens))
        return
    if args.model is None:
        from pagedllm.loader.resolve import resolve_model

        args.model = str(resolve_model("smollm2-135m-instruct").path)
    record = {"model": Path(args.model).name, "threads": args.threads, "pagedllm_wait_policy": args.wait_policy
              or os.environ.get("OMP_WAIT_POLICY")}
    if "batch1" in args.part:
        record["batch1"] = batch1_part(args)
    if "concurrent" in args.part:
        record["concurrent"] = concurrent_part(args)
    record["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    print("wrote", common.write_result("llamacpp_peer", record, args.out))


if __name__ == "__main__":
    main()
