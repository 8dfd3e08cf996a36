"""Speculative-decoding statistics carried by every response."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    rounds: int = 0          # target decodes of a draft tree
    drafted: int = 0         # draft tokens sent to verification (tree nodes below the root)
    accepted: int = 0        # draft tokens the target accepted
    emitted: int = 0         # tokens produced by the rounds (accepted + one bonus each)
    accepted_at_depth: list[int] = field(default_factory=list)  # [d]: accepted tokens at tree depth d+1
    drafted_at_depth: list[int] = field(default_factory=list)   # [d]: rounds whose tree reached depth d+1
    drafting_rounds: int = 0  # rounds that verified drafted tokens (the others verified the root alone)
    draft_decodes: int = 0    # decodes of the draft head
    prompt_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0

    def add_round(self, tree_depth: int, n_drafted: int, n_accepted: int, n_draft_decodes: int = 0,
                  draft_s: float = 0.0, verify_s: float = 0.0) -> None:
        self.rounds += 1
        self.drafting_rounds += n_drafted > 0
        self.draft_decodes += n_draft_decodes
        self.draft_s += draft_s
        self.verify_s += verify_s
        self.drafted += n_drafted
        self.accepted += n_accepted
        self.emitted += n_accepted + 1
        while len(self.drafted_at_depth) < tree_depth:
            self.drafted_at_depth.append(0)
            self.accepted_at_depth.append(0)
        for d in range(tree_depth):
            self.drafted_at_depth[d] += 1
        for d in range(n_accepted):
            self.accepted_at_depth[d] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per target decode of a tree (1.0 = no speculation gain)."""
        return self.emitted / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "drafting_rounds": self.drafting_rounds,
            "draft_decodes": self.draft_decodes,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "acceptance_rate_at_depth": [round(a / n, 4) if n else 0.0
                                         for a, n in zip(self.accepted_at_depth, self.drafted_at_depth)],
            "prompt_ms": round(self.prompt_s * 1e3, 3),
            "draft_ms": round(self.draft_s * 1e3, 3),
            "verify_ms": round(self.verify_s * 1e3, 3),
        }
