"""The live KV-cache map: ``GET /kv/state`` during a real run (tiny random Llama through the
HTTP server), auth, ``--disable-kv-map``, and the ``/kv`` page in headless Chromium."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.api_server import add_server_args, build_app
from server_utils import ServerThread

KEY = "sk-kv-map"
AUTH = {"Authorization": f"Bearer {KEY}"}
NUM_BLOCKS = 48
BLOCK_SIZE = 16
PREFIX = list(range(100, 164))  # 64 tokens = 4 full blocks every request below shares
REPO = Path(__file__).resolve().parents[2]


class SlowSteps:
    """Make every engine step take at least ``step_s`` seconds so requests are still running
    while a test looks at them (the tiny model would finish in milliseconds). ``step_s`` can
    change mid-run: a test slows the engine further while a browser reads the page, so the
    state it waited for is still there however long the browser takes to start."""

    def __init__(self, engine: LLMEngine, step_s: float) -> None:
        self.step_s = step_s
        execute = engine.runner.execute_model

        def slow_execute(so):
            time.sleep(self.step_s)
            return execute(so)

        engine.runner.execute_model = slow_execute


@pytest.fixture(scope="module")
def kv_server(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", block_size=BLOCK_SIZE,
                                    num_kv_blocks=NUM_BLOCKS, max_model_len=512, max_num_seqs=8))
    slow = SlowSteps(engine, 0.01)
    app = build_app(AsyncLLMEngine(engine, stats_log_interval_s=0), ["tiny"], api_key=KEY)
    with ServerThread(app) as srv:
        srv.engine, srv.slow = engine, slow
        yield srv


class Streams:
    """Streaming completions in background threads; closing the client aborts them.

    Each item of ``requests`` is one HTTP request: a prompt, or a list of prompts that the
    server admits together (so they run at the same time however loaded the machine is).
    """

    def __init__(self, url: str, requests: list, max_tokens: int) -> None:
        self.client = httpx.Client(base_url=url, headers=AUTH, timeout=120)
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(p, max_tokens), daemon=True) for p in requests]
        for t in self.threads:
            t.start()

    def _run(self, prompt: list, max_tokens: int) -> None:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        try:
            with self.client.stream("POST", "/v1/completions", json=body) as r:
                for _ in r.iter_lines():
                    pass
        except (httpx.HTTPError, RuntimeError) as e:  # closed on purpose by stop()
            self.errors.append(e)

    def join(self) -> None:
        for t in self.threads:
            t.join(120)
        assert not any(t.is_alive() for t in self.threads)

    def stop(self) -> None:
        self.client.close()
        for t in self.threads:
            t.join(30)


def warm_prefix_cache(url: str, *others: list[int]) -> None:
    """Run PREFIX (and ``others``) to completion: its four full blocks stay cached, so
    requests admitted together later all hit them and share them."""
    done = Streams(url, [PREFIX, *others], max_tokens=2)
    done.join()
    done.stop()
    assert not done.errors, done.errors


def get_state(url: str) -> dict:
    r = httpx.get(url + "/kv/state", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(url: str, predicate, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        state = get_state(url)
        if predicate(state):
            return state
        assert time.monotonic() < deadline, f"timed out; last state: {state['num_running']} running"
        time.sleep(0.05)


def check_consistent(state: dict) -> None:
    """Block states partition the pool; every block in a table is in use, shared iff in two tables."""
    states = state["block_states"]
    assert len(states) == state["num_blocks"] == NUM_BLOCKS
    counts = [state[f"num_{k}_blocks"] for k in ("free", "cached", "used", "shared", "null")]
    assert sum(counts) == NUM_BLOCKS and counts == [states.count(c) for c in "01234"]
    held: dict[int, int] = {}
    for row in state["requests"]:
        for b in row["block_ids"]:
            held[b] = held.get(b, 0) + 1
    assert {b: states[b] for b in held} == {b: "3" if n > 1 else "2" for b, n in held.items()}


def test_state_during_a_run_shares_prefix_then_frees_everything(kv_server):
    url = kv_server.url
    warm_prefix_cache(url)
    streams = Streams(url, [[PREFIX + [7, 8], PREFIX + [9]]], max_tokens=200)
    try:
        state = wait_for(url, lambda s: s["num_running"] == 2 and s["num_shared_blocks"] >= 4)
        check_consistent(state)
        rows = {tuple(r["block_ids"][:4]) for r in state["requests"]}
        assert len(rows) == 1  # both tables start with the same four physical blocks
        assert any(e["kind"] == "prefix_hit" and e["num_tokens"] == 64 for e in state["events"])
        assert state["model"] == "tiny"
        streams.join()
    finally:
        streams.stop()
    state = wait_for(url, lambda s: s["num_running"] == 0 and s["num_waiting"] == 0)
    check_consistent(state)
    assert state["num_used_blocks"] == state["num_shared_blocks"] == 0 and state["requests"] == []
    assert state["num_cached_blocks"] >= 4  # the prefix stays cached, evictable


def test_state_needs_the_key_the_page_does_not(kv_server):
    assert httpx.get(kv_server.url + "/kv/state").status_code == 401
    assert httpx.get(kv_server.url + "/kv/state", headers={"Authorization": "Bearer wrong"}).status_code == 401
    page = httpx.get(kv_server.url + "/kv")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    # self-contained: nothing loaded from another origin
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page.text) and "KV-cache map" in page.text


def test_disable_kv_map(tiny_model_dir):
    import argparse

    args = add_server_args(argparse.ArgumentParser()).parse_args(["--disable-kv-map"])
    assert args.disable_kv_map
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", num_kv_blocks=8, max_model_len=64))
    app = build_app(AsyncLLMEngine(engine, stats_log_interval_s=0), ["tiny"], enable_kv_map=False)
    with ServerThread(app) as srv:
        assert httpx.get(srv.url + "/kv").status_code == 404
        assert httpx.get(srv.url + "/kv/state").status_code == 404


# ---- the page in a real browser ----------------------------------------------------------------

def find_chromium() -> str | None:
    """Debian's ``chromium`` (or ``$PAGEDLLM_CHROMIUM``), None when missing."""
    for name in (os.environ.get("PAGEDLLM_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def run_chromium(url: str, *args: str, budget_ms: int = 4000) -> subprocess.CompletedProcess:
    """Headless Chromium on ``url``: runs the page's JS for ``budget_ms`` of virtual time first."""
    cmd = [find_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--hide-scrollbars", f"--virtual-time-budget={budget_ms}", *args, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def _count(dom: str, pattern: str) -> int:
    return len(re.findall(pattern, dom))


def _number(dom: str, element_id: str) -> int:
    m = re.search(rf'id="{element_id}">(\d+)<', dom)
    assert m, f"#{element_id} not rendered"
    return int(m.group(1))


@pytest.mark.slow
@pytest.mark.skipif(find_chromium() is None,
                    reason="headless Chromium not installed (apt-get install chromium; .ci/run installs it)")
def test_kv_page_in_headless_chromium(kv_server, tmp_path):
    url = kv_server.url
    # Finished requests first, so the map shows cached blocks next to the running ones.
    warm_prefix_cache(url, list(range(300, 340)))
    streams = Streams(url, [[PREFIX + [i] for i in range(5)]], max_tokens=400)
    try:
        # 5 x 30 blocks do not fit in 48: wait for the first preemption, with requests still sharing
        wait_for(url, lambda s: s["num_preemptions"] >= 1 and s["num_running"] >= 2 and s["num_shared_blocks"] >= 4)
        # Hold that state while Chromium starts and reads the page (seconds on a loaded machine):
        # the ~300 decode steps left then take over a minute (stop() below aborts them). Fast
        # steps again for the screenshot, which only needs a page that draws.
        page = f"{url}/kv?interval=0.25#key={KEY}"
        kv_server.slow.step_s = 0.25
        try:
            dom = run_chromium(page, "--dump-dom").stdout
        finally:
            kv_server.slow.step_s = 0.01
        shot = tmp_path / "kv_map.png"
        run_chromium(page, f"--screenshot={shot}", "--window-size=1400,1000")
        after = get_state(url)
    finally:
        streams.stop()

    assert 'data-ready="1"' in dom, dom[-2000:]
    cells = {k: _count(dom, rf'class="cell {k}"') for k in ("free", "cached", "used", "shared")}
    assert sum(cells.values()) == NUM_BLOCKS == after["num_blocks"]
    # every cell count equals the count the page printed from the same snapshot
    assert cells == {k: _number(dom, f"n-{k}") for k in cells}
    assert cells["shared"] >= 4 and cells["used"] >= 1  # requests were running, sharing the prefix
    assert _count(dom, r'<tr class="req"') == _number(dom, "n-running") + _number(dom, "n-waiting") == 5
    assert _count(dom, r'<tr class="event"') >= 5  # 4 prefix hits and a preemption at least
    assert int(re.search(r'data-step="(\d+)"', dom).group(1)) <= after["num_steps"]

    assert shot.exists() and png_size(shot) == (1400, 1000)
    if os.environ.get("PAGEDLLM_UPDATE_RESULTS"):  # the README's picture: refresh it on purpose only
        shutil.copy(shot, REPO / "benchmarks" / "results" / "kv_map.png")


def test_state_of_an_engine_without_a_kv_cache_is_a_clear_404():
    from fake_engine import FakeEngine

    app = build_app(AsyncLLMEngine(FakeEngine(), stats_log_interval_s=0), ["fake"])
    with ServerThread(app) as srv:
        r = httpx.get(srv.url + "/kv/state")
        assert r.status_code == 404 and "no KV cache" in r.json()["error"]["message"]
