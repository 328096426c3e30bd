"""Built-in block-size and batch policies."""

from mtpflow import hookimpl


class FixedBlockPolicy:
    """Always verify ``draft.block_size`` tokens per row (drafts + 1)."""

    name = "fixed"

    def __init__(self, config):
        self.size = config.draft.block_size

    def block_size(self, stats) -> int:
        return self.size

    def observe(self, record) -> None:
        pass


class AdaptiveBlockPolicy:
    """Picks the block size with the best measured throughput.

    Every round is timed (draft + verify + host) and its emitted tokens
    counted; an exponential moving average of tokens per second is kept per
    block size, 1 (no drafting) to ``draft.max_block_size``.  Each size is
    tried ``warmup`` times first, then the best is used, with a neighbour
    re-measured every ``explore_every`` rounds so the choice follows changes
    (acceptance drifting with the text, the batch growing or shrinking).  When
    drafting does not pay -- a cheap target, a large batch -- block size 1 wins
    and the drafter stops running.
    """

    name = "adaptive"
    warmup = 2
    explore_every = 12
    alpha = 0.3

    def __init__(self, config):
        self.sizes = list(range(1, max(config.draft.max_block_size, config.draft.block_size) + 1))
        self.rate: dict[int, float] = {}
        self.seen: dict[int, int] = {}
        self.start = config.draft.block_size
        self.rounds = 0
        self._flip = 1

    def block_size(self, stats) -> int:
        order = [self.start] + [k for k in self.sizes if k != self.start]
        for k in order:
            if self.seen.get(k, 0) < self.warmup:
                return k
        self.rounds += 1
        best = max(self.rate, key=self.rate.get)
        if self.rounds % self.explore_every == 0:
            self._flip = -self._flip
            return min(max(best + self._flip, self.sizes[0]), self.sizes[-1])
        return best

    def observe(self, record) -> None:
        elapsed = record.draft_s + record.verify_s + record.host_s
        if elapsed <= 0:
            return
        k = record.block_size
        r = sum(record.emitted) / elapsed
        self.seen[k] = self.seen.get(k, 0) + 1
        self.rate[k] = r if k not in self.rate else (1 - self.alpha) * self.rate[k] + self.alpha * r


class StaticBatchPolicy:
    """Admit up to ``batch.max_batch_size`` requests at the start; nobody joins later."""

    name = "static"
    joins_between_rounds = False

    def __init__(self, config):
        self.capacity = config.batch.max_batch_size

    def admit(self, waiting: list, live: int, started: bool) -> list:
        if started:
            return []
        return waiting[: self.capacity]


class ContinuousBatchPolicy(StaticBatchPolicy):
    """Fill free rows between rounds (continuous batching)."""

    name = "continuous"
    joins_between_rounds = True

    def admit(self, waiting: list, live: int, started: bool) -> list:
        return waiting[: max(0, self.capacity - live)]


@hookimpl
def mtpflow_register_block_policies(register):
    register("fixed", FixedBlockPolicy)
    register("adaptive", AdaptiveBlockPolicy)


@hookimpl
def mtpflow_register_batch_policies(register):
    register("static", StaticBatchPolicy)
    register("continuous", ContinuousBatchPolicy)
