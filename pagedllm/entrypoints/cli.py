"""``pagedllm generate | chat | serve | plan``: the command line.

Engine flags are derived from EngineConfig and sampling flags from SamplingParams
(``pagedllm.entrypoints.args``), so they match ``LLM(**kwargs)`` and ``SamplingParams(**kwargs)``.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time

from pagedllm.config import DEFAULT_MODEL
from pagedllm.entrypoints.chat import FALLBACK_SAMPLING
from pagedllm.entrypoints.args import (
    add_engine_args, add_sampling_args, engine_config_from_args, sampling_params_from_args)


# `generate` samples greedily and at more length than the API's defaults; `chat` takes the
# model's own sampling defaults (a greedy small model repeats itself).
_SAMPLING_DEFAULTS = {"max_tokens": 256, "temperature": 0.0}


class CLIParser(argparse.ArgumentParser):
    """argparse without abbreviations (``--max-token`` is not ``--max-tokens``), whose unknown
    flags are reported by their subcommand with its usage and the nearest flag."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        parser = self.subcommands().get(getattr(namespace, "command", None), self)
        if extras:
            parser.error(unrecognized_message(parser, extras))
        model = getattr(namespace, "model", None)
        if isinstance(model, str) and model.isdigit() and not os.path.exists(model):
            parser.error(f"MODEL {model!r} looks like a flag's value: name a model, or give the flag before it")
        return namespace

    def subcommands(self) -> dict[str, argparse.ArgumentParser]:
        actions = [a for a in self._actions if isinstance(a, argparse._SubParsersAction)]
        return dict(actions[0].choices) if actions else {}


