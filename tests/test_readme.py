"""The README's snippets run as written: each shell command and Python block, with a bounded time,
against a live `pagedllm serve` (started by the README's own serve line) where one needs it.

Commands are run as written except that ``.venv/bin/pagedllm`` / ``.venv/bin/python`` become this
interpreter (the checkout under test) and port 8000 a free port; ``make`` lines are the build
itself, which CI runs (`.ci/run` runs `make test`).
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
SNIPPET_SECONDS = 240  # a model load on a busy 2-core machine, then a few dozen tokens


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def _shell_commands() -> list[str]:
    commands = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith(("#", "make ")):
                commands.append(" ".join(line.split()))
    return commands


SERVE = next(c for c in _shell_commands() if " serve " in f"{c} ")
COMMANDS = [c for c in _shell_commands() if c != SERVE]
PYTHON = _blocks("python")


def _as_here(text: str, port: int | None = None) -> str:
    here = {"pagedllm": f"{sys.executable} -m pagedllm.entrypoints.cli", "python": sys.executable}
    text = re.sub(r"\.venv/bin/(pagedllm|python)\b", lambda m: here[m.group(1)], text)
    return text.replace("8000", str(port)) if port is not None else text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(argv: list[str], input_text: str | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, cwd=REPO, input=input_text, capture_output=True, text=True,
                            timeout=SNIPPET_SECONDS)
    assert result.returncode == 0, f"{argv}: exit {result.returncode}\n{result.stdout}\n{result.stderr[-3000:]}"
    assert result.stdout.strip(), f"{argv} printed nothing\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def server_port(tmp_path_factory):
    """The README's serve line on a free port, until its /health answers; SIGINT drains it."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as out:  # a file, not a pipe nobody reads: the server never blocks on its log
        proc = subprocess.Popen(["bash", "-c", "exec " + _as_here(SERVE, port)], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + SNIPPET_SECONDS
    try:
        while True:
            assert proc.poll() is None, f"{SERVE} exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"{SERVE}: no /health within {SNIPPET_SECONDS} s"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        yield port
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_the_readme_is_a_front_page():
    """At most ~15 KB, the quick start's commands, snippets that print and stream, no result tables."""
    assert len(README.encode()) <= 15_000
    assert "make run" in README and "make test-fast" in README and "make test " in README
    assert any("stream=True" in p and "print(" in p for p in PYTHON)
    assert any("client.chat.completions.create" in p and "stream=True" not in p and "print(" in p for p in PYTHON)
    assert "tok/s |" not in README and "| median" not in README  # measurement tables live in benchmarks/


def test_the_readme_links_resolve():
    """Every relative link names a file of the checkout, and every #anchor into benchmarks/README.md a heading."""
    bench = (REPO / "benchmarks" / "README.md").read_text(encoding="utf-8")
    slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", bench, re.M)}
    for target in re.findall(r"\]\(([^)#]+)(#[^)]*)?\)", README):
        path, anchor = target
        if path.startswith("http"):
            continue
        assert (REPO / path).exists(), path
        if anchor and path == "benchmarks/README.md":
            assert anchor[1:] in slugs, anchor


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_shell_command_runs(command, request):
    port = request.getfixturevalue("server_port") if "127.0.0.1:8000" in command else None
    _run(["bash", "-c", _as_here(command, port)], input_text="")  # `chat` reads EOF: it exits 0


@pytest.mark.slow
def test_serve_line_serves(server_port):
    assert httpx.get(f"http://127.0.0.1:{server_port}/v1/models", timeout=10).json()["data"]


@pytest.mark.slow
@pytest.mark.parametrize("code", PYTHON, ids=[f"python-{i}" for i in range(len(PYTHON))])
def test_python_snippet_runs(code, request):
    port = request.getfixturevalue("server_port") if "127.0.0.1:8000" in code else None
    _run([sys.executable, "-c", _as_here(code, port)])


STRUCTURED_PAGE = REPO / "docs" / "structured-outputs.md"


@pytest.mark.slow
def test_the_structured_outputs_examples_run_as_written(server_port):
    """cases-3 C56: the page's examples (offline, then ``response_format`` json_schema and a required tool
    call against the README's server, no ``max_tokens``) run as written, in order as one session, within
    the snippet bound; each printed object is the schema's, not a whitespace run to the token limit."""
    page = STRUCTURED_PAGE.read_text(encoding="utf-8")
    code = "\n".join(re.findall(r"```python\n(.*?)```", page, flags=re.S))
    out = _run([sys.executable, "-c", _as_here(code, server_port)]).stdout
    decoder, i = json.JSONDecoder(), 0
    for _ in range(2):  # the two objects, printed as generated (maybe over several lines)
        value, i = decoder.raw_decode(out, out.index("{", i))
        assert set(value) == {"name", "age"} and isinstance(value["age"], int), out
    name, arguments = out[i:].strip().split(" ", 1)
    assert name == "get_weather" and isinstance(json.loads(arguments)["city"], str), out
