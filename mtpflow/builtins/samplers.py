"""Built-in acceptance samplers.

``greedy``: a draft is accepted while it equals the target's argmax.
``rejection``: lossless speculative sampling (Leviathan et al. 2023) on the
target distribution processed by the request's temperature / top-k / top-p /
min-p / penalties -- see :mod:`mtpflow.sampling`.
"""

from mtpflow import hookimpl


class GreedySampler:
    """Argmax verification; output equals target-only greedy decoding."""

    name = "greedy"

    def __init__(self, config=None):
        self.config = config

    def prepare(self, rows) -> None:
        """Called when the batch composition changes."""

    def first(self, logits, state):
        import mlx.core as mx

        return mx.argmax(logits, axis=-1).astype(mx.int32)

    def accept(self, logits, draft, state):
        from mtpflow.sampling import greedy_accept
        from mtpflow.state import AcceptResult

        counts, tokens = greedy_accept(logits, draft.tokens)
        return AcceptResult(counts=counts, tokens=tokens)


@hookimpl
def mtpflow_register_samplers(register):
    register("greedy", GreedySampler)
