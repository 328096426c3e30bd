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


@hookimpl
def mtpflow_register_batch_policies(register):
    register("static", StaticBatchPolicy)
    register("continuous", ContinuousBatchPolicy)
