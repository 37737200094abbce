"""``pagedllm chat``: an interactive conversation whose answers stream token by token.

Each answer is one engine request with DELTA outputs; Ctrl-C aborts it (its blocks are freed)
and the conversation goes on without that turn. Ctrl-C or Ctrl-D at the prompt ends the chat.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from pathlib import Path

from pagedllm.loader.generation_config import SAMPLING_FIELDS, read_sampling_defaults
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

# vLLM's fallback when a model has no generation_config.json: its SamplingParams defaults.
FALLBACK_SAMPLING = dict(zip(SAMPLING_FIELDS, (1.0, 1.0, 0, 0.0, 1.0)))


def model_sampling_defaults(source: str, fmt: str) -> dict:
    """The sampling keys of an HF folder's ``generation_config.json`` over
    :data:`FALLBACK_SAMPLING`. GGUF files carry none."""
    model_defaults = read_sampling_defaults(source) if fmt == "hf" else {}
    return {**FALLBACK_SAMPLING, **model_defaults}


class ChatSession:
    """One conversation with ``engine`` (an LLMEngine): ``history`` holds the turns answered."""

    def __init__(self, engine, params: SamplingParams, system: str | None, template: str | None, out=None):
        self.engine, self.template, self.out = engine, template, out or sys.stdout
        self.params = params.clone()
        self.params.output_kind = RequestOutputKind.DELTA
        self.history = [{"role": "system", "content": system}] if system else []
        self._num_turns = 0

    def answer(self, message: str) -> str | None:
        """Stream the answer to ``message`` and return it (None when Ctrl-C stopped it).
        Raises ValueError, keeping the history, when the turn does not fit."""
        conversation = self.history + [{"role": "user", "content": message}]
        ids = self.engine.apply_chat_template(conversation, chat_template=self.template)
        request_id = f"chat-{self._num_turns}"
        self._num_turns += 1
        self.engine.add_request(request_id, {"prompt_token_ids": ids}, self.params)
        with _sigint_between_steps() as interrupted:
            result = self._stream(request_id, interrupted)
        if result is None:
            self.engine.abort_request(request_id)
            print("\n[stopped: the answer was not added]", file=sys.stderr)
            return None
        text, final, num_tokens, seconds = result
        self.history = conversation + [{"role": "assistant", "content": text}]
        print(_stats_line(final, num_tokens, seconds), file=sys.stderr)
        return text

    def _stream(self, request_id: str, interrupted: list[bool]):
        """Print the answer's text as it arrives; (text, last output, output tokens, seconds),
        or None once Ctrl-C was pressed (checked between engine steps)."""
        pieces, last, num_tokens = [], None, 0
        t0 = time.perf_counter()
        self.out.write("assistant> ")
        while last is None or not last.finished:
            if interrupted[0]:
                return None
            for out in self.engine.step():
                if out.request_id == request_id:
                    last = out
                    pieces.append(out.outputs[0].text)
                    num_tokens += len(out.outputs[0].token_ids)
                    self.out.write(out.outputs[0].text)
                    self.out.flush()
        self.out.write("\n")
        return "".join(pieces), last, num_tokens, time.perf_counter() - t0


@contextlib.contextmanager
def _sigint_between_steps():
    """Turn Ctrl-C into a flag (``[True]``) while the body runs, so a step is never cut in
    half; outside the main thread signals cannot be caught and the flag stays False."""
    flag = [False]
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: flag.__setitem__(0, True))
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def _stats_line(out, num_tokens: int, seconds: float) -> str:
    return (f"[{len(out.prompt_token_ids)} prompt tokens, {out.num_cached_tokens} from the prefix cache, "
            f"{num_tokens} output tokens in {seconds:.2f} s = {num_tokens / max(seconds, 1e-9):.1f} tok/s]")


def run_chat(session: ChatSession) -> int:
    """The read-answer loop; exits 0 on an empty line, Ctrl-D or Ctrl-C at the prompt."""
    print("pagedllm chat: Ctrl-C stops an answer; empty line, Ctrl-D or Ctrl-C here quits", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line:
            return 0
        try:
            session.answer(line)
        except ValueError as e:  # e.g. the conversation outgrew max_model_len
            print(f"error: {e}\n(the message was not added; send a shorter one, or an empty line to quit)",
                  file=sys.stderr)
