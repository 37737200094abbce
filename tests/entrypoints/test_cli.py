"""The `pagedllm` command line: generate prints completions; bad options exit 2 with a message."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.cli import build_parser, main


def test_engine_flags_come_from_engine_config():
    args = build_parser().parse_args(["generate", "hi", "--block-size", "32", "--no-enable-prefix-caching",
                                      "--kv-cache-memory", "1GiB", "--max-num-seqs", "8"])
    assert (args.block_size, args.enable_prefix_caching, args.kv_cache_memory, args.max_num_seqs) == \
        (32, False, "1GiB", 8)
    serve = build_parser().parse_args(["serve", "some-model", "--port", "9999", "--max-model-len", "256"])
    assert (serve.model, serve.port, serve.max_model_len) == ("some-model", 9999, 256)


def test_generate_prints_the_greedy_completion(tiny_model_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\nThe sky is\n")
    rc = main(["generate", "-m", str(tiny_model_dir), "--prompts-file", str(prompts), "--max-tokens", "5",
               "--ignore-eos", "--num-kv-blocks", "64", "--max-model-len", "128"])
    assert rc == 0
    out = capsys.readouterr()
    llm = LLM(model=str(tiny_model_dir), num_kv_blocks=64, max_model_len=128)
    expected = llm.generate(["Hello there", "The sky is"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                            use_tqdm=False)
    for exp in expected:
        assert exp.outputs[0].text in out.out
    assert "2 requests, 10 tokens" in out.err


def test_generate_prints_the_logprobs_of_its_tokens(tiny_model_dir, capsys):
    """``--logprobs N``: a line per generated token with its logprob and rank and the N most
    likely tokens, then the cumulative logprob; ``--prompt-logprobs`` the same per prompt token
    (was: nothing printed). Values are LLM.generate's."""
    argv = ["generate", "-m", str(tiny_model_dir), "Hello there", "--max-tokens", "3", "--ignore-eos", "--logprobs",
            "2", "--prompt-logprobs", "1", "--num-kv-blocks", "64", "--max-model-len", "128"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    llm = LLM(model=str(tiny_model_dir), num_kv_blocks=64, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    ref = llm.generate("Hello there", params, use_tqdm=False)[0]

    def check(title: str, token_ids: list[int], positions: list, num_top: int) -> None:
        start = lines.index(f"[{title}: position, token, logprob, rank | top {num_top}]") + 1
        for k, (tid, entry) in enumerate(zip(token_ids, positions)):
            line = lines[start + k]
            assert line.split()[0] == str(k)
            if entry is None:  # the first prompt token has no logprob
                assert line.rstrip().endswith("-")
                continue
            assert f"{entry[tid].logprob:9.4f} {entry[tid].rank:>5} |" in line, line
            for t, lp in entry.items():
                if lp.rank <= num_top:
                    assert f"{lp.decoded_token!r} {lp.logprob:.4f}" in line.split("|", 1)[1], line

    check("logprobs", ref.outputs[0].token_ids, ref.outputs[0].logprobs, 2)
    check("prompt logprobs", ref.prompt_token_ids, ref.prompt_logprobs, 1)
    assert f"  cumulative logprob {ref.outputs[0].cumulative_logprob:.4f}" in lines


def test_bad_option_exits_2_with_the_field_named(tiny_model_dir, capsys):
    rc = main(["generate", "-m", str(tiny_model_dir), "hi", "--block-size", "7"])
    assert rc == 2
    assert "--block-size" in capsys.readouterr().err
    assert main(["generate", "-m", str(tiny_model_dir)]) == 2


def test_chat_keeps_the_conversation_and_reuses_its_prefix(tiny_model_dir, monkeypatch, capsys):
    lines = iter(["Hello, who are you?", "And what can you do for me today?", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    rc = main(["chat", "-m", str(tiny_model_dir), "--max-tokens", "4", "--num-kv-blocks", "64",
               "--max-model-len", "256"])
    assert rc == 0
    err = capsys.readouterr().err
    turns = [ln for ln in err.splitlines() if "from the prefix cache," in ln]
    assert len(turns) == 2
    # turn 1 has nothing cached; turn 2's prompt starts with turn 1's prompt, so its full blocks hit
    assert ", 0 from the prefix cache," in turns[0]
    cached = int(turns[1].split(", ")[1].split()[0])
    assert cached >= 16 and cached % 16 == 0


def test_sampling_flags_come_from_sampling_params():
    import dataclasses

    from pagedllm.entrypoints.args import sampling_params_from_args

    parser = build_parser()
    args = parser.parse_args(["generate", "hi", "--top-k", "5", "--sampling-seed", "7", "--stop", "a", "--stop", "b",
                              "--stop-token-ids", "3", "--no-skip-special-tokens", "--min-tokens", "2",
                              "--logprobs", "1"])
    params = sampling_params_from_args(args)
    assert (params.top_k, params.seed, params.stop, params.stop_token_ids, params.skip_special_tokens,
            params.min_tokens, params.logprobs) == (5, 7, ["a", "b"], [3], False, 2, 1)
    assert (params.temperature, params.max_tokens, args.seed) == (0.0, 256, 0)  # CLI defaults; engine seed apart
    flags = {a.dest for a in parser._subparsers._group_actions[0].choices["chat"]._actions}
    user_fields = {f.name for f in dataclasses.fields(SamplingParams) if "help" in f.metadata}
    assert {"sampling_seed" if n == "seed" else n for n in user_fields} <= flags


def test_every_subcommand_prints_its_help(capsys):
    """argparse %-formats help text: a literal '%' in a field's help (``4% of max_model_len``)
    made ``--help`` raise TypeError. Every subcommand's help renders and names its flags."""
    import argparse

    import pytest

    parser = build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"generate", "chat", "serve", "plan"} <= set(subcommands)
    for name in subcommands:
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: pagedllm {name}")
        if name != "plan":
            assert "4% of max_model_len" in out  # the engine flag whose help has a literal '%'


def _no_model_load(monkeypatch):
    """Make loading a model fail loudly: the inputs below must be refused before it."""
    import pagedllm.engine.llm_engine
    import pagedllm.llm

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(pagedllm.llm, "LLM", refuse)
    monkeypatch.setattr(pagedllm.engine.llm_engine, "LLMEngine", refuse)


@pytest.mark.parametrize("argv,message", [
    (["generate", "hi", "--max-tokens", "-1"], "--max-tokens must be >= 1"),
    (["generate", "hi", "--top-p", "2"], "--top-p must be <= 1.0"),
    (["chat", "--n", "0"], "n must be >= 1"),
    (["generate", "--prompts-file", "/nonexistent/prompts.txt"], "--prompts-file '/nonexistent/prompts.txt'"),
    (["generate", "hi", "--chat", "--chat-template", "/nonexistent/t.jinja"], "--chat-template '/nonexistent/t.jinja'"),
    (["chat", "--chat-template", "/nonexistent/t.jinja"], "--chat-template '/nonexistent/t.jinja'"),
    (["serve", "--chat-template", "/nonexistent/t.jinja"], "--chat-template '/nonexistent/t.jinja'"),
])
def test_bad_input_is_refused_before_the_model_loads(argv, message, monkeypatch, capsys):
    """A wrong flag value or a missing file exits 2 naming it, at once (was: after loading the
    model, or a FileNotFoundError traceback)."""
    import sys

    _no_model_load(monkeypatch)
    interval = sys.getswitchinterval()  # `serve` sets it for the process
    try:
        assert main(argv) == 2
    finally:
        sys.setswitchinterval(interval)
    assert message in capsys.readouterr().err


def test_serve_on_a_port_in_use_fails_before_the_model_loads(monkeypatch, capsys):
    """The port is bound first: in use, `serve` exits 2 naming it at once (was: after loading
    the model, with uvicorn's error)."""
    import socket
    import sys

    _no_model_load(monkeypatch)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        interval = sys.getswitchinterval()  # `serve` sets it for the process
        try:
            assert main(["serve", "--port", str(port)]) == 2
        finally:
            sys.setswitchinterval(interval)
    err = capsys.readouterr().err
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}: already in use" in err and "Traceback" not in err


@pytest.mark.parametrize("port", ["-1", "65536", "99999"])
def test_serve_port_out_of_range_is_an_argument_error(port, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--port", port])
    assert exit_info.value.code == 2
    assert "--port: must be a TCP port from 0 to 65535" in capsys.readouterr().err


def test_chat_survives_a_turn_that_does_not_fit(tiny_model_dir, monkeypatch, capsys):
    """A message that makes the conversation outgrow max_model_len is refused with the reason and
    the chat goes on with the conversation so far (was: exit 2, the conversation lost)."""
    lines = iter(["Hi", "word " * 80, "Bye", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    rc = main(["chat", "-m", str(tiny_model_dir), "--max-tokens", "3", "--num-kv-blocks", "32",
               "--max-model-len", "64"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "maximum context length is 64 tokens" in captured.err and "the message was not added" in captured.err
    turns = [ln for ln in captured.err.splitlines() if "from the prefix cache," in ln]
    assert len(turns) == 2 and captured.out.count("assistant> ") == 2
    # the third turn's prompt holds the first turn and "Bye", not the refused message
    first, third = (int(t.strip("[").split()[0]) for t in turns)
    assert first < third < 64