def unrecognized_message(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """``unrecognized arguments: --temprature (did you mean --temperature?)``."""
    import difflib

    flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    words = []
    for extra in extras:
        near = difflib.get_close_matches(extra.split("=", 1)[0], flags, n=1) if extra.startswith("--") else []
        words.append(f"{extra} (did you mean {near[0]}?)" if near else extra)
    return "unrecognized arguments: " + " ".join(words)


def in_flag_terms(message: str, parser: argparse.ArgumentParser) -> str:
    """``message`` with the Python names of ``parser``'s flags as the flags
    (``chat_template=`` -> ``--chat-template``), so an error raised under the CLI names what to type."""
    for action in parser._actions:
        flag = next((s for s in action.option_strings if s.startswith("--")), None)
        if flag and "_" in action.dest and flag[2:].replace("-", "_") == action.dest:
            message = re.sub(rf"(?<![\w-]){action.dest}\b=?", flag, message)
    return message


def build_parser() -> argparse.ArgumentParser:
    parser = CLIParser(prog="pagedllm", description="LLM inference with a paged KV cache")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (before the subcommand)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CLIParser)

    g = sub.add_parser("generate", help="complete one or more prompts and print the answers",
                       description="Complete one or more prompts (batched) and print the answers and tok/s.")
    g.add_argument("prompts", nargs="*", help="prompt text (several: one request each, batched)")
    g.add_argument("--prompts-file", default=None, help="file with one prompt per line (added to PROMPTS)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    g.add_argument("--system", default=None, help="system message (with --chat)")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template file (with --chat), for models without one or to override theirs")
    g.add_argument("-m", "--model", default=DEFAULT_MODEL, help="model alias, .gguf path or HF folder")
    add_sampling_args(g, **_SAMPLING_DEFAULTS)
    add_engine_args(g)

    c = sub.add_parser("chat", help="interactive chat that keeps the conversation and streams its answers",
                       description="An interactive conversation: answers stream, then prompt / cached / output "
                                   "tokens and tok/s. Ctrl-C stops an answer; Ctrl-C or Ctrl-D at the prompt quits.")
    c.add_argument("-m", "--model", default=DEFAULT_MODEL, help="model alias, .gguf path or HF folder")
    c.add_argument("--system", default=None, help="system message")
    c.add_argument("--chat-template", default=None, metavar="FILE", help="Jinja chat template file")
    add_sampling_args(c, max_tokens=_SAMPLING_DEFAULTS["max_tokens"], model_defaults=FALLBACK_SAMPLING)
    add_engine_args(c)

    from pagedllm.entrypoints.openai.api_server import add_server_args

    # MODEL + server + engine flags
    add_server_args(sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                                   description="An OpenAI-compatible HTTP server (docs/serving.md)."))
    _add_plan_args(sub.add_parser("plan", help="how many sequences fit, at what context, on which device"))
    return parser


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    from pagedllm.planner import GPUS, MODEL_SHAPES
    from pagedllm.sizing import DTYPE_BYTES, QUANTIZATION_BITS

    p.description = ("Plan the KV cache before starting the engine: weights, activations, KV blocks and "
                     "tokens, max concurrent sequences per context (paged vs a contiguous allocator), "
                     "whether it fits, suggested flags. Exit code 2 when it does not fit or the input is bad.")
    p.add_argument("-m", "--model", default=DEFAULT_MODEL,
                   help=f"alias, .gguf, HF folder, or a named shape: {', '.join(MODEL_SHAPES)}")
    g = p.add_argument_group("device")
    g.add_argument("--gpu", default=None, help=f"a named GPU: {', '.join(GPUS)}")
    g.add_argument("--device-memory", default=None, help="device memory in bytes or like '80GiB' (instead of --gpu)")
    add_engine_args(p)
    existing = {a.dest for a in p._actions}  # EngineConfig may grow these fields; never add a flag twice
    q = p.add_argument_group("planning")
    if "quantization" not in existing:
        q.add_argument("--quantization", default=None, choices=["none", *QUANTIZATION_BITS],
                       help="weight format of the linear layers (default: none = --dtype)")
    if "kv_cache_dtype" not in existing:
        q.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *DTYPE_BYTES],
                       help="K/V element type (default: auto = --dtype)")
    q.add_argument("--context-len", dest="context_lens", type=int, action="append", default=None,
                   help="table row for this context length in tokens (repeatable; default max_model_len/8../1)")
    q.add_argument("--json", action="store_true", help="print one JSON object (with a boolean 'fits')")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "chat":
            return _chat(args)
        if args.command == "plan":
            return _plan(args)
        from pagedllm.entrypoints.openai.api_server import run_server
        run_server(args)
        return 0
    except ValueError as e:
        print(f"error: {in_flag_terms(str(e), parser.subcommands()[args.command])}", file=sys.stderr)
        return 2


def _plan(args) -> int:
    """Print the plan; exit code 0 when it fits, 2 when it does not (bad input raises ValueError → 2)."""
    import json

    from pagedllm.planner import plan_from_config

    config = engine_config_from_args(args)
    result = plan_from_config(config, device_memory=args.device_memory, gpu=args.gpu,
                              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                              context_lens=args.context_lens)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.render())
    if not result.fits:
        print("error: does not fit: " + "; ".join(result.problems), file=sys.stderr)
        return 2
    return 0


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompts)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--prompts-file {args.prompts_file!r}: {getattr(e, 'strerror', None) or e}") from e
    if not prompts:
        raise ValueError("no prompt given: pass PROMPT arguments or --prompts-file")
    return prompts


