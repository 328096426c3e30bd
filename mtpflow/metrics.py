"""Acceptance metrics, as vLLM's ``SpecDecodingStats``."""

from __future__ import annotations

from attrs import define, field


@define
class SpecDecodingStats:
    """Counters over all rows and rounds of a session.

    * ``drafts``: (row, round) pairs in which drafts were proposed;
    * ``draft_tokens`` / ``accepted_tokens``: proposed and accepted drafts;
    * ``accepted_per_position[i]``: drafts accepted at block position ``i``;
    * ``row_rounds`` / ``emitted_tokens``: for τ, tokens emitted per row-round
      (bonus token included; cut by EOS / ``max_tokens``).
    """

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(factory=list)
    rounds: int = 0
    row_rounds: int = 0
    emitted_tokens: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    host_s: float = 0.0
    syncs: int = 0

    def observe(self, record) -> None:
        self.rounds += 1
        self.row_rounds += record.batch_size
        self.emitted_tokens += sum(record.emitted)
        self.draft_s += record.draft_s
        self.verify_s += record.verify_s
        self.host_s += record.host_s
        self.syncs += record.syncs
        if record.drafted > 0:
            self.drafts += record.batch_size
            self.draft_tokens += record.drafted * record.batch_size
            self.accepted_tokens += sum(record.accepted)
            if len(self.accepted_per_position) < record.drafted:
                self.accepted_per_position += [0] * (record.drafted - len(self.accepted_per_position))
            for n in record.accepted:
                for i in range(n):
                    self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """vLLM's definition: 1 + accepted / drafts."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def tau(self) -> float:
        """Mean tokens emitted per row per round (bonus included)."""
        return self.emitted_tokens / self.row_rounds if self.row_rounds else 0.0

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "tau": round(self.tau, 4),
            "emitted_tokens": self.emitted_tokens,
            "draft_s": round(self.draft_s, 6),
            "verify_s": round(self.verify_s, 6),
            "host_s": round(self.host_s, 6),
            "syncs_per_round": round(self.syncs / self.rounds, 3) if self.rounds else 0.0,
        }
