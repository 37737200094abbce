"""Chat templates render under a time limit: a looping (trusted) template fails its own request with
a 400-type ValueError naming the limit, and the front end renders the next one as before."""

from __future__ import annotations

import time

import pytest

from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.render_deadline import DeadlineExceeded, call_with_deadline

LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


def test_a_busy_loop_is_stopped_and_quick_calls_are_untouched():
    def spin():
        while True:
            pass

    with pytest.raises(DeadlineExceeded):
        call_with_deadline(spin, 0.2)
    assert [call_with_deadline(lambda i=i: i * 2, 0.05) for i in range(300)] == [i * 2 for i in range(300)]
    with pytest.raises(KeyError):
        call_with_deadline(lambda: {}["missing"], 5)
    time.sleep(0.1)  # no interrupt arrives late


def test_a_looping_template_fails_alone_naming_the_limit(smollm2_tokenizer):
    proc = InputProcessor(smollm2_tokenizer, len(smollm2_tokenizer), 512, 20, [], chat_template_timeout_s=0.5)
    conversation = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=r"chat_template.*0.5 s \(chat_template_timeout_s\)"):
        proc.render_chat(conversation, chat_template=LOOP)
    ids = proc.render_chat(conversation, chat_template=PLAIN, add_generation_prompt=False)
    assert smollm2_tokenizer.decode(ids) == "user: hi\n"
