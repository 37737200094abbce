"""The SmolLM2 tokenizer built from GGUF metadata: token facts, round trips, special tokens,
chat template (cases C24, C25, C30), checked against transformers' own GGUF tokenizer."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

from pagedllm.loader import load_model_files  # noqa: E402
from pagedllm.loader.tokenizer import load_hf_tokenizer  # noqa: E402

DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"

TRICKY_STRINGS = [
    "", " ", "  ", "   leading spaces", "trailing spaces   ", "double  space", "tab\there", "\t\tlead tabs",
    "\n", "\n\n", "line1\nline2\r\nline3", " hello", "hello world", "Hello, World!", "naïve café résumé",
    "Ünïcödé ÀÉÎÕÜ", "日本語のテキスト", "中文字符和English混合", "Привет, мир", "مرحبا بالعالم", "שלום עולם",
    "🙂", "emoji 🙂🙃 pair", "👩‍👩‍👧‍👦 family ZWJ", "🏳️‍🌈 flag", "a\u200bzero-width", "\u00a0nbsp\u00a0",
    "math ∑∫√∞ ≠ ≤", "2024-01-01 12:34:56", "3.14159265358979", "1,000,000 and 42", "0x1F 0b1010 1e-9",
    "def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) { a[i] = 0; }", "if a != b and c >= d:",
    "{\"key\": [1, 2, 3], \"n\": null}", "<html><body>Hi</body></html>", "SELECT * FROM t WHERE x='y';",
    "path/to/file.py:10", "https://example.com/a?b=c&d=e#f", "user@example.com", "C:\\Windows\\System32",
    "it's don't we'll they're I'M", "''' \"\"\" ``` ~~~", "....!!!???,,,;;;", "ALLCAPS lowercase MiXeD",
    "x" * 300, "The quick brown fox jumps over the lazy dog.", "   \n\t  mixed whitespace \n ",
    "<|im_start|> appears literally", "end with special <|im_end|>",
]


@pytest.fixture(scope="module")
def files():
    return load_model_files("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def tok(files):
    return files.tokenizer


@pytest.fixture(scope="module")
def hf_gguf_tok(files):
    """transformers' tokenizer built from the same GGUF (AutoTokenizer, gguf_file=...)."""
    folder, name = os.path.split(files.source)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)


def test_tokenizer_type_and_special_tokens(tok, files):
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert len(tok) == 49152
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.convert_tokens_to_ids("<|endoftext|>") == 0
    # SmolLM2's GGUF says add_bos_token = false: no BOS is prepended.
    assert tok.encode("Hi", add_special_tokens=True) == tok.encode("Hi", add_special_tokens=False)
    assert files.eos_token_id == 2
    assert files.stop_token_ids == [0]  # llama.cpp's end-of-generation detection adds <|endoftext|>


@pytest.mark.parametrize("text, ids", [
    ("🙂", [10813, 38887]), (" hello", [33662]), ("\n\n", [1116]), ("<|im_end|>", [2]),
    ("<|im_start|>", [1]), ("<|endoftext|>", [0]),
])
def test_token_facts(tok, text, ids):
    assert tok.encode(text, add_special_tokens=False) == ids
    assert tok.decode(ids) == text


def test_single_token_decode_keeps_leading_space(tok):
    assert tok.decode([33662]) == " hello"
    assert tok.decode([1116]) == "\n\n"
    assert tok.convert_ids_to_tokens([33662]) == ["Ġhello"]  # the marker exists only in token strings


def test_digits_are_split_one_by_one(tok):
    ids = tok.encode("year 2024", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids] == ["year", " ", "2", "0", "2", "4"]


@pytest.mark.parametrize("text", TRICKY_STRINGS)
def test_round_trip_matches_transformers_gguf_tokenizer(tok, hf_gguf_tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == hf_gguf_tok.encode(text, add_special_tokens=False)
    decoded = tok.decode(ids)
    assert decoded == text
    assert "\u0120" not in decoded and "\u010a" not in decoded  # no byte-level markers (Ġ, Ċ)


def test_special_tokens_skipped_or_shown(tok, hf_gguf_tok):
    hello = tok.encode("Hello", add_special_tokens=False)
    assert tok.decode(hello + [2], skip_special_tokens=True) == "Hello"
    t2 = tok.encode("Hi", add_special_tokens=False) + [0] + tok.encode(" there", add_special_tokens=False)
    assert tok.decode(t2, skip_special_tokens=True) == "Hi there"
    assert tok.decode(t2, skip_special_tokens=False) == "Hi<|endoftext|> there"
    for flag in (True, False):
        assert tok.decode(t2, skip_special_tokens=flag) == hf_gguf_tok.decode(t2, skip_special_tokens=flag)


CHATS = {
    "a": ([{"role": "user", "content": "Hi"}],
          DEFAULT_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
    "b": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
          "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
    "c": ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
           {"role": "user", "content": "Bye"}],
          DEFAULT_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
          "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"),
}


@pytest.mark.parametrize("case", sorted(CHATS))
def test_chat_template_c30(tok, files, case):
    messages, expected = CHATS[case]
    assert files.chat_template == tok.chat_template and "add_generation_prompt" in files.chat_template
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == expected
    assert rendered.count("Be brief.") == (1 if case == "b" else 0)
    for add_special in (False, True):  # add_bos_token is false, so both give one leading BOS
        ids = tok.encode(rendered, add_special_tokens=add_special)
        assert ids[0] == 1 and ids[1] != 1
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True)
    assert tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"] == ids
    header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert header[0] == 1 and ids[-len(header):] == header
    assert ids.count(1) == rendered.count("<|im_start|>")


def test_saved_tokenizer_reloads_identically(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    reloaded = load_hf_tokenizer(tmp_path)
    assert reloaded.chat_template == tok.chat_template
    for text in TRICKY_STRINGS:
        assert reloaded.encode(text) == tok.encode(text)


@pytest.mark.parametrize("pre, expected", [("smollm", ["1", "2", " ", "a"]), ("default", ["12", " ", "a"])])
def test_digit_split_follows_llama_cpp_pre_type(tmp_path, pre, expected):
    """llama.cpp splits every digit for pre-tokenizer "smollm" (and StarCoder-like ones), so a
    merge "1 2" must not apply there; with the default GPT-2 split it does."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from pagedllm.loader.tokenizer import load_gguf_tokenizer

    tokens = list(bytes_to_unicode().values()) + ["12", "<|im_end|>"]
    writer = gguf.GGUFWriter(str(tmp_path / "tok.gguf"), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges(["1 2"])
    writer.add_eos_token_id(len(tokens) - 1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tok = load_gguf_tokenizer(tmp_path / "tok.gguf")
    ids = tok.encode("12 a", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids] == expected
    assert tok.decode(ids) == "12 a" and tok.eos_token == "<|im_end|>"