def _generate(args) -> int:
    from pagedllm.llm import LLM

    # Every input is checked before the model loads (seconds to minutes): a typo fails at once.
    args.prompts = _read_prompts(args)
    config = engine_config_from_args(args)
    params = sampling_params_from_args(args)
    template = _read_chat_template(args.chat_template)
    if args.chat:
        _require_chat_template(config, template)
    llm = LLM(**vars(config))
    t0 = time.perf_counter()
    if args.chat:
        convs = [_conversation(args.system, p) for p in args.prompts]
        outputs = llm.chat(convs, params, use_tqdm=len(convs) > 1, chat_template=template)
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=len(args.prompts) > 1)
    elapsed = time.perf_counter() - t0
    num_tokens = 0
    for prompt, out in zip(args.prompts, outputs):
        for comp in out.outputs:
            num_tokens += len(comp.token_ids)
            if len(args.prompts) > 1 or len(out.outputs) > 1:
                print(f"--- prompt: {prompt!r} [sample {comp.index}, finish_reason={comp.finish_reason}]")
            print(comp.text)
            if comp.logprobs is not None:
                print(_logprob_table("logprobs", comp.token_ids, comp.logprobs, params.logprobs, llm.get_tokenizer()))
                print(f"  cumulative logprob {comp.cumulative_logprob:.4f}")
        if out.prompt_logprobs is not None:
            print(_logprob_table("prompt logprobs", out.prompt_token_ids, out.prompt_logprobs, params.prompt_logprobs,
                                 llm.get_tokenizer()))
    print(f"[{len(outputs)} requests, {num_tokens} tokens in {elapsed:.2f} s = {num_tokens / elapsed:.1f} tok/s]",
          file=sys.stderr)
    return 0


def _logprob_table(title: str, token_ids: list[int], positions: list, num_top: int, tokenizer) -> str:
    """``--logprobs`` / ``--prompt-logprobs`` for reading: one line per token with its position,
    text, log-probability (natural log) and rank, then the ``num_top`` most likely tokens
    (``positions``: a ``{token id: Logprob}`` per token, None where there is none, as for the
    first prompt token)."""
    from pagedllm.engine.detokenizer import token_text

    def text(token_id: int, logprob) -> str:
        return repr(logprob.decoded_token if logprob.decoded_token is not None else token_text(tokenizer, token_id))

    lines = [f"[{title}: position, token, logprob, rank | top {num_top}]"]
    for k, (token_id, entry) in enumerate(zip(token_ids, positions)):
        if not entry or token_id not in entry:
            lines.append(f"  {k:>4}  {token_text(tokenizer, token_id)!r:<20} {'-':>9}")
            continue
        chosen = entry[token_id]
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= num_top),
                     key=lambda item: item[1].rank)
        alternatives = "  ".join(f"{text(t, lp)} {lp.logprob:.4f}" for t, lp in top)
        lines.append(f"  {k:>4}  {text(token_id, chosen):<20} {chosen.logprob:9.4f} {chosen.rank or '-':>5} | "
                     f"{alternatives}")
    return "\n".join(lines)


def _read_chat_template(path: str | None) -> str | None:
    """The text of a ``--chat-template`` file (None without one). Raises ValueError naming the file."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"--chat-template {path!r}: {e.strerror or e}") from e


def _conversation(system: str | None, user: str) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": user}]


def _require_chat_template(config, template: str | None) -> None:
    """Refuse a model without a chat template before its weights load (``--chat-template`` gives one)."""
    if template is not None:
        return
    from pagedllm.loader.gguf import GGUFFile
    from pagedllm.loader.hf import read_chat_template
    from pagedllm.loader.resolve import resolve_model

    resolved = resolve_model(config.tokenizer or config.model)
    if resolved.format == "hf":
        found = read_chat_template(resolved.path)
    else:
        found = GGUFFile(resolved.path, string_arrays=()).metadata.get("tokenizer.chat_template")
    if not found:
        raise ValueError(f"model {config.model!r} has no chat template; pass --chat-template FILE")


def _chat(args) -> int:
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.chat import ChatSession, model_sampling_defaults, run_chat
    from pagedllm.loader.resolve import resolve_model

    config = engine_config_from_args(args)
    template = _read_chat_template(args.chat_template)
    _require_chat_template(config, template)
    resolved = resolve_model(config.model)
    params = sampling_params_from_args(args, model_sampling_defaults(str(resolved.path), resolved.format))
    engine = LLMEngine(config)
    return run_chat(ChatSession(engine, params, args.system, template))


if __name__ == "__main__":
    sys.exit(main())
