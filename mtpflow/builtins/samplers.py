"""Built-in acceptance samplers.

``greedy``: a draft is accepted while it equals the target's argmax.
``rejection``: lossless speculative sampling (Leviathan et al. 2023) on the
target distribution processed by the request's temperature / top-k / top-p /
min-p / penalties -- see :mod:`mtpflow.sampling`.
"""

from mtpflow import hookimpl


class _Processors:
    """Applies the configured logits-processor plugins (resolved once)."""

    def __init__(self, config=None, processors=()):
        from mtpflow.processors import with_drafts

        self.config = config
        self.processors = [with_drafts(p) for p in processors]
        self.rows = []
        self.tokenizer = None
        self.eos_ids = ()
        self._grammar = None

    def bind_session(self, session) -> None:
        """The session's tokenizer and EOS ids (grammar-constrained rows need them)."""
        self.tokenizer = session.tokenizer
        self.eos_ids = tuple(session.target.eos_ids)

    def _pre(self, logits, rows, drafts=None):
        for proc in self.processors:
            logits = proc(logits, rows, drafts=drafts)
        if any(r.request.sampling.grammar is not None for r in rows):
            logits = self._constrain(logits, rows, drafts)
        return logits

    def _constrain(self, logits, rows, drafts):
        """Grammar masks at every verified position (:mod:`mtpflow.structured`)."""
        import mlx.core as mx

        from mtpflow.structured import GrammarMasks

        if self.tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer; this session has none")
        if self._grammar is None:
            self._grammar = GrammarMasks(self.tokenizer, logits.shape[-1], self.eos_ids)
        self._grammar.forget(rows)
        squeeze = logits.ndim == 2
        L = 1 if squeeze else logits.shape[1]
        host = drafts.tolist() if drafts is not None and L > 1 else [[] for _ in rows]  # the drafts' extra sync
        allowed = self._grammar.masks(rows, host, L)
        if squeeze:
            allowed = allowed[:, 0]
        return mx.where(allowed, logits, -mx.inf)

    def _constrained(self, rows) -> bool:
        return any(r.request.sampling.grammar is not None for r in rows)


class GreedySampler(_Processors):
    """Argmax verification; output equals target-only greedy decoding."""

    name = "greedy"

    def prepare(self, rows, vocab_size: int) -> None:
        """Called when the batch composition changes."""
        self.rows = list(rows)

    def first(self, logits, state):
        from mtpflow.sampling import greedy_tokens

        rows = self.rows if state is None else state.rows
        return greedy_tokens(self._pre(logits, rows))

    def supports_trees(self, state) -> bool:
        return not self.processors and not self._constrained(state.rows)  # they read the drafts as a chain

    def lookahead_safe(self, state) -> bool:
        """Whether the next null round can be built before this round's tokens
        reach the host: nothing here reads them (processors and grammars do)."""
        return not self.processors and not self._constrained(state.rows)

    def accept(self, logits, draft, state):
        from mtpflow.sampling import greedy_accept, greedy_tokens
        from mtpflow.state import AcceptResult

        if draft.is_tree:
            return _tree_result(state, draft, greedy_tokens(logits))
        counts, tokens = greedy_accept(self._pre(logits, state.rows, draft.tokens), draft.tokens, draft.active)
        return AcceptResult(counts=counts, tokens=tokens)


def _tree_result(state, draft, samples):
    """Walk a verified tree given the target's token at every node (see
    :func:`mtpflow.sampling.tree_accept`)."""
    import mlx.core as mx

    from mtpflow.builtins.stages import tree_inputs
    from mtpflow.sampling import tree_accept
    from mtpflow.state import AcceptResult

    parents, depth, visible = tree_inputs(state, draft)
    inputs = mx.concatenate([state.last_tokens[:, None], draft.tokens.astype(mx.int32)], axis=1)
    counts, tokens, path = tree_accept(samples, inputs, parents, depth, visible, draft.max_depth, draft.active)
    return AcceptResult(counts=counts, tokens=tokens, path=path)


