"""The generated part of ``docs/flags.md``: every flag of every subcommand and every environment variable.

``python -m pagedllm.entrypoints.flags_doc`` rewrites the text between the page's markers from
:class:`EngineConfig` / :class:`SamplingParams` metadata, the subcommands' parsers and
:data:`pagedllm.envs.ALL`; ``--check`` exits 1 when the page is out of date.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.entrypoints.args import SAMPLING_FLAG_NAMES
from pagedllm.entrypoints.cli import build_parser
from pagedllm.sampling_params import SamplingParams

PAGE = Path(__file__).resolve().parents[2] / "docs" / "flags.md"
BEGIN = "<!-- BEGIN GENERATED: python -m pagedllm.entrypoints.flags_doc (do not edit by hand) -->"
END = "<!-- END GENERATED -->"


def _cell(value) -> str:
    text = "—" if value is None or value == "" else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _table(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]


def _engine_rows() -> list[tuple]:
    return [(f"`{_flag(f.name)}`", f"`{f.name}`", f"`{f.default!r}`", f.metadata["help"])
            for f in dataclasses.fields(EngineConfig) if "help" in f.metadata]


def _sampling_rows(subcommands: dict) -> list[tuple]:
    defaults = {name: {a.dest: a.default for a in subcommands[name]._actions} for name in ("generate", "chat")}
    rows = []
    for f in dataclasses.fields(SamplingParams):
        if "help" not in f.metadata:
            continue
        dest = SAMPLING_FLAG_NAMES.get(f.name, f.name)
        chat = defaults["chat"][dest]
        rows.append((f"`{_flag(dest)}`", f"`{f.name}`", f"`{f.default!r}`", f"`{defaults['generate'][dest]!r}`",
                     "the model's" if chat is None and f.default is not None else f"`{chat!r}`", f.metadata["help"]))
    return rows


def _own_rows(parser: argparse.ArgumentParser) -> list[tuple]:
    shared = {f.name for f in dataclasses.fields(EngineConfig)}
    shared |= {SAMPLING_FLAG_NAMES.get(f.name, f.name) for f in dataclasses.fields(SamplingParams)}
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or (
                action.dest in shared and action.option_strings):
            continue
        names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest.upper()}` (positional)"
        default = None if action.default in (None, argparse.SUPPRESS) else f"`{action.default!r}`"
        rows.append((names, default, (action.help or "").replace("%%", "%")))
    return rows


def render() -> str:
    """The generated section of the page (between the markers, markers included)."""
    root = build_parser()
    subcommands = root.subcommands()
    lines = [BEGIN, "", "## Engine options", "",
             "Fields of `EngineConfig`: keywords of `LLM(...)` and flags of "
             f"{', '.join(f'`{n}`' for n in subcommands)}.", ""]
    lines += _table(("flag", "`LLM(...)` keyword", "default", "what it sets"), _engine_rows())
    lines += ["", "## Sampling options", "",
              "Fields of `SamplingParams`: flags of `generate` and `chat` (the server takes them in the request body).", ""]
    lines += _table(("flag", "field", "SamplingParams", "generate", "chat", "what it sets"), _sampling_rows(subcommands))
    for name, parser in {"": root, **subcommands}.items():
        lines += ["", f"## `pagedllm{' ' * bool(name)}{name}`", "", _cell(parser.description or ""), ""]
        lines += _table(("option", "default", "what it does"), _own_rows(parser))
    lines += ["", "## Environment variables", ""]
    lines += _table(("variable", "default", "values", "what it sets"),
                    [(f"`{v.name}`", f"`{v.default}`" if v.default else None,
                      ", ".join(f"`{c}`" for c in v.choices if c) if v.choices else "text", v.help) for v in envs.ALL])
    return "\n".join(lines + ["", END])


def updated_page(text: str) -> str:
    """``text`` (the page) with its generated section replaced by :func:`render`."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{PAGE}: the markers {BEGIN!r} and {END!r} are missing")
    return text[:start] + render() + text[end + len(END):]


def main(argv: list[str] | None = None) -> int:
    check = "--check" in (argv if argv is not None else sys.argv[1:])
    text = PAGE.read_text(encoding="utf-8")
    new = updated_page(text)
    if check:
        if new != text:
            print(f"{PAGE} is out of date: run python -m pagedllm.entrypoints.flags_doc", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
