"""A model without a chat template (Gemma 3 270M's GGUF is one): chat requests get a clear
error — ValueError offline, HTTP 400 with an OpenAI error body from the server — unless a
template is given (``chat_template=``, ``--chat-template FILE``); plain completions work."""

from __future__ import annotations

import json

import httpx
import pytest

from pagedllm.entrypoints.cli import main
from tests.conftest import build_tiny_llama_dir
from tests.server_utils import ServerThread, assert_error

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"


@pytest.fixture(scope="module")
def no_template_dir(tmp_path_factory, smollm2_tokenizer):
    folder = build_tiny_llama_dir(tmp_path_factory.mktemp("no_template"), smollm2_tokenizer)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def llm(no_template_dir):
    from pagedllm import LLM

    return LLM(model=str(no_template_dir), max_model_len=128, num_kv_blocks=32)


def test_offline_chat_needs_a_template(llm):
    from pagedllm import SamplingParams

    params = SamplingParams(max_tokens=3, temperature=0)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "Hi"}], params)
    out = llm.chat([{"role": "user", "content": "Hi"}], params, chat_template=TEMPLATE, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    assert llm.llm_engine.tokenizer.decode(out.prompt_token_ids).endswith("<|user|>Hi\n<|assistant|>")


@pytest.mark.parametrize("template", [None, TEMPLATE])
def test_server_chat_400_without_template(llm, template):
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.entrypoints.openai.api_server import build_app

    engine = AsyncLLMEngine(llm.llm_engine, stats_log_interval_s=0)
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    with ServerThread(build_app(engine, ["m"], chat_template=template)) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
        if template is None:
            assert "no chat template" in assert_error(r, 400)["message"]
        else:
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        completion = httpx.post(srv.url + "/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2},
                                timeout=60)
        assert completion.status_code == 200


def test_cli_chat_template_flag(no_template_dir, tmp_path, capsys):
    args = ["generate", "--chat", "Hi", "-m", str(no_template_dir), "--max-tokens", "2", "--max-model-len", "64",
            "--num-kv-blocks", "8"]
    assert main(args) == 2
    assert "no chat template" in capsys.readouterr().err
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    assert main(args + ["--chat-template", str(template)]) == 0
    assert main(args + ["--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert "missing.jinja" in capsys.readouterr().err


BROKEN_TEMPLATES = [
    "{% for %}",                                        # Jinja syntax error
    "{{ raise_exception('roles must alternate') }}",    # the template's own refusal
    "{{ messages[0].content.nope.deeper }}",            # undefined attribute of an undefined
    "{{ messages[0].content + 1 }}",                    # a type error while rendering
]


@pytest.mark.parametrize("template", BROKEN_TEMPLATES)
def test_a_template_that_fails_to_render_is_bad_input_not_a_crash(llm, template):
    """vLLM answers 400 when the chat template fails on a conversation; offline it is a
    ValueError naming ``chat_template`` (was: jinja2's exception offline, HTTP 500 served)."""
    from pagedllm import SamplingParams
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.entrypoints.openai.api_server import build_app

    params = SamplingParams(max_tokens=2, temperature=0)
    with pytest.raises(ValueError, match="^chat_template could not render the conversation: "):
        llm.chat([{"role": "user", "content": "Hi"}], params, chat_template=template, use_tqdm=False)
    engine = AsyncLLMEngine(llm.llm_engine, stats_log_interval_s=0)
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    config = llm.llm_engine.config
    llm.llm_engine.config = config.replace(trust_request_chat_template=True)  # the operator allows request templates
    with ServerThread(build_app(engine, ["m"], chat_template=TEMPLATE)) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json=dict(body, chat_template=template), timeout=60)
        error = assert_error(r, 400)
        assert error["param"] == "chat_template" and "could not render" in error["message"]
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)  # the server goes on
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    llm.llm_engine.config = config