class RejectionSampler(_Processors):
    """Lossless speculative sampling on the processed target distribution.

    Every row has its own PRNG key (from its request's ``seed``).  Drafts
    chosen by argmax (``DraftBlock.probs is None``: every built-in drafter)
    are verified by position-keyed Gumbel coupling
    (:func:`mtpflow.sampling.coupled_accept`): the token at each position is
    drawn with noise keyed by (seed, position), so a seeded row's output is
    exactly its target-only sampled output -- whatever the batch, its
    neighbours, the block size or the round.  Sampled drafts (with ``probs``)
    go through rejection sampling (:func:`mtpflow.sampling.rejection_accept`).
    """

    name = "rejection"

    def __init__(self, config=None, processors=()):
        super().__init__(config, processors)
        self.params = None

    def prepare(self, rows, vocab_size: int) -> None:
        from mtpflow.sampling import ProcessParams, row_keys

        self.rows = list(rows)
        self.params = ProcessParams.from_rows([self.sampling_of(r) for r in rows], vocab_size)
        fresh = [r for r in rows if r.rng is None]  # each row carries its own PRNG key
        if fresh:
            import secrets

            # unseeded rows draw from fresh entropy; seeded rows only from their seed
            seeds = [r.request.sampling.seed if r.request.sampling.seed is not None else secrets.randbits(62) for r in fresh]
            keys = row_keys(seeds)
            for i, r in enumerate(fresh):
                r.rng = keys[i]

    def supports_trees(self, state) -> bool:
        """Trees need processing that does not read the drafts' history
        (configured processors and repetition penalties see a chain)."""
        self._sync(state.rows)
        return not self.processors and not self.params.reads_context and not self._constrained(state.rows)

    def lookahead_safe(self, state) -> bool:
        """As :meth:`supports_trees`: noise keyed by position needs no host
        state, penalties and processors read the tokens."""
        return self.supports_trees(state)

    def sampling_of(self, row):
        """The :class:`~mtpflow.state.SamplingParams` a row is sampled with
        (its request's; a subclass may override them)."""
        return row.request.sampling

    def _keys(self, rows):
        """The rows' own keys ``[B, 2]`` (they never advance: noise is keyed by position)."""
        import mlx.core as mx

        return mx.stack([r.rng for r in rows])

    def _round_keys(self, rows):
        """This round's key per row; each row's stored key advances."""
        import mlx.core as mx

        from mtpflow.sampling import split_keys

        keys = mx.stack([r.rng for r in rows])
        use, keep = split_keys(keys, 2)
        for i, r in enumerate(rows):
            r.rng = keep[i]
        return use

    def _sync(self, rows) -> None:
        """Rebuild the per-row parameters when rows left or joined."""
        if len(rows) != len(self.rows) or any(a is not b for a, b in zip(rows, self.rows)):
            self.prepare(rows, self.params.vocab_size)

    def _context(self, rows):
        """``(context, completion_start)`` of the rows for the penalties (see
        :func:`mtpflow.sampling.process_logits`), or ``(None, None)``."""
        import mlx.core as mx

        if not self.params.reads_context:
            return None, None
        ctx = [list(r.request.prompt) + list(r.generated) for r in rows]
        T = max(len(c) for c in ctx)
        from mtpflow.state import completion_start

        starts = mx.array([completion_start(r.request) for r in rows], dtype=mx.int32) if self.params.use_penalties else None
        return mx.array([c + [-1] * (T - len(c)) for c in ctx], dtype=mx.int32), starts

    def first(self, logits, state):
        import mlx.core as mx

        from mtpflow.sampling import coupled_sample, process_logits

        rows = self.rows if state is None else state.rows
        self._sync(rows)
        logits = self._pre(logits, rows)
        if self.params.all_greedy and not self.params.reads_context:
            from mtpflow.sampling import greedy_tokens

            return greedy_tokens(logits)  # no randomness needed
        context, starts = self._context(rows)
        lp = process_logits(logits, self.params, context, completion_start=starts)
        # the first generated token sits right after the prompt
        positions = mx.array([len(r.request.prompt) for r in rows], dtype=mx.int32)
        return coupled_sample(lp, self._keys(rows), positions)

    def accept(self, logits, draft, state):
        import mlx.core as mx

        from mtpflow.sampling import coupled_accept, coupled_sample, greedy_accept, process_logits, rejection_accept
        from mtpflow.state import AcceptResult

        self._sync(state.rows)
        if draft.is_tree:
            lp = process_logits(logits, self.params)  # greedy rows: one-hot at the (biased) argmax
            if self.params.all_greedy:
                samples = mx.argmax(lp, axis=-1).astype(mx.int32)
            else:  # every node's token: the coupled sample at its own position (root + depth + 1)
                from mtpflow.builtins.stages import tree_inputs

                _, depth, _ = tree_inputs(state, draft)
                samples = coupled_sample(lp, self._keys(state.rows), state.positions[:, None] + depth + 1)
            return _tree_result(state, draft, samples)
        logits = self._pre(logits, state.rows, draft.tokens)
        if self.params.all_greedy and not self.params.reads_context:
            # greedy rows need no randomness and no vocab-sized one-hots
            counts, tokens = greedy_accept(logits, draft.tokens, draft.active)
        else:
            context, starts = self._context(state.rows)
            lp = process_logits(logits, self.params, context, appended=draft.tokens, completion_start=starts)
            if draft.probs is None:
                positions = state.positions[:, None] + 1 + mx.arange(draft.n_draft + 1, dtype=mx.int32)[None]
                counts, tokens = coupled_accept(lp, draft.tokens, self._keys(state.rows), positions, draft.active)
            else:
                counts, tokens = rejection_accept(lp, draft.tokens, draft.probs, self._round_keys(state.rows), draft.active)
        return AcceptResult(counts=counts, tokens=tokens)


@hookimpl
def mtpflow_register_samplers(register):
    register("greedy", GreedySampler)
    register("rejection", RejectionSampler)
