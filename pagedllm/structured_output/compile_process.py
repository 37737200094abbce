"""Grammar conversion and compilation in a child process, under a time and a memory limit.

A JSON schema's conversion and its compile against the vocabulary can take seconds and gigabytes
(a ``pattern`` with a bounded repetition grows quadratically in its bound). xgrammar releases the
GIL while it works, but a thread cannot be stopped: so one child process (started on first use)
does one compile at a time; the caller's thread waits for its reply. Past the time limit, or when
the caller cancels (its client left), the child is killed, and the next compile starts a new one.
The child's address space is capped (``RLIMIT_AS`` at its size once started plus the memory
limit), so a compile that needs more fails alone.
The compiled grammar comes back serialized (``CompiledGrammar.serialize_json``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

TIMEOUT_FIELD = "structured_outputs_compile_timeout_s"
MEMORY_FIELD = "structured_outputs_compile_memory_mb"


_START_TIMEOUT_S = 120.0


class CompileLimitError(Exception):
    """A compile that ran past a limit (its message names the limit and its field) or was cancelled."""


class CompileCancelled(CompileLimitError):
    """The compile's requests all left before it finished."""


class GrammarCompileProcess:
    """One child process compiling for one tokenizer. ``compile`` is called from one thread at a
    time (the manager's compile thread); ``cancel`` from any thread stops the compile in progress."""

    def __init__(self, tokenizer_info_json: str, timeout_s: float, memory_mb: int | None) -> None:
        self._info_json = tokenizer_info_json
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self._cancelled: tuple | None = None  # the job to stop
        self.num_started = 0
        self.num_killed = 0
        self.num_cancelled = 0

    def compile(self, kind: str, text: str, any_whitespace: bool) -> str:
        """The serialized compiled grammar. Raises ValueError (the spec is invalid: xgrammar's message),
        CompileLimitError (past the time or memory limit) or CompileCancelled."""
        job = (kind, text, any_whitespace)
        try:
            return self._run(job)
        finally:
            if self._cancelled == job:
                self._cancelled = None

    def _run(self, job: tuple) -> str:
        conn = self._ensure_started()
        conn.send(("compile", *job))
        deadline = time.monotonic() + self.timeout_s
        while not conn.poll(min(0.05, max(0.0, deadline - time.monotonic()))):
            if self._cancelled == job:
                self.num_cancelled += 1
                self._kill()
                raise CompileCancelled("the grammar compile was cancelled: its requests left")
            if time.monotonic() >= deadline:
                self._kill()
                raise CompileLimitError(f"the grammar did not compile within {self.timeout_s:g} s "
                                        f"({TIMEOUT_FIELD})")
        try:
            status, payload = conn.recv()
        except (EOFError, OSError):
            self._kill()
            raise CompileLimitError(self._death_message()) from None
        if status == "ok":
            return payload
        if status == "memory":
            self._kill()  # a failed allocation may leave the child's heap in any state
            raise CompileLimitError(f"the grammar compile needs more than {self.memory_mb} MiB ({MEMORY_FIELD})")
        raise ValueError(payload)

    def cancel(self, kind: str, text: str, any_whitespace: bool) -> None:
        """Stop this spec's compile (in progress or about to start); ``compile`` then raises
        CompileCancelled. A cancel for another spec than the running one changes nothing."""
        self._cancelled = (kind, text, any_whitespace)

    def close(self) -> None:
        self._kill()

    def _death_message(self) -> str:
        limit = f"{self.memory_mb} MiB ({MEMORY_FIELD})" if self.memory_mb else "no memory limit"
        return f"the grammar compiler process ended during the compile ({limit})"

    def _ensure_started(self) -> Connection:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return self._conn
            parent, child = socket.socketpair()
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "pagedllm.structured_output.compile_process", str(child.fileno()),
                 str(self.memory_mb or 0)], pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL)
            child.close()
            self._conn = Connection(parent.detach())
            self._conn.send(self._info_json)
            self.num_started += 1
            # the time limit counts from a started process: wait for it to be ready
            if not self._conn.poll(_START_TIMEOUT_S) or self._conn.recv() != "ready":
                self._proc.kill()
                self._proc.wait()
                self._proc = None
                raise CompileLimitError(f"the grammar compile process did not start within {_START_TIMEOUT_S} s")
            return self._conn

    def _kill(self) -> None:
        with self._lock:
            proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            self.num_killed += 1
        if proc is not None:
            proc.wait()
        if conn is not None:
            conn.close()


def _address_space_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _serve(fd: int, memory_mb: int) -> None:
    """The child: read the tokenizer info, then answer compile requests until the socket closes."""
    conn = Connection(fd)
    import xgrammar as xgr

    from pagedllm.structured_output.backend_xgrammar import clean_error, compile_spec

    info = xgr.TokenizerInfo.deserialize_json(conn.recv())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    if memory_mb:
        import resource

        limit = _address_space_bytes() + memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn.send("ready")
    while True:
        try:
            _, kind, text, any_whitespace = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", compile_spec(compiler, kind, text, any_whitespace).serialize_json()))
        except MemoryError:
            conn.send(("memory", ""))
        except (RuntimeError, ValueError, TypeError) as e:
            # a C++ std::bad_alloc reaches Python as a RuntimeError naming it
            conn.send(("memory", "") if "bad_alloc" in str(e) else ("error", clean_error(e)))


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
