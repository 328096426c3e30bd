"""Block-size policies."""

import random

import pytest
from conftest import ModelFreeDrafter, make_session

from mtpflow.builtins.policies import AdaptiveBlockPolicy
from mtpflow.config import load_config
from mtpflow.engine import generate, target_only_greedy
from mtpflow.state import RoundRecord, TreeShape


def simulate(policy, p_accept, step_s, verify_s, rounds=96, rows=1, seed=0, lookahead=False):
    """Feed the policy rounds of a world where every draft is accepted with
    probability ``p_accept`` (until the first rejection), a draft step costs
    ``step_s`` and verifying ``k`` tokens costs ``verify_s(k)``.

    ``lookahead``: as the engine runs null rounds, a null round builds and
    starts the next one when the policy's ``peek`` says it will be a null
    round too.  Its own forward was paid by the round before it when that one
    built it (``overlapped``; it then waits ``0.2 * verify_s(1)``), and it waits
    for the next one's forward as well when it builds it (paid even when the
    next round then drafts and the engine drops it)."""
    rng = random.Random(seed)
    chosen = []
    built = False  # the round before built this one (a null round)
    for i in range(rounds):
        k = policy.block_size(None)
        chosen.append(k)
        acc = []
        for _ in range(rows):
            a = 0
            while a < k - 1 and rng.random() < p_accept:
                a += 1
            acc.append(a)
        overlapped = built and k == 1
        verify = verify_s(k)
        builds = lookahead and k == 1 and policy.peek(None) == 1
        if overlapped:
            verify = 0.2 * verify_s(1)
        if builds:
            verify += verify_s(1) - 0.2 * verify_s(1)
        built = builds
        policy.observe(RoundRecord(round=i, batch_size=rows, block_size=k, drafted=k - 1, accepted=acc,
                                   emitted=[a + 1 for a in acc], draft_s=(k - 1) * step_s, verify_s=verify,
                                   host_s=0.0, overlapped=overlapped, built_ahead=builds))
    return chosen


def true_rate(k, p, step_s, verify_s):
    return sum(p**j for j in range(k)) / (verify_s(k) + (k - 1) * step_s)


WORLDS = {
    # name: (p_accept, draft step seconds, verify seconds for k tokens)
    "good drafter": (0.85, 0.01, lambda k: 0.10 + 0.004 * k),
    "fair drafter": (0.6, 0.02, lambda k: 0.10 + 0.01 * k),
    "useless drafter": (0.05, 0.01, lambda k: 0.10 + 0.004 * k),
    "large batch": (0.7, 0.01, lambda k: 0.10 + 0.09 * k),
}


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_adaptive_policy_finds_the_fastest_block_size(world):
    p, step, verify = WORLDS[world]
    cfg = load_config(overrides={"draft": {"block_size": 4, "max_block_size": 8, "policy": "adaptive"}})
    rates = {k: true_rate(k, p, step, verify) for k in range(1, 9)}
    best = max(rates.values())
    chosen = simulate(AdaptiveBlockPolicy(cfg), p, step, verify)
    assert chosen[:3] == [4, 1, 1]  # the configured size, then the null path (twice: its first round traces)
    tail = chosen[32:]
    assert sum(rates[k] for k in tail) / len(tail) >= 0.95 * best, (world, rates, tail)
    # no sweep over every size: off-best rounds after the first three are exploration only
    off = [k for k in chosen[2:] if rates[k] < 0.9 * best]
    assert len(off) <= len(chosen) // AdaptiveBlockPolicy.explore_every + 4, (world, chosen)


def test_adaptive_policy_stops_drafting_when_it_does_not_pay():
    p, step, verify = WORLDS["useless drafter"]
    cfg = load_config(overrides={"draft": {"block_size": 4, "max_block_size": 8, "policy": "adaptive"}})
    chosen = simulate(AdaptiveBlockPolicy(cfg), p, step, verify)
    assert chosen[8:].count(1) >= 0.75 * len(chosen[8:])  # all but the exploration rounds


