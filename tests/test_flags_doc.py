"""docs/flags.md's generated section is what the parsers, EngineConfig, SamplingParams and envs.ALL say."""

from __future__ import annotations

import dataclasses

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.entrypoints import flags_doc


def test_the_flag_page_is_up_to_date():
    text = flags_doc.PAGE.read_text(encoding="utf-8")
    assert flags_doc.updated_page(text) == text, "run: python -m pagedllm.entrypoints.flags_doc"
    assert flags_doc.main(["--check"]) == 0


def test_the_page_lists_every_field_flag_and_variable():
    text = flags_doc.PAGE.read_text(encoding="utf-8")
    for f in dataclasses.fields(EngineConfig):
        assert f"| `--{f.name.replace('_', '-')}` | `{f.name}` |" in text
    for flag in ("`--temperature` | `temperature`", "`--sampling-seed` | `seed`", "`--port`", "`--prompts-file`",
                 "`--device-memory`", "`--system`", "`--log-level`"):
        assert flag in text
    assert all(f"| `{v.name}` |" in text for v in envs.ALL)


def test_a_stale_page_is_found(tmp_path, monkeypatch):
    page = tmp_path / "flags.md"
    page.write_text(f"intro\n{flags_doc.BEGIN}\n| `--old-flag` | gone |\n{flags_doc.END}\n", encoding="utf-8")
    monkeypatch.setattr(flags_doc, "PAGE", page)
    assert flags_doc.main(["--check"]) == 1
    assert flags_doc.main([]) == 0 and flags_doc.main(["--check"]) == 0
    assert page.read_text().startswith("intro\n") and "--old-flag" not in page.read_text()


def test_config_and_sampling_help_is_one_or_two_lines():
    """The rationale lives in docs/; a help string is at most two lines of --help (~200 characters)."""
    from pagedllm.sampling_params import SamplingParams

    for cls in (EngineConfig, SamplingParams):
        for f in dataclasses.fields(cls):
            assert len(f.metadata.get("help", "")) <= 200, f.name
            assert "result " not in f.metadata.get("help", ""), f.name
