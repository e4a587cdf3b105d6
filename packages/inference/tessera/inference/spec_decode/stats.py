"""Speculative decoding's counts (vLLM's): drafts, draft tokens, accepted tokens, by position, and
the log line they make. Apart from the proposers so that the engine's metrics and the CLIs read
them without importing a model runner."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Cumulative counts, vLLM's: drafts (verification rows), draft tokens, accepted tokens, and
    accepted tokens by position in the draft (0-based)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.append(0)
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1


def format_spec_stats(num_drafts: int, num_draft_tokens: int, num_accepted: int, per_pos: list[int]) -> str:
    """One log line, vLLM's figures: acceptance rate, mean acceptance length (accepted + 1 per
    draft), acceptance rate by position."""
    rate = num_accepted / num_draft_tokens if num_draft_tokens else 0.0
    mean_len = 1 + num_accepted / num_drafts if num_drafts else 0.0
    positions = ", ".join(f"{a / num_drafts:.3f}" for a in per_pos) if num_drafts else "-"
    return (f"speculative decoding: acceptance rate {100 * rate:.1f}% ({num_accepted}/{num_draft_tokens} draft "
            f"tokens), mean acceptance length {mean_len:.2f}, per-position acceptance rate {positions}")
