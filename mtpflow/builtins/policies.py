"""Built-in block-size and batch policies."""

from collections import deque

from mtpflow import hookimpl


#: the shapes the adaptive policy measures with ``[draft] tree = "auto"``: 7, 11, 16, 16
#: and 45 tokens verified per round.  The 15-node tree sized to a 2-core CPU's 16-token
#: sweet spot (a 16-token verify costs less than an 11-14-token one with OpenBLAS,
#: docs/benchmarks.md, "Chains and trees") is ``dynamic:8:7:3:15``: 21 candidates drafted, the 15 most
#: probable verified (EAGLE-2's re-ranking), which accepted a little more per round than
#: the plain 15-node ``dynamic:8:5:3`` in one 16-prompt run (τ 1.87 against 1.84:
#: tentative), which had itself replaced ``4,2,1``; the same list serves every backend
AUTO_TREES = ("2,1,1", "2,2,1", "3,2,1", "dynamic:8:7:3:15", "4,2,2,1")


def configured_trees(config) -> list:
    from mtpflow.state import TreeShape

    t = config.draft.tree
    if t == "off":
        return []
    return [TreeShape.parse(x) for x in (AUTO_TREES if t == "auto" else (t,))]


class FixedBlockPolicy:
    """Always verify ``draft.block_size`` tokens per row (drafts + 1), or,
    with ``[draft] tree`` set to a shape, always that tree."""

    name = "fixed"

    def __init__(self, config):
        self.size = config.draft.size
        trees = configured_trees(config) if config.draft.tree != "auto" else []
        self.tree = trees[0] if trees else None

    def block_size(self, stats):
        return self.tree if self.tree is not None else self.size

    def peek(self, stats):
        """The next round's block size (no side effects)."""
        return self.block_size(stats)

    def observe(self, record) -> None:
        pass


