"""Client errors carry no internal paths or socket addresses (a dead tensor-parallel worker's gloo
message), in every error shape: JSON body, in-band stream event, Anthropic's error."""

from __future__ import annotations

import httpx

from pagedllm.entrypoints.openai.error_scrub import scrub
from server_utils import MODEL, make_server, sse_events

GLOO = ("tensor-parallel worker 1 died: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] "
        "Connection closed by peer [10.0.0.2]:29500 (from /work/app/.venv/lib/python3.12/site-packages/x.py:12)")
SCRUBBED = "tensor-parallel worker 1 died: [<path>] Connection closed by peer <address> (from <path>)"


def test_scrub_keeps_the_message_and_drops_paths_and_addresses():
    assert scrub(GLOO) == SCRUBBED
    assert scrub("peer 127.0.0.1:5000, [::1]:8000, localhost:9") == "peer <address>, <address>, <address>"
    for kept in ("the $ref 'https://example.com/s.json' is not supported", "unknown route /v1/foo",
                 "max_tokens must be at least 1, got 0", "top_p must be in (0, 1], got 1.5"):
        assert scrub(kept) == kept


def _assert_clean(text: str) -> None:
    assert "tensor-parallel worker 1 died" in text
    for leak in ("/pytorch", "pair.cc", "10.0.0.2", "29500", "/work/app", ".venv"):
        assert leak not in text, text


def test_a_failed_step_reaches_clients_scrubbed():
    srv, fake = make_server()
    fake.step_error = GLOO
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    with srv, httpx.Client(base_url=srv.url, timeout=10) as c:
        fake.fail_steps = 1
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 500
        _assert_clean(r.json()["error"]["message"])
        fake.fail_steps = 1
        events = sse_events(c.post("/v1/completions", json={**body, "stream": True}).text)
        assert events[-1] == "[DONE]"
        _assert_clean(events[-2])
        fake.fail_steps = 1
        r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": "hi"}]})
        _assert_clean(r.json()["error"]["message"])