def test_adaptive_policy_is_not_misled_by_slow_rounds():
    """Noise only adds time: the first round of each size pays its graph's set-up (tracing,
    compiling), a null round that builds the next one waits for two forwards, and now and then
    a round is slowed by another process.  A useless drafter's rounds must still fall back to
    block 1 -- a cost averaged with one slow round would keep block 1 looking as dear as
    drafting."""
    p, step, verify = WORLDS["useless drafter"]
    seen, calls = set(), []

    def slow(k):
        first = k not in seen
        seen.add(k)
        calls.append(k)
        return verify(k) + (0.12 if first or len(calls) % 9 == 0 else 0.0)

    cfg = load_config(overrides={"draft": {"block_size": 2, "max_block_size": 4, "policy": "adaptive"}})
    for lookahead in (False, True):
        seen.clear()
        calls.clear()
        chosen = simulate(AdaptiveBlockPolicy(cfg), p, step, slow, rounds=64, lookahead=lookahead)
        assert chosen[24:].count(1) >= 0.75 * len(chosen[24:]), (lookahead, chosen)


def _record(i, k, draft_s, verify_s, accepted=0, overlapped=False, built_ahead=False):
    return RoundRecord(round=i, batch_size=1, block_size=k, drafted=k - 1, accepted=[accepted],
                       emitted=[accepted + 1], draft_s=draft_s, verify_s=verify_s, host_s=0.0, overlapped=overlapped,
                       built_ahead=built_ahead)


def test_adaptive_policy_shares_out_a_run_of_rounds_built_ahead():
    """A run of null rounds built ahead shifts time between its rounds: the first waits for its
    own forward and the next one's, the last for almost nothing.  Taken alone, the last would
    make block 1 look five times cheaper than it is, and a drafter that pays would be dropped;
    the run is measured as its average."""
    cfg = load_config(overrides={"draft": {"block_size": 2, "max_block_size": 4, "policy": "adaptive"}})
    pol = AdaptiveBlockPolicy(cfg)
    pol.observe(_record(0, 2, 0.002, 0.080, accepted=1))
    F = 0.066
    reads = [1.8 * F, F, F, F, 0.2 * F]  # the builder, three built and building, the last built
    for i, v in enumerate(reads):
        pol.observe(_record(1 + i, 1, 0.0, v, overlapped=i > 0, built_ahead=i < len(reads) - 1))
    assert pol.cost(1) == pytest.approx(F)  # measured as the run ends
    pol.observe(_record(6, 2, 0.002, 0.080, accepted=1))
    assert pol.seen[1] == 5
    # the round that builds a run is not measured alone: two more runs keep an earlier, cheaper
    # null reading in the window (the builders' own readings would push it out)
    i = 7
    pol.observe(_record(i, 1, 0.0, 0.95 * F))
    for _ in range(2):
        pol.observe(_record(i + 1, 2, 0.002, 0.080, accepted=1))
        for j, v in enumerate(reads):
            pol.observe(_record(i + 2 + j, 1, 0.0, v, overlapped=j > 0, built_ahead=j < len(reads) - 1))
        i += 2 + len(reads)
    assert pol.cost(1) == pytest.approx(0.95 * F)
    # a round built ahead and then dropped (the next round drafts) is measured as it stands, not
    # averaged into the next run
    pol = AdaptiveBlockPolicy(cfg)
    pol.observe(_record(0, 2, 0.002, 0.080, accepted=1))
    pol.observe(_record(1, 1, 0.0, 3 * F, built_ahead=True))
    pol.observe(_record(2, 2, 0.002, 0.080, accepted=1))
    assert pol.cost(1) == pytest.approx(3 * F)  # that round waited for a forward no round used
    for j, v in enumerate([1.8 * F, 0.2 * F]):
        pol.observe(_record(3 + j, 1, 0.0, v, overlapped=j > 0, built_ahead=j == 0))
    assert pol.cost(1) == pytest.approx(F)


def test_adaptive_policy_counts_a_whole_round_per_block_size():
    """On a CPU a block's later draft steps cost more than its first (measured with SmolLM2:
    2.0 ms for one draft step, 5.8 ms for two): a block size's cost is its measured rounds,
    drafting included, not a cost per step read from other sizes."""
    cfg = load_config(overrides={"draft": {"block_size": 2, "max_block_size": 4, "policy": "adaptive"}})
    pol = AdaptiveBlockPolicy(cfg)
    for i, (k, d, v) in enumerate([(2, 0.0020, 0.0790), (1, 0.0, 0.0663), (3, 0.0058, 0.0848), (2, 0.0020, 0.0790)]):
        pol.observe(_record(i, k, d, v))
    assert pol.cost(1) == pytest.approx(0.0663)
    assert pol.cost(2) == pytest.approx(0.0810)
    assert pol.cost(3) == pytest.approx(0.0906)  # a per-step draft cost would say 0.0888
    assert pol.cost(4) == pytest.approx(0.0906 + (0.0906 - 0.0810))  # extrapolated from 2 and 3


