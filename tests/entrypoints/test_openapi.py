"""The OpenAPI document is the server: schemathesis sends generated valid and invalid requests
to every operation of ``/openapi.json`` (fake engine, bounded examples per operation) and
checks each answer against the document: no 5xx, documented status codes, media types,
response schemas and headers, invalid input refused, 405 with ``Allow``.

``positive_data_acceptance`` is off: rules that span fields or depend on the model
(prompt + max_tokens within the context, token ids within the vocabulary, min_tokens <=
max_tokens, stream_options only with stream, ...) cannot be stated in a JSON schema, so a
schema-valid request may rightly get a 400. The single-field constraints are pinned by
:func:`test_schema_refuses_what_the_server_refuses`.
"""

from __future__ import annotations

import httpx
import jsonschema_rs
import pytest
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from fake_engine import FakeEngine
from server_utils import MODEL, make_server

MAX_EXAMPLES = 20  # per operation: the whole run stays well under a minute


@pytest.fixture(scope="module")
def server():
    srv, _ = make_server(FakeEngine(max_model_len=4096, max_logprobs=5), api_key="k")
    with srv:
        yield srv


def test_every_operation_conforms_to_the_document(server):
    api = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [op.ok() for op in api.get_all_operations()]
    # completions, chat, responses (create, get, delete, cancel), messages (create, count tokens), models, a model,
    # health, version, metrics, (de)tokenize, kv state, embeddings, rerank x2, score
    assert len(operations) == 20
    for op in operations:
        @given(case=op.as_strategy(generation_mode=GenerationMode.POSITIVE)
               | op.as_strategy(generation_mode=GenerationMode.NEGATIVE))
        @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            case.call_and_validate(headers={"Authorization": "Bearer k"}, excluded_checks=[positive_data_acceptance])

        check()


def _request_schema(doc: dict, name: str) -> dict:
    return {**doc["components"]["schemas"][name], "components": doc["components"]}


_VALID = {"ChatCompletionRequest": {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "none",
                                    "modalities": ["text"]},
          "CompletionRequest": {"prompt": "a", "n": 1, "logprobs": 1, "allowed_token_ids": [1], "temperature": 0,
                                "stop": ["x"], "suffix": "", "guided_choice": None}}
_HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("name, body", [
    ("ChatCompletionRequest", {"messages": []}),
    ("CompletionRequest", {"prompt": ""}),
    ("CompletionRequest", {"prompt": []}),
    ("CompletionRequest", {"prompt": [[]]}),
    ("CompletionRequest", {"prompt": "a", "allowed_token_ids": []}),
    ("ChatCompletionRequest", {"messages": [{"role": "user"}], "tool_choice": {}}),
    ("CompletionRequest", {"prompt": "a", "n": 17}),  # --max-n 16
    ("CompletionRequest", {"prompt": "a", "logprobs": 6}),  # max_logprobs 5
    ("CompletionRequest", {"prompt": ["a"] * 1025}),  # --max-prompts-per-request 1024
    ("CompletionRequest", {"prompt": "a", "temperature": -1}),
    ("CompletionRequest", {"prompt": "a", "stop": [""]}),
    ("CompletionRequest", {"prompt": [128]}),  # the fake's vocabulary has 128 tokens
    ("CompletionRequest", {"prompt": "a", "suffix": "x"}),  # refused fields: the document lists their off values
    ("ChatCompletionRequest", {"messages": _HI, "modalities": []}),
    ("ChatCompletionRequest", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("CompletionRequest", {"prompt": "a", "guided_choice": []}),
    ("CompletionRequest", {"prompt": "a", "guided_choice": ["yes", ""]}),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
])
def test_schema_refuses_what_the_server_refuses(server, name, body):
    doc = httpx.get(server.url + "/openapi.json").json()
    schema = _request_schema(doc, name)
    assert not jsonschema_rs.is_valid(schema, body)
    assert jsonschema_rs.is_valid(schema, {**body, **_VALID[name]})
    path = "/v1/chat/completions" if name.startswith("Chat") else "/v1/completions"
    r = httpx.post(server.url + path, json={"model": MODEL, **body}, headers={"Authorization": "Bearer k"})
    assert r.status_code == 400


@pytest.mark.parametrize("name, bad, fix, param", [
    ("ChatCompletionRequest", {"continue_final_message": True}, {"add_generation_prompt": False},
     "continue_final_message"),
    ("ChatCompletionRequest", {"logprobs": False, "top_logprobs": 2}, {"logprobs": True}, "top_logprobs"),
    ("ChatCompletionRequest", {"stream_options": {"include_usage": True}}, {"stream": True}, "stream_options"),
    ("CompletionRequest", {"stream_options": {"include_usage": True}}, {"stream": True}, "stream_options"),
    ("CompletionRequest", {"prompt_logprobs": 1, "stream": True}, {"stream": False}, "prompt_logprobs"),
])
def test_cross_field_rules_are_in_the_document(server, name, bad, fix, param):
    """A rule between two fields that JSON Schema can state (allOf of if/then) is stated, and the
    server keeps it: the bad body is invalid and a 400 naming the field, the fixed one valid."""
    doc = httpx.get(server.url + "/openapi.json").json()
    schema = _request_schema(doc, name)
    base = {"messages": [*_HI, {"role": "assistant", "content": "ok"}]} if name.startswith("Chat") else {"prompt": "a"}
    assert not jsonschema_rs.is_valid(schema, {**base, **bad})
    assert jsonschema_rs.is_valid(schema, {**base, **bad, **fix})
    path = "/v1/chat/completions" if name.startswith("Chat") else "/v1/completions"
    r = httpx.post(server.url + path, json={"model": MODEL, "max_tokens": 1, **base, **bad},
                   headers={"Authorization": "Bearer k"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_document_media_types_and_errors(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    paths = doc["paths"]
    assert all("422" not in op["responses"] for p in paths.values() for op in p.values())
    completions = paths["/v1/completions"]["post"]["responses"]
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    event_schema = completions["200"]["content"]["text/event-stream"]["schema"]  # one event (OpenAPI < 3.2)
    stream = httpx.post(server.url + "/v1/completions", headers={"Authorization": "Bearer k"},
                        json={"model": MODEL, "prompt": "a", "max_tokens": 2, "stream": True})
    events = [{"data": line[len("data: "):]} for line in stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == {"data": "[DONE]"} and all(jsonschema_rs.is_valid(event_schema, e) for e in events)
    assert completions["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "Retry-After" in completions["503"]["headers"] and "WWW-Authenticate" in completions["401"]["headers"]
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "content" not in paths["/health"]["get"]["responses"]["200"]


def test_edges_of_tokenize_detokenize_and_kv_state_agree_with_the_document(server):
    """Integral numbers are integers (JSON Schema's rule: 1.0 is one), token ids stop at the
    vocabulary, the chat-template flags exclude each other, the replica index has a range:
    what the document allows is served, what it forbids is a 400 naming the field."""
    doc = httpx.get(server.url + "/openapi.json").json()
    auth = {"Authorization": "Bearer k"}

    def agree(schema: dict, method: str, path: str, status: int, param: str | None = None, **kw) -> httpx.Response:
        r = httpx.request(method, server.url + path, headers=auth, **kw)
        value = kw["json"] if "json" in kw else int(kw["params"]["engine"])
        assert jsonschema_rs.is_valid(schema, value) == (status == 200)
        assert r.status_code == status, r.text
        if param is not None:
            assert r.json()["error"]["param"] == param
        return r

    detok = _request_schema(doc, "DetokenizeRequest")
    whole = agree(detok, "POST", "/detokenize", 200, json={"tokens": [65, 66.0, 6.7e1]})
    assert whole.json() == httpx.post(server.url + "/detokenize", headers=auth, json={"tokens": [65, 66, 67]}).json()
    agree(detok, "POST", "/detokenize", 400, "tokens", json={"tokens": [65.5]})
    agree(detok, "POST", "/detokenize", 400, "tokens", json={"tokens": [128]})
    agree(detok, "POST", "/detokenize", 400, "tokens", json={"tokens": [True]})

    tok = _request_schema(doc, "TokenizeRequest")
    agree(tok, "POST", "/tokenize", 400, "continue_final_message", json={"messages": _HI, "continue_final_message": True})
    agree(tok, "POST", "/tokenize", 400, "continue_final_message", json={"prompt": "a", "continue_final_message": True})
    agree(tok, "POST", "/tokenize", 400, "prompt", json={"prompt": "a", "messages": _HI})  # exactly one
    agree(tok, "POST", "/tokenize", 400, "prompt", json={"prompt": None})
    agree(tok, "POST", "/tokenize", 200, json={"messages": [*_HI, {"role": "assistant", "content": "ok"}],
                                                "continue_final_message": True, "add_generation_prompt": False})

    (engine,) = doc["paths"]["/kv/state"]["get"]["parameters"]
    agree(engine["schema"], "GET", "/kv/state", 400, "engine", params={"engine": "-1"})
    agree(engine["schema"], "GET", "/kv/state", 400, "engine", params={"engine": "1"})  # one engine: only 0
    assert httpx.get(server.url + "/kv/state", headers=auth, params={"engine": "0"}).status_code == 404  # fake: no KV


def test_integer_fields_take_integral_numbers(server):
    """``16.0`` is the integer 16 in every integer field (JSON has one number type); ``1.5``,
    ``true`` and ``"2"`` are refused naming the field."""
    auth = {"Authorization": "Bearer k"}
    url = server.url + "/v1/completions"
    ints = {"model": MODEL, "prompt": [65, 66], "max_tokens": 3, "n": 2, "seed": 7, "logprobs": 1,
            "temperature": 0}
    floats = {**ints, "prompt": [65.0, 66.0], "max_tokens": 3.0, "n": 2.0, "seed": 7.0, "logprobs": 1.0}
    a, b = (httpx.post(url, headers=auth, json=body) for body in (ints, floats))
    assert a.status_code == b.status_code == 200, b.text
    assert [c["text"] for c in a.json()["choices"]] == [c["text"] for c in b.json()["choices"]]
    assert b.json()["usage"]["prompt_tokens"] == 2 and b.json()["usage"]["completion_tokens"] == 6
    for field, value in (("max_tokens", 1.5), ("n", True), ("seed", "2")):
        r = httpx.post(url, headers=auth, json={**ints, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize("api_key", ["k", None])
def test_401_is_documented_exactly_where_the_key_is_checked(api_key):
    """With an API key, every operation that answers 401 without it lists 401 (with
    WWW-Authenticate) and the open ones (probes, scrapers) do not; without a key no operation
    lists a 401, since none can answer one."""
    srv, _ = make_server(FakeEngine(max_model_len=64), api_key=api_key)
    with srv:
        doc = httpx.get(srv.url + "/openapi.json").json()
        listed, answered = set(), set()
        for path, ops in doc["paths"].items():
            for method, op in ops.items():
                if "401" in op["responses"]:
                    listed.add(path)
                    assert "WWW-Authenticate" in op["responses"]["401"]["headers"]
                url = srv.url + path.replace("{model}", MODEL).replace("{response_id}", "resp_1")
                r = httpx.request(method, url, json={} if method == "post" else None)  # no Authorization
                if r.status_code == 401:
                    answered.add(path)
    assert listed == answered
    if api_key:
        assert answered == {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}",
                            "/tokenize", "/detokenize", "/kv/state", "/v1/responses", "/v1/responses/{response_id}",
                            "/v1/responses/{response_id}/cancel", "/v1/messages", "/v1/messages/count_tokens",
                            "/v1/embeddings", "/v1/rerank", "/rerank", "/score"}
    else:
        assert answered == set()


@pytest.mark.parametrize("name, body, param, words", [
    ("CompletionRequest", {"prompt": "a", "n": 2, "best_of": 3}, "best_of", "best_of >= n"),
    ("CompletionRequest", {"prompt": "a", "best_of": 2}, "best_of", "best_of == n"),
    ("CompletionRequest", {"prompt": "a", "min_tokens": 5, "max_tokens": 3}, "min_tokens", "At most the request's"),
    ("ChatCompletionRequest", {"messages": _HI, "min_tokens": 5, "max_completion_tokens": 3}, "min_tokens",
     "`max_completion_tokens` in chat"),
    ("CompletionRequest", {"prompt": "a", "max_tokens": 4096}, "prompt", "max_model_len (4096 tokens"),
    ("CompletionRequest", {"prompt": [1] * 4096}, "prompt", "max_model_len (4096 tokens"),
    ("ChatCompletionRequest", {"messages": _HI, "max_tokens": 4096}, "messages", "max_model_len (4096 tokens"),
    ("ChatCompletionRequest", {"messages": _HI, "max_completion_tokens": 4096}, "messages", "(4096 tokens"),
    ("CompletionRequest", {"prompt": "a", "logit_bias": {"128": 1}}, "logit_bias", "below the vocabulary size (128)"),
    ("ChatCompletionRequest", {"messages": _HI, "logit_bias": {"999999": 1}}, "logit_bias", "vocabulary size (128)"),
])
def test_rules_beyond_json_schema_are_described_and_refused(server, name, body, param, words):
    """A rule JSON Schema cannot state (across fields, or the model's numbers) is in the
    description of the field the 400 names, with this server's numbers; the body is
    schema-valid and the server refuses it with an OpenAI error naming that field."""
    doc = httpx.get(server.url + "/openapi.json").json()
    schema = _request_schema(doc, name)
    described = " ".join(schema["properties"][f].get("description", "") for f in (param, *body))
    assert words in described and "{" not in described
    assert jsonschema_rs.is_valid(schema, body)
    path = "/v1/chat/completions" if name.startswith("Chat") else "/v1/completions"
    r = httpx.post(server.url + path, json={"model": MODEL, **body}, headers={"Authorization": "Bearer k"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
