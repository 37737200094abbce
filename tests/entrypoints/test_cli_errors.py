"""CLI errors in the CLI's language: the subcommand's usage and the nearest flag for a typo, no
abbreviations, no number taken as MODEL, flags named as typed, a missing chat template refused
before the weights load."""

from __future__ import annotations

import json
import shutil

import pytest

from pagedllm.entrypoints.cli import build_parser, main
from tests.entrypoints.test_cli import _no_model_load


def _parse_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv,usage,message", [
    (["generate", "hi", "--temprature", "0.5"], "usage: pagedllm generate",
     "unrecognized arguments: --temprature (did you mean --temperature?)"),
    (["chat", "--chat-templat", "t.jinja"], "usage: pagedllm chat",
     "unrecognized arguments: --chat-templat (did you mean --chat-template?)"),
    (["serve", "--prot", "8100"], "usage: pagedllm serve", "unrecognized arguments: --prot (did you mean --port?)"),
    (["plan", "--device-memroy=80GiB"], "usage: pagedllm plan",
     "unrecognized arguments: --device-memroy=80GiB (did you mean --device-memory?)"),
])
def test_a_mistyped_flag_gets_the_subcommands_usage_and_the_nearest_flag(argv, usage, message, capsys):
    err = _parse_error(argv, capsys)
    assert err.startswith(usage) and message in err


def test_abbreviations_are_refused(capsys):
    assert "unrecognized arguments: --max-token (did you mean --max-tokens?)" in \
        _parse_error(["generate", "hi", "--max-token", "5"], capsys)


def test_a_number_is_not_taken_as_model(capsys):
    assert "MODEL '8100' looks like a flag's value" in _parse_error(["serve", "8100"], capsys)


@pytest.mark.parametrize("argv,message", [
    (["plan", "--device-memory", "80XB"], "error: --device-memory must be a byte count"),
    (["generate", "hi", "--max-tokens", "0"], "error: --max-tokens must be >= 1, got 0"),
    (["generate", "hi", "--block-size", "7"], "error: --block-size must be a power of two"),
])
def test_errors_name_the_flag_not_the_python_keyword(argv, message, monkeypatch, capsys):
    _no_model_load(monkeypatch)
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", [["chat"], ["generate", "--chat", "hi"]])
def test_a_model_without_a_chat_template_is_refused_before_it_loads(command, tiny_model_dir, tmp_path, monkeypatch,
                                                                    capsys):
    folder = shutil.copytree(tiny_model_dir, tmp_path / "no_template")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    _no_model_load(monkeypatch)
    assert main([*command, "-m", str(folder)]) == 2
    assert "has no chat template; pass --chat-template FILE" in capsys.readouterr().err
