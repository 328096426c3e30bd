"""Acceptance metrics, as vLLM's ``SpecDecodingStats``, and the one definition of τ.

**τ** (tau) is the mean number of tokens a row gets per target forward in
decoding rounds, bonus token included: each round verifies ``[last, drafts]``
in one forward and yields the accepted drafts plus one recovered or bonus
token, so ``τ = (accepted + 1)`` averaged over row-rounds, i.e. ≥ 1 whenever a
round ran (block size 1: exactly 1).  A stop token counts (the forward
produced it; it is not emitted); a row cut by ``max_tokens`` counts what it
emitted.  The prefill token is not a round.  CLI, JSON, server usage, bench
and eval all use :func:`tau`.

The **acceptance rate** is accepted drafts / proposed drafts and is ``None``
(absent, not 0) when nothing was drafted.
"""

from __future__ import annotations

from attrs import define, field


def tau(produced_tokens: int, row_rounds: int) -> float | None:
    """Tokens per row per target forward (``None`` when no round ran)."""
    return produced_tokens / row_rounds if row_rounds else None


def acceptance_rate(accepted_tokens: int, draft_tokens: int) -> float | None:
    """Accepted / proposed drafts (``None`` when nothing was drafted)."""
    return accepted_tokens / draft_tokens if draft_tokens else None


def _round(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


@define
class SpecDecodingStats:
    """Counters over all rows and rounds of a session.

    * ``drafts``: (row, round) pairs in which drafts were proposed;
    * ``draft_tokens`` / ``accepted_tokens``: proposed and accepted drafts;
    * ``accepted_per_position[i]``: drafts accepted at block position ``i``;
    * ``row_rounds`` / ``produced_tokens``: for τ (see :func:`tau`);
      ``emitted_tokens``: what the rows received (cut at EOS / ``max_tokens``);
    * ``block_sizes``: rounds run at each block size (what the policy chose).
    """

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(factory=list)
    rounds: int = 0
    row_rounds: int = 0
    emitted_tokens: int = 0
    produced_tokens: int = 0
    block_sizes: dict[int, int] = field(factory=dict)
    #: rounds that verified a draft tree, per tree shape
    trees: dict[str, int] = field(factory=dict)
    draft_s: float = 0.0
    verify_s: float = 0.0
    host_s: float = 0.0
    syncs: int = 0
    overlapped: int = 0

    def observe(self, record) -> None:
        self.rounds += 1
        self.overlapped += record.overlapped
        self.row_rounds += record.batch_size
        self.emitted_tokens += sum(record.emitted)
        self.produced_tokens += sum(record.produced_tokens)
        self.block_sizes[record.block_size] = self.block_sizes.get(record.block_size, 0) + 1
        if getattr(record, "tree", None) is not None:
            self.trees[record.tree] = self.trees.get(record.tree, 0) + 1
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
    def acceptance_rate(self) -> float | None:
        return acceptance_rate(self.accepted_tokens, self.draft_tokens)

    @property
    def mean_acceptance_length(self) -> float | None:
        """vLLM's definition: 1 + accepted / drafts (``None`` without drafts)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else None

    @property
    def tau(self) -> float | None:
        return tau(self.produced_tokens, self.row_rounds)

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate": _round(self.acceptance_rate),
            "mean_acceptance_length": _round(self.mean_acceptance_length),
            "tau": _round(self.tau),
            "emitted_tokens": self.emitted_tokens,
            "produced_tokens": self.produced_tokens,
            "block_sizes": {str(k): v for k, v in sorted(self.block_sizes.items())},
            "tree_rounds": dict(self.trees),
            "draft_s": round(self.draft_s, 6),
            "verify_s": round(self.verify_s, 6),
            "host_s": round(self.host_s, 6),
            "syncs_per_round": round(self.syncs / self.rounds, 3) if self.rounds else 0.0,
            "overlapped_rounds": self.overlapped,
        }


def format_stats(tokens: int, stats: dict, policy: str | None = None) -> str:
    """The CLI's one-line summary of ``tokens`` generated: every number with the same formatting,
    acceptance ``-`` when nothing was drafted, what ran (drafter kind, head,
    sampler, block policy, batch policy, as far as ``stats`` names them), the
    block sizes it ran (``size×rounds``), the dtype and, with ``--draft-tree``,
    the rounds that verified a tree (``shape×rounds``)."""

    def num(x, nd=2):
        return "-" if x is None else f"{x:.{nd}f}"

    blocks = " ".join(f"{k}×{v}" for k, v in stats.get("block_sizes", {}).items()) or "-"
    parts = [
        f"{tokens} tokens",
        f"{num(stats.get('tokens_per_s'))} tok/s",
        f"tau {num(stats.get('tau'))}",
        f"acceptance {num(stats.get('acceptance_rate'))}",
    ]
    drafter = stats.get("drafter") or stats.get("draft_kind")
    if drafter:
        parts.append(f"drafter {drafter}")
    for key in ("head", "sampler"):
        if stats.get(key):
            parts.append(f"{key} {stats[key]}")
    if policy:
        parts.append(f"policy {policy}")
    if stats.get("batch_policy"):
        parts.append(f"batch {stats['batch_policy']}")
    parts.append(f"blocks {blocks}")
    if stats.get("dtype"):
        parts.append(str(stats["dtype"]))
    trees = stats.get("tree_rounds") or {}
    if trees or stats.get("draft_tree") not in (None, "off"):
        parts.append(f"tree {stats.get('draft_tree')}: " + (" ".join(f"{k}×{v}" for k, v in trees.items()) or "no round"))
    return "[" + ", ".join(parts) + "]"
