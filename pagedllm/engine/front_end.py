"""The server's tokenizer work (prompts, chat templates) on a thread of its own.

A long prompt or chat template on the engine thread would stall every running stream. One
worker thread: a tokenizer never encodes on two threads at once; the engine thread only decodes.
"""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from pagedllm.engine.input_processor import InputProcessor, PromptType

__all__ = ["FrontEnd", "FrontEndThread", "needs_tokenizing", "tokenize_inputs"]


class FrontEnd:
    """Tokenizer work with the engine's checks (``input_processor``'s read-only state), callable
    from any one thread."""

    def __init__(self, input_processor: InputProcessor) -> None:
        self.input_processor = input_processor
        self.tokenizer = input_processor.tokenizer

    def tokenize_prompt(self, prompt: PromptType, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt (:meth:`InputProcessor.tokenize`). Raises ValueError."""
        return self.input_processor.tokenize(prompt, add_special_tokens)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, continue_final_message: bool = False,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        """Prompt token ids of a conversation, the template receiving ``tools``. Raises ValueError."""
        return self.input_processor.render_chat(conversation, add_generation_prompt, chat_template,
                                                continue_final_message, tools, template_kwargs)


class FrontEndThread:
    """Runs ``fn(front)`` on one worker thread and awaits it from the event loop."""

    def __init__(self, front: Any) -> None:
        self.front = front
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-frontend")

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(front)``'s result or exception; a cancelled await leaves ``fn`` to finish, result dropped."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, self.front)

    def shutdown(self) -> None:
        """Take no more work (queued calls still run); idempotent."""
        self._executor.shutdown(wait=False)


def needs_tokenizing(prompt: PromptType) -> bool:
    """Whether ``prompt`` is text (a string, or ``{"prompt": str}`` without token ids)."""
    if isinstance(prompt, dict):
        return "prompt_token_ids" not in prompt and isinstance(prompt.get("prompt"), str)
    return isinstance(prompt, str)


def tokenize_inputs(front: Any, inputs: list) -> list:
    """Each EngineInput as ``{"prompt_token_ids": ids}`` with the text the engine would report.
    Raises ValueError (``prompt[i]:`` for i > 0) as the engine would."""
    out = []
    for i, item in enumerate(inputs):
        try:
            ids = front.tokenize_prompt(item.prompt)
        except ValueError as e:
            raise ValueError(f"prompt[{i}]: {e}" if i else str(e)) from None
        text = item.prompt if item.prompt_text is None and isinstance(item.prompt, str) else item.prompt_text
        out.append(dataclasses.replace(item, prompt={"prompt_token_ids": ids}, prompt_text=text))
    return out