def test_adaptive_policy_keeps_greedy_output_exact():
    s = make_session("e", block_size=3, draft={"policy": "adaptive", "max_block_size": 6})
    ids = list(range(5, 45))
    res = generate(s, ids, max_tokens=60)
    assert res.tokens == target_only_greedy(s.target, ids, 60, s.target.eos_ids)
    assert {1, 3} <= set(s.block_policy.seen)  # the configured size and the null path were measured


def test_adaptive_policy_falls_back_on_an_always_wrong_drafter_and_stays_there():
    # a memory-bound target, where verifying more tokens costs little (SmolLM2
    # here: 4 tokens cost 1.17x one), and a drafter that is never right
    cfg = load_config(overrides={"draft": {"block_size": 4, "max_block_size": 8, "policy": "adaptive"}})
    chosen = simulate(AdaptiveBlockPolicy(cfg), 0.0, 0.004, lambda k: 0.1 * (1 + 0.057 * (k - 1)), rounds=1000)
    drafting = [i for i, k in enumerate(chosen) if k > 1]
    # a few rounds to learn, then tries whose spacing doubles: a handful in 1000 rounds
    assert drafting[0] == 0 and len(drafting) <= 40, drafting
    late = [i for i in drafting if i >= 100]
    assert len(late) <= 4, drafting
    gaps = [b - a for a, b in zip(late, late[1:])]
    assert all(g2 >= 1.5 * g1 for g1, g2 in zip(gaps, gaps[1:])), drafting
    assert chosen[-200:].count(1) >= 199


class _AlwaysWrongDrafter(ModelFreeDrafter):
    """Drafts token 0, which the fixture target never emits greedily, after some real work
    (so drafting costs time, as it does with a real drafter)."""

    def propose(self, session, state, shared, n_draft):
        import mlx.core as mx

        from mtpflow.state import DraftBlock

        B = state.size
        w = mx.ones((1024, 1024)) / 1024.0
        x = mx.ones((512, 1024))
        for _ in range(3 * n_draft):  # ~3 GFLOP per draft step: far above timing noise
            x = x @ w
        zero = (x[:B, :1] * 0).astype(mx.int32)
        return DraftBlock(tokens=mx.broadcast_to(zero, (B, n_draft)), n_draft=n_draft)


class _WrongPlugin:
    from mtpflow import hookimpl as _hookimpl

    @_hookimpl
    def mtpflow_register_drafters(self, register):
        register("always-wrong", _AlwaysWrongDrafter)


def test_default_policy_falls_back_to_target_only_on_a_wrong_drafter():
    from conftest import RoundLog

    from mtpflow.plugins import make_plugin_manager

    rounds = RoundLog()
    pm = make_plugin_manager([_WrongPlugin(), rounds], autoload=False)
    s = make_session("e", block_size=None, with_drafter=False, plugins=pm, model={"draft_kind": "always-wrong"})
    assert s.config.draft.policy == "adaptive"  # the default: no block size given
    ids = list(range(5, 25))
    ref = target_only_greedy(s.target, ids, 150, s.target.eos_ids)
    assert 0 not in ref
    res = generate(s, ids, max_tokens=150)
    assert res.tokens == ref
    sizes = [r.block_size for r in rounds.records]
    drafting = [i for i, k in enumerate(sizes) if k > 1]
    assert s.stats.accepted_tokens == 0
    assert len(drafting) <= 20, sizes  # a few rounds to learn, then rare, ever rarer tries
    assert sizes[-40:].count(1) >= 39, sizes
    # those null rounds are built ahead (the lookahead): most rounds adopt one
    assert sum(r.overlapped for r in rounds.records) >= len(sizes) // 2, sizes


