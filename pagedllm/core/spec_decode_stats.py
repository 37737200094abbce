"""Speculative decoding's counters (vLLM's ``spec_decode_*`` metrics): drafts, draft tokens,
accepted tokens, and accepted tokens per draft position (position 0 first)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Totals since the engine started; ``observe`` adds one verified draft."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """A draft of ``num_draft_tokens`` whose first ``num_accepted_tokens`` were accepted."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(f"num_accepted_tokens ({num_accepted_tokens}) must be in [0, "
                             f"num_draft_tokens ({num_draft_tokens})]")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for pos in range(num_accepted_tokens):
            per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step: 1 (the target's own) + accepted drafts, averaged (vLLM's figure)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
