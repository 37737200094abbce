"""Prompt processing shared by ``LLM`` and the server: tokenize prompts and chats, and check a prompt
and its SamplingParams against the model (vocabulary, ``max_model_len``, ``max_logprobs``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Union

import jinja2

from pagedllm.engine.chat import normalize_conversation
from pagedllm.engine.render_deadline import DeadlineExceeded, call_with_deadline
from pagedllm.errors import ContextLengthError
from pagedllm.engine.special_text import encode_rendered, mask_special_texts, special_texts
from pagedllm.sampling_params import SamplingParams

PromptType = Union[str, list[int], dict]


@dataclass
class ProcessedPrompt:
    """A checked prompt: its token ids (after ``truncate_prompt_tokens``), its resolved
    ``max_tokens``, the params to run with, and whether tokens were cut from its start."""

    token_ids: list[int]
    max_tokens: int
    params: SamplingParams
    is_truncated: bool = False


class InputProcessor:
    """Turns user prompts into checked token ids. Not thread-safe (the tokenizer is not).
    ``extra_stop_token_ids``: end-of-turn ids beyond EOS (from the generation config)."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, max_logprobs: int,
                 extra_stop_token_ids: list[int], chat_template_timeout_s: float = 10.0) -> None:
        self.tokenizer = tokenizer
        self.chat_template_timeout_s = chat_template_timeout_s  # a render past it fails its request
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.extra_stop_token_ids = extra_stop_token_ids
        self._special_texts = special_texts(tokenizer)  # typed in a message, they stay text

    def tokenize(self, prompt: PromptType, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text, a token-id list, ``{"prompt_token_ids": [...]}`` or ``{"prompt": str}``.
        Raises ValueError for an empty prompt, a wrong type, or a token id outside the vocabulary."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise ValueError(f"prompt must be a string, a list of token ids, or a dict; got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt must not be empty (it has 0 tokens)")
        bad = [t for t in ids if t < 0 or t >= self.vocab_size]
        if bad:
            raise ValueError(f"prompt contains token id {bad[0]}, outside the vocabulary (size {self.vocab_size})")
        return ids

    def render_chat(self, conversation: list[dict], add_generation_prompt: bool = True,
                    chat_template: str | None = None, continue_final_message: bool = False,
                    tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        """Render a conversation with the chat template (``tools``, ``template_kwargs`` given) and tokenize it without
        added special tokens (the template has them). Raises ValueError for an empty conversation,
        an unknown role, non-text content, no template, or a failed render: naming ``chat_template``
        for one passed in, else ``messages`` (vLLM answers 400 for either)."""
        messages, replaced = mask_special_texts(normalize_conversation(conversation), self._special_texts)
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError("this model has no chat template; pass chat_template= or use a plain prompt")
        if continue_final_message and messages[-1]["role"] != "assistant":
            raise ValueError("continue_final_message needs the last message to have role 'assistant'")
        try:
            text = call_with_deadline(lambda: self.tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=False, chat_template=template,
                continue_final_message=continue_final_message,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                **(template_kwargs or {})), self.chat_template_timeout_s)
        except DeadlineExceeded:
            raise ValueError(f"chat_template: rendering the conversation took longer than "
                             f"{self.chat_template_timeout_s:g} s (chat_template_timeout_s)") from None
        except (jinja2.TemplateError, TypeError) as e:
            where = ("chat_template could not render the conversation" if chat_template
                     else "messages: the model's chat template refused the conversation")
            raise ValueError(f"{where}: {e}") from e
        return encode_rendered(self.tokenizer.encode, text, replaced)

    def process(self, prompt: PromptType, params: SamplingParams) -> ProcessedPrompt:
        """Tokenize and check ``prompt`` with ``params``; the params returned carry the tokenized
        ``bad_words`` and extra stop ids. Raises ValueError naming what is wrong."""
        full = self.tokenize(prompt)
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:  # vLLM's prompt-level salt
            params = replace(params, cache_salt=prompt["cache_salt"])
        params.validate_for_model(self.vocab_size, self.max_logprobs)
        ids = self._truncate(full, params)
        max_tokens = self._resolve_max_tokens(len(ids), params)
        if params.bad_words and not params.bad_words_token_ids:
            params.bad_words_token_ids = self._bad_words_ids(params.bad_words)
        return ProcessedPrompt(ids, max_tokens, self._with_extra_stop_ids(params), len(ids) < len(full))

    def _truncate(self, ids: list[int], params: SamplingParams) -> list[int]:
        """The last ``truncate_prompt_tokens`` of ``ids`` (left, as vLLM: the next token depends most
        on the end); -1: as many as fit beside ``max_tokens``. ValueError past ``max_model_len``."""
        keep = params.truncate_prompt_tokens
        if keep is None:
            return ids
        if keep > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens ({keep}) must be <= max_model_len ({self.max_model_len})")
        if keep == -1:
            keep = max(1, self.max_model_len - (params.max_tokens or 1))
        return ids[-keep:]

    def _resolve_max_tokens(self, num_prompt: int, params: SamplingParams) -> int:
        """max_tokens (None: what is left of ``max_model_len``); ContextLengthError past it."""
        limit = self.max_model_len
        if num_prompt >= limit:
            raise ContextLengthError(f"This model's maximum context length is {limit} tokens, but the prompt has "
                             f"{num_prompt} tokens (at least one token must be left for the output)")
        if params.max_tokens is None:
            return limit - num_prompt
        if num_prompt + params.max_tokens > limit:
            raise ContextLengthError(f"This model's maximum context length is {limit} tokens. However, you requested "
                             f"{num_prompt + params.max_tokens} tokens ({num_prompt} in the prompt, "
                             f"{params.max_tokens} for the completion). Please reduce the prompt or max_tokens.")
        return params.max_tokens

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, with and without a leading space (as vLLM does)."""
        out = []
        for w in words:
            for variant in {w, " " + w.lstrip()}:
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def _with_extra_stop_ids(self, params: SamplingParams) -> SamplingParams:
        """Add the model's extra EOS ids (generation config) to stop_token_ids unless ignore_eos."""
        if params.ignore_eos or not self.extra_stop_token_ids:
            return params
        missing = [t for t in self.extra_stop_token_ids if t not in params.stop_token_ids]
        if not missing:
            return params
        params = params.clone()
        params.stop_token_ids = params.stop_token_ids + missing
        return params
