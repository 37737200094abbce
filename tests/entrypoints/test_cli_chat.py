"""`pagedllm chat`: answers stream, the stats line follows each, Ctrl-C stops an answer (its
blocks freed) and quits quietly at the prompt; sampling defaults come from the model."""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import signal
import subprocess
import sys
import termios
import time

import pytest

from pagedllm.entrypoints.chat import FALLBACK_SAMPLING, ChatSession, model_sampling_defaults
from pagedllm.entrypoints.cli import main
from pagedllm.sampling_params import SamplingParams

STATS = re.compile(r"\[(\d+) prompt tokens, (\d+) from the prefix cache, (\d+) output tokens in [\d.]+ s = "
                   r"[\d.]+ tok/s\]")


def test_model_sampling_defaults_read_generation_config(tmp_path):
    assert model_sampling_defaults(str(tmp_path), "hf") == FALLBACK_SAMPLING
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "eos_token_id": 2}))
    assert model_sampling_defaults(str(tmp_path), "hf") == {**FALLBACK_SAMPLING, "temperature": 0.6, "top_p": 0.95}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert model_sampling_defaults(str(tmp_path), "hf")["temperature"] == 0.0
    assert model_sampling_defaults(str(tmp_path / "m.gguf"), "gguf") == FALLBACK_SAMPLING


def test_a_flag_given_wins_over_the_model_default(tiny_model_dir, monkeypatch):
    """The model's generation_config.json fills only the sampling flags not given."""
    import pagedllm.entrypoints.chat as chat

    (tiny_model_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20}))
    seen = {}
    monkeypatch.setattr(chat, "run_chat", lambda session: seen.setdefault("params", session.params) and 0)
    try:
        assert main(["chat", "-m", str(tiny_model_dir), "--top-k", "5", "--num-kv-blocks", "32",
                     "--max-model-len", "64"]) == 0
    finally:
        (tiny_model_dir / "generation_config.json").unlink()
    assert (seen["params"].temperature, seen["params"].top_k, seen["params"].top_p) == (0.6, 5, 1.0)


@pytest.mark.parametrize("error", [EOFError, KeyboardInterrupt])
def test_ctrl_d_or_ctrl_c_at_the_prompt_exits_0(tiny_model_dir, monkeypatch, capsys, error):
    def raise_(prompt=""):
        raise error

    monkeypatch.setattr("builtins.input", raise_)
    assert main(["chat", "-m", str(tiny_model_dir), "--num-kv-blocks", "32", "--max-model-len", "64"]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_ctrl_c_during_an_answer_aborts_it_and_frees_its_blocks(tiny_model_dir, capsys):
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.config import EngineConfig

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=32, max_model_len=128,
                                    enable_prefix_caching=False))
    kv = engine.scheduler.kv_cache_manager
    step, num_steps = engine.step, [0]

    def step_then_ctrl_c():
        num_steps[0] += 1
        if num_steps[0] == 2:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C after the first streamed token
        return step()

    engine.step = step_then_ctrl_c
    session = ChatSession(engine, SamplingParams(max_tokens=50, ignore_eos=True, temperature=0), None, None)
    assert session.answer("Hello") is None
    assert session.history == [] and not engine.has_unfinished_requests()
    assert kv.num_used_blocks == 0
    engine.step = step
    assert session.answer("Hello") is not None and len(session.history) == 2
    out = capsys.readouterr()
    assert "[stopped: the answer was not added]" in out.err and len(STATS.findall(out.err)) == 1


class _Pty:
    """A child process on a pseudo-terminal that is its controlling terminal, so that writing
    Ctrl-C (0x03) sends it SIGINT as a keyboard does."""

    def __init__(self, argv: list[str]):
        self.master, slave = os.openpty()

        def controlling_tty():
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, preexec_fn=controlling_tty,
                                     env=env, close_fds=True)
        os.close(slave)
        self.text, self.cursor = "", 0
        self.chunks: list[str] = []

    def read_until(self, pattern: str, timeout: float) -> str:
        """Read until ``pattern`` (a regex) matches after the previous match; the text up to this match."""
        start, deadline = self.cursor, time.monotonic() + timeout
        while (match := re.search(pattern, self.text[start:])) is None:
            left = deadline - time.monotonic()
            assert left > 0, f"timed out waiting for {pattern!r}; got {self.text[start:]!r}"
            if select.select([self.master], [], [], left)[0]:
                try:
                    chunk = os.read(self.master, 4096).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    chunk = ""
                assert chunk, f"EOF waiting for {pattern!r}; got {self.text[start:]!r}"
                self.chunks.append(chunk)
                self.text += chunk
        self.cursor = start + match.end()
        return self.text[start:self.cursor]

    def send(self, data: str) -> None:
        os.write(self.master, data.encode())


@pytest.mark.slow
def test_chat_streams_and_survives_ctrl_c_on_a_terminal():
    """The default model through a real terminal: the answer arrives in several reads before its
    stats line; Ctrl-C stops an answer and returns to the prompt; Ctrl-C at the prompt exits 0."""
    tty = _Pty([sys.executable, "-m", "pagedllm.entrypoints.cli", "--log-level", "WARNING", "chat",
                "--max-tokens", "48", "--sampling-seed", "0"])
    try:
        tty.read_until(r"you> ", 300)
        tty.send("Name three colors.\n")
        tty.read_until(r"assistant> ", 60)
        first = len(tty.chunks)
        answer = tty.read_until(STATS.pattern, 120)
        assert len([c for c in tty.chunks[first:] if c.strip()]) > 1, tty.chunks[first:]
        assert int(STATS.search(answer).group(3)) > 0
        tty.read_until(r"you> ", 120)
        tty.send("Tell me a long story about a dragon.\n")
        tty.read_until(r"assistant> \S", 60)
        tty.send("\x03")
        stopped = tty.read_until(r"you> ", 120)
        assert "[stopped: the answer was not added]" in stopped and not STATS.search(stopped)
        tty.send("\x03")
        assert tty.proc.wait(timeout=120) == 0  # generous: CI machines are loaded
    finally:
        if tty.proc.poll() is None:
            tty.proc.kill()
        os.close(tty.master)
    assert "Traceback" not in tty.text