def test_adaptive_peek_foretells_block_size_without_moving_it():
    """``peek`` is what ``block_size`` returns next (or ``None``), and calling it
    changes nothing: the same run with and without peeks chooses the same sizes."""
    cfg = load_config(overrides={"draft": {"block_size": 4, "max_block_size": 8, "policy": "adaptive"}})
    verify = lambda k: 0.1 * (1 + 0.057 * (k - 1))  # noqa: E731
    plain = simulate(AdaptiveBlockPolicy(cfg), 0.0, 0.004, verify, rounds=600)

    class Peeking(AdaptiveBlockPolicy):
        def block_size(self, stats):
            self.guess = self.peek(stats)
            k = super().block_size(stats)
            self.guesses.append((self.guess, k))
            return k

    pol = Peeking(cfg)
    pol.guesses = []
    assert simulate(pol, 0.0, 0.004, verify, rounds=600) == plain
    said = [(g, k) for g, k in pol.guesses if g is not None]
    assert len(said) >= 500 and all(g == k for g, k in said), [x for x in said if x[0] != x[1]]
    assert any(g is None and k > 1 for g, k in pol.guesses)  # the exploring rounds are not promised


def _tree_world(policy, rounds, chain_p, tree_tokens, tree_cost, verify, step=0.004):
    """Feed ``policy`` rounds: chains accept each draft with ``chain_p``; a tree
    shape yields ``tree_tokens[shape]`` tokens per row at ``tree_cost[shape]`` seconds."""
    rng = random.Random(1)
    chosen = []
    for i in range(rounds):
        k = policy.block_size(None)
        chosen.append(k)
        if hasattr(k, "describe"):
            key = k.describe()
            n = tree_tokens[key] - 1
            policy.observe(RoundRecord(round=i, batch_size=1, block_size=k.levels + 1, drafted=k.levels, accepted=[n],
                                       emitted=[n + 1], draft_s=step * k.levels, verify_s=tree_cost[key], host_s=0.0,
                                       nodes=k.nodes, tree=key))
            continue
        a = 0
        while a < k - 1 and rng.random() < chain_p:
            a += 1
        policy.observe(RoundRecord(round=i, batch_size=1, block_size=k, drafted=k - 1, accepted=[a], emitted=[a + 1],
                                   draft_s=(k - 1) * step, verify_s=verify(k), host_s=0.0))
    return chosen


def test_adaptive_policy_uses_a_tree_only_where_it_pays():
    cfg = load_config(overrides={"draft": {"block_size": 3, "max_block_size": 6, "policy": "adaptive", "tree": "auto"}})
    from mtpflow.builtins.policies import AUTO_TREES

    keys = [TreeShape.parse(t).describe() for t in AUTO_TREES]
    verify = lambda k: 0.1 * (1 + 0.02 * (k - 1))  # noqa: E731  a memory-bound target
    # a world where trees pay: many more tokens per round at a small extra cost
    good = {k: 2.6 for k in keys}
    chosen = _tree_world(AdaptiveBlockPolicy(cfg), 200, 0.35, good, {k: 0.12 for k in keys}, verify)
    assert sum(hasattr(c, "describe") for c in chosen[-100:]) >= 90
    # ... and one where verifying a tree costs too much for what it gains
    chosen = _tree_world(AdaptiveBlockPolicy(cfg), 200, 0.35, {k: 1.7 for k in keys}, {k: 0.4 for k in keys}, verify)
    assert sum(hasattr(c, "describe") for c in chosen[-100:]) <= 10


def test_adaptive_policy_keeps_to_the_best_size_in_a_measured_cpu_world():
    """Round costs measured on a 2-core CPU (SmolLM2 with its shipped drafter: drafting and
    verify in ms per block size) and its MT-Bench acceptance (0.36 for the first draft, 0.33
    for each later one given the ones before).  Block 2 is best, block 3 within 3 % of it: an
    optimistic estimate of the rarely reached later positions kept buying blocks 3 and 4
    (over these seeds 97.9 % of block 2's rate; 96.2 % with that estimate; 95.8 % with the
    previous cost estimates too)."""
    draft = {1: 0.0, 2: 2.0, 3: 5.8, 4: 9.6, 5: 13.4, 6: 17.2, 7: 21.0, 8: 25.0}
    verify = {1: 66.3, 2: 79.0, 3: 84.8, 4: 92.0, 5: 99.0, 6: 106.0, 7: 113.0, 8: 120.0}
    pc = [0.36] + [0.33] * 6

    def expected(k):
        e = run = 1.0
        for i in range(k - 1):
            run *= pc[i]
            e += run
        return e

    best = max(expected(k) / (draft[k] + verify[k]) for k in draft)
    cfg = load_config(overrides={"draft": {"block_size": 2, "max_block_size": 8, "policy": "adaptive"}})
    shares = []
    for seed in range(20):
        pol, rng, tokens, ms = AdaptiveBlockPolicy(cfg), random.Random(seed), 0, 0.0
        for i in range(250):
            k = pol.block_size(None)
            a = 0
            while a < k - 1 and rng.random() < pc[a]:
                a += 1
            noise = 3 * rng.random()
            tokens, ms = tokens + a + 1, ms + draft[k] + verify[k] + noise
            pol.observe(_record(i, k, draft[k] / 1e3, (verify[k] + noise) / 1e3, accepted=a))
        shares.append(tokens / ms / best)
    assert sum(shares) / len(shares) >= 0.97, shares


