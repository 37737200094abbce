"""Command-line flags derived from :class:`EngineConfig` and :class:`SamplingParams` fields
(never listed twice)."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from pagedllm.config import EngineConfig
from pagedllm.sampling_params import SamplingParams


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _argparse_text(text: str) -> str:
    """``text`` as an argparse help string: argparse %-formats help (``%(default)s``), so a
    literal ``%`` (``4% of max_model_len``) must be doubled or ``--help`` raises TypeError."""
    return text.replace("%", "%%")


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ("model",)) -> None:
    """Add one ``--flag`` per EngineConfig field (except ``skip``) to ``parser``."""
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine options")
    for f in dataclasses.fields(EngineConfig):
        if f.name in skip:
            continue
        help_text = f.metadata.get("help", "")
        if "default" not in help_text:  # fields whose default is resolved later say so themselves
            help_text += f" (default: {f.default})"
        help_text = _argparse_text(help_text)
        hint = hints[f.name]
        if hint is bool:
            group.add_argument(_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                               default=f.default, help=help_text)
        elif hint in (int, int | None):
            group.add_argument(_flag(f.name), dest=f.name, type=int, default=f.default, help=help_text)
        elif hint in (float, float | None):
            group.add_argument(_flag(f.name), dest=f.name, type=float, default=f.default, help=help_text)
        elif hint == list[str] | None:  # --lora-modules a=DIR1 b=DIR2
            group.add_argument(_flag(f.name), dest=f.name, type=str, nargs="+", default=f.default, help=help_text)
        else:
            group.add_argument(_flag(f.name), dest=f.name, type=str, default=f.default, help=help_text)


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """Build the EngineConfig from parsed flags (``overrides`` win). Raises ValueError."""
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    kwargs.update(overrides)
    return EngineConfig(**kwargs)


# Sampling flags whose name would clash with an engine flag get a prefix.
SAMPLING_FLAG_NAMES = {"seed": "sampling_seed"}


def add_sampling_args(parser: argparse.ArgumentParser, model_defaults: dict | None = None, **defaults) -> None:
    """Add one ``--flag`` per user-facing SamplingParams field with help text (``--seed`` is
    ``--sampling-seed``: the engine has its own). ``defaults`` override SamplingParams' defaults;
    the flags of ``model_defaults`` default to None, filled from the model by
    :func:`sampling_params_from_args` (``model_defaults`` holds the values without one)."""
    hints = typing.get_type_hints(SamplingParams)
    group = parser.add_argument_group("sampling options")
    model_defaults = model_defaults or {}
    for f in dataclasses.fields(SamplingParams):
        if "help" not in f.metadata:
            continue
        dest = SAMPLING_FLAG_NAMES.get(f.name, f.name)
        default = None if f.name in model_defaults else defaults.get(f.name, f.default)
        shown = (f"the model's generation_config.json, else {model_defaults[f.name]}" if f.name in model_defaults
                 else default)
        kw = dict(dest=dest, default=default, help=_argparse_text(f"{f.metadata['help']} (default: {shown})"))
        hint = hints[f.name]
        if hint is bool:
            group.add_argument(_flag(dest), action=argparse.BooleanOptionalAction, **kw)
        elif hint in (int, int | None):
            group.add_argument(_flag(dest), type=int, **kw)
        elif hint in (float, float | None):
            group.add_argument(_flag(dest), type=float, **kw)
        elif hint == list[int] | None:
            group.add_argument(_flag(dest), type=int, action="append", **kw)
        else:  # strings and lists of strings: repeatable
            group.add_argument(_flag(dest), type=str, action="append", **kw)


def sampling_params_from_args(args: argparse.Namespace, model_defaults: dict | None = None) -> SamplingParams:
    """Build SamplingParams from flags added by :func:`add_sampling_args`, a flag left at None
    taking its ``model_defaults`` value. Raises ValueError naming the field."""
    kwargs = {f.name: getattr(args, SAMPLING_FLAG_NAMES.get(f.name, f.name)) for f in dataclasses.fields(SamplingParams)
              if "help" in f.metadata}
    kwargs.update({k: v for k, v in (model_defaults or {}).items() if kwargs.get(k) is None})
    return SamplingParams(**kwargs)
