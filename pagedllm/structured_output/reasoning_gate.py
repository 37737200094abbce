"""Where a constrained output's grammar starts when it follows the reasoning (vLLM's
``enable_in_reasoning: false``): after the end tag of the reasoning block. Pure Python.

    output:  [<think>] r r r ... r </think> a a a        (<think> optional, see ReasoningBoundary)
              forced   free (no bitmask)    grammar starts here: grammar_start
"""

from __future__ import annotations

from pagedllm.sampling_params import ReasoningBoundary


class ReasoningGate:
    """One request's boundary search over its output. ``grammar_start(output)`` is the output
    index where the grammar begins, or None while the output is (or may still become) reasoning;
    the scan resumes where it stopped, so each call costs the new tokens only."""

    def __init__(self, boundary: ReasoningBoundary) -> None:
        self.boundary = boundary
        self._scanned = 0  # output tokens already searched for the end tag

    def grammar_start(self, output: list[int]) -> int | None:
        start, end = self.boundary.start_token_ids, self.boundary.end_token_ids
        body = 0
        if start:
            if output and output[0] != start[0]:
                return 0  # no block opened: the whole output is the answer
            if len(output) < len(start):
                return None
            body = len(start)
        self._scanned = max(self._scanned, body)
        for i in range(max(body, self._scanned - len(end) + 1), len(output) - len(end) + 1):
            if tuple(output[i:i + len(end)]) == end:
                return i + len(end)
        self._scanned = len(output)
        return None

    def allowed_tokens(self, output: list[int]) -> tuple[list[int], bool]:
        """Before the grammar starts: ``(tokens, with_grammar)`` for the next position. At the
        output's start the tag's first token beside the grammar's (``with_grammar``); inside a begun
        tag its next token alone; inside the block nothing (``[]``, False: sampling is free)."""
        start = self.boundary.start_token_ids
        if not start:
            return [], False
        if not output:
            return [start[0]], True
        if len(output) < len(start):
            return [start[len(output)]], False
        return [], False

    def reset(self) -> None:
        """Forget the scan (the output was rolled back before the end tag)."""
        self._scanned = 0