def test_adaptive_policy_measures_a_run_of_drafting_rounds_as_their_block_size():
    """Drafting rounds build the next one of the same block ahead too: such a run is measured as
    its average, for its own block size, and leaves the null path's cost alone."""
    cfg = load_config(overrides={"draft": {"block_size": 2, "max_block_size": 4, "policy": "adaptive"}})
    pol = AdaptiveBlockPolicy(cfg)
    pol.observe(_record(0, 1, 0.0, 0.066))
    R = 0.078
    reads = [1.7 * R, R, R, 0.3 * R]
    for i, v in enumerate(reads):
        pol.observe(_record(1 + i, 2, 0.0, v, accepted=1, overlapped=i > 0, built_ahead=i < len(reads) - 1))
    assert pol.cost(2) == pytest.approx(R)
    assert pol.cost(1) == pytest.approx(0.066)
    assert pol.reached[0] == len(reads) and pol.accepted[0] == len(reads)


def test_two_sizes_measured_at_one_cost_do_not_make_the_largest_block_free():
    """Block 3 read as cheap as block 2 (noise, or a pipelined run of one against a lone round of
    the other) made the cost flat past 3, so the largest block won on paper and ran (seen: 7
    rounds of block 8 in a 64-token bench).  Past two sizes of one cost, the cost now grows as from
    the smallest measured size to the largest."""
    cfg = load_config(overrides={"draft": {"block_size": 2, "max_block_size": 8, "policy": "adaptive"}})
    pol = AdaptiveBlockPolicy(cfg)
    for i, (k, v, acc) in enumerate([(2, 0.080, 0), (1, 0.066, 0), (1, 0.066, 0), (3, 0.079, 1), (2, 0.080, 0)]):
        pol.observe(_record(i, k, 0.0, v, accepted=acc))
    assert pol.cost(3) == pytest.approx(0.080)  # made non-decreasing
    assert pol.cost(8) == pytest.approx(0.080 + 5 * (0.080 - 0.066) / 2)
    assert pol.best() < 8


def test_the_start_size_is_measured_twice_like_the_null_path():
    """The first round of a shape also traces its graph: a block-2 start read at 3x its cost made
    the null path look best until the first exploration (8 null rounds of a 64-token request on
    SmolLM2).  After the null path's two rounds the start size runs once more, and the best size
    follows its second reading."""
    cfg = load_config(overrides={"draft": {"block_size": 2, "max_block_size": 2, "policy": "adaptive"}})
    pol = AdaptiveBlockPolicy(cfg)
    seq = []
    for i, (v, acc) in enumerate([(0.240, 1), (0.066, 0), (0.066, 0), (0.078, 1), (0.078, 0), (0.078, 1)]):
        k = pol.block_size(None)
        seq.append(k)
        pol.observe(_record(i, k, 0.0, v if k > 1 else 0.066, accepted=acc if k > 1 else 0))
    assert seq[:4] == [2, 1, 1, 2]
    assert pol.cost(2) == pytest.approx(0.078)
    assert seq[4:] == [2, 2] and pol.block_size(None) == 2
    assert pol.peek(None) == 2


def test_a_chain_deeper_than_the_ceiling_is_counted():
    """A tree too deep for the rows' budget runs as a chain of its depth, which may pass
    ``max_block_size`` (``2,1,...,1`` of 19 levels under a ceiling of 5): its acceptance counts."""
    cfg = load_config(overrides={"draft": {"block_size": 2, "max_block_size": 5, "policy": "adaptive"}})
    pol = AdaptiveBlockPolicy(cfg)
    pol.observe(RoundRecord(round=0, batch_size=2, block_size=19, drafted=18, accepted=[18, 3], emitted=[19, 4],
                            draft_s=0.01, verify_s=0.1, host_s=0.0))
    assert pol.reached[:5] == [2, 2, 2, 2, 1] and pol.reached[17] == 1 and pol.accepted[3] == 1
    assert pol.best() <= 5
