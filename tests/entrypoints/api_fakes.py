"""A fake engine that answers with scripted text (tool calls, stop sequences, cached prefixes) and a
server around it, for the Responses and Messages protocol tests."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time

import httpx

from pagedllm.outputs import CompletionOutput, RequestOutput
from fake_engine import BLOCK_SIZE, FakeEngine
from server_utils import MODEL, make_server

_RENDER_ARGUMENTS = ("tokenize", "chat_template", "continue_final_message", "add_generation_prompt")  # FakeTokenizer's

__all__ = ["MODEL", "ScriptedEngine", "scripted_server", "scripted_serving", "sse_typed_events", "wait_until_free"]


class ScriptedEngine(FakeEngine):
    """FakeEngine whose next requests answer ``script`` texts in turn (one character a step, then
    ``stop``), else letters as FakeEngine does. A stop string of the request ends the text there
    (``stop_reason`` the string); ``num_cached_tokens`` counts the full blocks shared with the prompt
    before. The chat template takes ``tools`` and records what it rendered."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.script: list[str] = []
        self.conversations: list[list[dict]] = []
        self.tools_seen: list = []
        self.template_kwargs_seen: list[dict] = []
        self._texts: dict[str, str] = {}
        self._cached: dict[str, int] = {}
        self._last_prompt: list[int] = []
        render = self.tokenizer.apply_chat_template

        def recording_render(messages, tools=None, **kwargs) -> str:  # what the server's front end renders
            self.conversations.append(messages)
            self.tools_seen.append(tools)
            own = {k: kwargs.pop(k) for k in _RENDER_ARGUMENTS if k in kwargs}
            self.template_kwargs_seen.append(kwargs)  # the template's extra variables (reasoning_effort, ...)
            return render(messages, tools=tools, **own)

        self.tokenizer.apply_chat_template = recording_render

    def add_request(self, request_id, prompt, params=None, *args, **kwargs):
        rid = super().add_request(request_id, prompt, params, *args, **kwargs)
        if self.script:
            self._texts[rid] = self.script.pop(0)
        ids = self.requests[rid].prompt_ids
        shared = next((i for i, (a, b) in enumerate(zip(ids, self._last_prompt)) if a != b),
                      min(len(ids), len(self._last_prompt)))
        self._cached[rid] = min(shared, len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE  # the last token is recomputed
        self._last_prompt = ids
        return rid

    def step(self) -> list[RequestOutput]:
        scripted = {rid: self.requests[rid] for rid in self.order if rid in self._texts}
        outputs = super().step()
        for out in outputs:
            req = scripted.get(out.request_id)
            out.num_cached_tokens = self._cached.get(out.request_id, 0)
            if req is not None and out.error is None:
                self._script_output(out, req)
        return outputs

    def _script_output(self, out: RequestOutput, req) -> None:
        seq = req.seqs[0]
        text, pos = self._texts[req.request_id], len(seq.token_ids) - 1
        stop = next((s for s in req.params.stop or () if text.find(s) >= 0), None)
        end = text.find(stop) if stop else len(text)
        char = text[pos] if pos < end else ""
        finish = "stop" if pos + 1 >= end else seq.finish_reason
        seq.token_ids[-1] = ord(char) if char else 2
        out.outputs = [CompletionOutput(0, char, [seq.token_ids[-1]], None, None, finish,
                                        stop if finish == "stop" and stop else None)]
        out.finished = finish is not None
        if finish == "stop" and out.request_id in self.requests:
            self._remove(out.request_id)
            self._texts.pop(out.request_id)
        elif finish is not None:
            self._texts.pop(out.request_id, None)


def scripted_server(reasoning_parser: str | None = None, **kwargs):
    """A server thread on a fresh ScriptedEngine (``kwargs`` go to FakeEngine, ``app_*`` to build_app) with
    ``--reasoning-parser`` ``reasoning_parser``."""
    app_kwargs = {k[4:]: kwargs.pop(k) for k in list(kwargs) if k.startswith("app_")}
    fake = ScriptedEngine(**{"max_model_len": 512, **kwargs})
    fake.config = dataclasses.replace(fake.config, reasoning_parser=reasoning_parser)
    return make_server(fake, **app_kwargs)


@contextlib.contextmanager
def scripted_serving(**kwargs):
    """:func:`scripted_server` started, with its engine as ``.fake`` (for module fixtures)."""
    srv, fake = scripted_server(**kwargs)
    with srv:
        srv.fake = fake
        yield srv


def sse_typed_events(text: str) -> list[tuple[str, dict]]:
    """``(event name, data)`` of each event of an SSE body with ``event:`` lines."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line)
        out.append((lines.get("event"), json.loads(lines["data"])))
    return out


def wait_until_free(fake: FakeEngine, client: httpx.Client, timeout_s: float = 2.0) -> None:
    """Wait for the engine to hold no request; assert its blocks and the KV usage gauge are back to 0."""
    t0 = time.monotonic()
    while fake.requests and time.monotonic() - t0 < timeout_s:
        time.sleep(0.01)
    assert not fake.requests and fake.used_blocks() == 0
    time.sleep(0.1)
    assert 'pagedllm:kv_cache_usage_perc{engine="0",model_name="fake-model"} 0.0' in client.get("/metrics").text