class AdaptiveBlockPolicy:
    """Picks the block size that maximises predicted throughput.

    A small cost model, fitted online from the rounds themselves:

    * **acceptance**: for every draft position ``i``, how many row-rounds
      reached it (all drafts before it accepted) and how many accepted it;
      ``p_i = m = (accepted + 1) / (reached + 2)``, and for the first draft
      ``p_0 = m + sqrt(m (1 - m) / (reached + 2))`` (optimistic by one
      standard error, shrinking as rounds accumulate, so drafting at all is
      tried again); a position never reached yet takes the estimate of the
      one before it.  Expected tokens per row
      for block size ``k``: ``E(k) = 1 + sum_{j<k-1} prod_{i<=j} p_i``;
    * **cost**: seconds of a whole round (drafting, verify, host) for each
      block size measured, the least of its last ``cost_window`` rounds:
      noise only ever adds time (a shape's first graph, which traces and
      compiles; another process), so one slow round cannot make a size look
      dear for the rest of a request, and a real change shows within
      ``cost_window`` rounds of that size.  A size's drafting is measured
      with it: a draft step's cost depends on the block (on a 2-core CPU the
      second step of a block measured about twice the first), so a cost per
      step read from short blocks would underestimate long ones.  Rounds
      that build the next one (``record.built_ahead``) or were built by the
      one before (``record.overlapped``) shift time between rounds: on a CPU
      the round that builds the next one waits for both forwards, the last of
      the run for almost nothing.  Such a run (of one block size: a round
      builds only the next one of its own size) is measured as one sample of
      that size, its average, when its last round arrives (a slow round
      inside it raises that sample only); a run whose last look-ahead was dropped (the next round
      drafts, or rows finished) is measured as it stands when the next round
      arrives.
      An unmeasured size is interpolated (extrapolated) linearly from the
      measured ones.

    The first round runs ``draft.block_size``, then block size 1 until the
    null path has run twice (so the cost of verifying more than one token is
    known; twice, as the first round of a shape also traces its graph), then
    each tree shape once (with ``[draft] tree``), then ``draft.block_size``
    once more (its first reading held that tracing too: alone, it made the
    null path look best for the rounds until the first exploration), then
    every round runs ``argmax_k E(k) / cost(k)``, with a neighbour tried
    now and then so the model follows changes (acceptance drifting with the
    text, rows leaving the batch): first after ``explore_every`` rounds, and
    each time a try leaves the best size unchanged the wait doubles (up to
    ``max_explore_every``), so a drafter that never pays costs a handful of
    rounds in a long run.  When the best size changes, the wait starts over.
    Unlike trying every size in turn, a short request spends at most one
    round off the best size.  When drafting does not pay -- a cheap target,
    a large batch, a drafter that is rarely right -- block size 1 wins and
    the drafter stops running.
    """

    name = "adaptive"
    explore_every = 8
    max_explore_every = 512
    cost_window = 4
    alpha = 0.3  # the tree arms' moving averages

    def __init__(self, config):
        self.max_k = max(config.draft.max_block_size, config.draft.size)
        self.start = config.draft.size
        # tree arms: measured directly (tokens per row per round / seconds per round, EMAs)
        self.trees = configured_trees(config)
        self.tree_tokens: dict[str, float] = {}
        self.tree_cost: dict[str, float] = {}
        self._tree_next = 0
        self.reached = [0] * self.max_k
        self.accepted = [0] * self.max_k
        self.round_s: dict[int, float] = {}  # block size -> estimated seconds of a round
        self._recent: dict[int, deque] = {}
        self._run: list[float] = []  # the rounds of the current look-ahead run, seconds each
        self._run_k = 1  # their block size
        self.seen: dict[int, int] = {}
        self.rounds = 0
        self._flip = 1
        self._best = None
        self._wait = self.explore_every
        self._next = self.explore_every

    # -- the model -----------------------------------------------------------------
    def p(self, i: int) -> float:
        """Acceptance estimate of draft position ``i``: the smoothed rate, and
        for the first draft one standard error more, so that drafting at all
        is tried again rather than written off after a few unlucky rounds.
        Later positions take the smoothed rate alone: they are reached only
        when the drafts before them were accepted, so their counts stay small
        and an optimistic estimate would keep buying blocks that do not pay."""
        est = 0.5
        for j in range(i + 1):
            n = self.reached[j]
            if n:
                m = (self.accepted[j] + 1) / (n + 2)
                est = min(1.0, m + (m * (1 - m) / (n + 2)) ** 0.5) if j == 0 else m
        return est

    def expected_tokens(self, k: int) -> float:
        e = run = 1.0
        for i in range(k - 1):
            run *= self.p(i)
            e += run
        return e

    def cost(self, k: int) -> float:
        """Seconds of a round of block size ``k``: the measured estimates made
        non-decreasing in ``k`` (a round of more tokens never costs less; a
        noisy cheap measurement must not make every larger size look cheap),
        interpolated linearly between measured sizes and extrapolated with
        the slope of the two largest -- or, when they were measured at one
        cost (the larger one's reading as low as the smaller's), of the
        smallest and the largest: a flat cost would make every larger size
        look free."""
        known = sorted(self.round_s)
        env, run = {}, 0.0
        for x in known:
            run = max(run, self.round_s[x])
            env[x] = run
        if k in env:
            return env[k]
        if len(known) == 1:
            return env[known[0]]
        lo = [x for x in known if x < k]
        hi = [x for x in known if x > k]
        if lo and hi:
            a, b = lo[-1], hi[0]
        elif lo:
            a, b = lo[-2], lo[-1]
            slope = (env[b] - env[a]) / (b - a)
            if slope <= 0:  # measured at one cost: the slope from the smallest size
                slope = (env[b] - env[known[0]]) / (b - known[0])
            return max(env[b] + slope * (k - b), 1e-9)
        else:
            return env[hi[0]]
        va, vb = env[a], env[b]
        return max(va + (vb - va) * (k - a) / (b - a), 1e-9)

    def predicted_rate(self, k: int) -> float:
        """Predicted tokens per second per row at block size ``k``."""
        return self.expected_tokens(k) / self.cost(k)

    def best(self) -> int:
        return max(range(1, self.max_k + 1), key=self.predicted_rate)

    # -- the policy protocol -------------------------------------------------------
    def tree_rate(self, shape) -> float:
        key = shape.describe()
        return self.tree_tokens[key] / max(self.tree_cost[key], 1e-9)

    def block_size(self, stats):
        if self.start not in self.round_s:
            return self.start
        if self.seen.get(1, 0) < 2:
            return 1
        untried = [t for t in self.trees if t.describe() not in self.tree_tokens]
        if untried:  # every tree shape once, after the chain's first measurements
            return untried[0]
        if self.seen.get(self.start, 0) < 2:
            return self.start  # its first round traced its graph too
        self.rounds += 1
        best = self.best()
        if self.trees:
            tree = max(self.trees, key=self.tree_rate)
            if self.tree_rate(tree) > self.predicted_rate(best):
                if self.rounds >= self._next:  # now and then a chain, so the comparison follows changes
                    self._wait = min(2 * self._wait, self.max_explore_every)
                    self._next = self.rounds + self._wait
                    return best
                return tree
            if self.rounds >= self._tree_next:  # now and then the best tree
                self._tree_next = self.rounds + self._wait
                return tree
        if best != self._best:  # the model moved: watch it closely again
            self._best, self._wait = best, self.explore_every
            self._next = self.rounds + self._wait
        if self.rounds >= self._next and self.max_k > 1:
            self._wait = min(2 * self._wait, self.max_explore_every)
            self._next = self.rounds + self._wait
            self._flip = -self._flip
            if best + self._flip < 1 or best + self._flip > self.max_k:
                self._flip = -self._flip
            return best + self._flip
        return best

    def peek(self, stats):
        """What :meth:`block_size` will most likely return next (``None``: no
        guess), without its side effects: the round loop builds the next round
        early when it will draft nothing.  A wrong guess costs one verify.
        No guess while the null path is measured at the start: those rounds
        are not built ahead, so each reads its own forward."""
        if self.start not in self.round_s or min(self.seen.get(1, 0), self.seen.get(self.start, 0)) < 2 or self.trees:
            return None
        best = self.best()
        if best == self._best and self.rounds + 1 >= self._next and self.max_k > 1:
            return None  # a neighbour will be tried
        return best

    def _measure(self, k: int, seconds: float) -> None:
        if seconds > 0:
            recent = self._recent.setdefault(k, deque(maxlen=self.cost_window))
            recent.append(seconds)
            self.round_s[k] = min(recent)

    def _end_run(self) -> None:
        self._measure(self._run_k, sum(self._run) / len(self._run))
        self._run = []

    def observe(self, record) -> None:
        v = record.draft_s + record.verify_s + record.host_s
        if self._run and not record.overlapped:
            # the round built ahead was dropped (this one drafts, or rows left): the run so far,
            # whose last round waited for a forward no round used
            self._end_run()
        in_run = record.overlapped or record.built_ahead  # a look-ahead run, measured as a whole
        if in_run:
            self._run_k = record.block_size  # a run is of one block size (the round built is the one before)
            self._run.append(v)
            if not record.built_ahead:  # its last round
                self._end_run()
        a = self.alpha
        if record.tree is not None:
            key = record.tree
            tok = sum(n + 1 for n in record.accepted) / max(record.batch_size, 1)
            if key in self.tree_tokens:
                self.tree_tokens[key] = (1 - a) * self.tree_tokens[key] + a * tok
                self.tree_cost[key] = (1 - a) * self.tree_cost[key] + a * v
            else:
                self.tree_tokens[key], self.tree_cost[key] = tok, v
            return
        k = record.block_size
        self.seen[k] = self.seen.get(k, 0) + 1
        if not in_run:
            self._measure(k, v)
        d = record.drafted
        if d > len(self.reached):  # a chain deeper than max_k: a tree too deep for the budget ran as one
            grow = [0] * (d - len(self.reached))
            self.reached, self.accepted = self.reached + grow, self.accepted + grow
        if d > 0:
            for acc in record.accepted:
                for i in range(min(acc + 1, d)):
                    self.reached[i] += 1
                    self.accepted[i] += i < acc


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
