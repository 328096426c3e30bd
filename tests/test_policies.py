"""Block-size policies."""

import random

import pytest
from conftest import make_session

from mtpflow.builtins.policies import AdaptiveBlockPolicy
from mtpflow.config import load_config
from mtpflow.engine import generate, target_only_greedy
from mtpflow.state import RoundRecord


def simulate(policy, p_accept, step_s, verify_s, rounds=96, rows=1, seed=0):
    """Feed the policy rounds of a world where every draft is accepted with
    probability ``p_accept`` (until the first rejection), a draft step costs
    ``step_s`` and verifying ``k`` tokens costs ``verify_s(k)``."""
    rng = random.Random(seed)
    chosen = []
    for i in range(rounds):
        k = policy.block_size(None)
        chosen.append(k)
        acc = []
        for _ in range(rows):
            a = 0
            while a < k - 1 and rng.random() < p_accept:
                a += 1
            acc.append(a)
        policy.observe(RoundRecord(round=i, batch_size=rows, block_size=k, drafted=k - 1, accepted=acc,
                                   emitted=[a + 1 for a in acc], draft_s=(k - 1) * step_s, verify_s=verify_s(k),
                                   host_s=0.0))
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
    assert chosen[:2] == [4, 1]  # the configured size, then the null path
    tail = chosen[32:]
    assert sum(rates[k] for k in tail) / len(tail) >= 0.95 * best, (world, rates, tail)
    # no sweep over every size: off-best rounds after the first two are exploration only
    off = [k for k in chosen[2:] if rates[k] < 0.9 * best]
    assert len(off) <= len(chosen) // AdaptiveBlockPolicy.explore_every + 4, (world, chosen)


def test_adaptive_policy_stops_drafting_when_it_does_not_pay():
    p, step, verify = WORLDS["useless drafter"]
    cfg = load_config(overrides={"draft": {"block_size": 4, "max_block_size": 8, "policy": "adaptive"}})
    chosen = simulate(AdaptiveBlockPolicy(cfg), p, step, verify)
    assert chosen[8:].count(1) >= 0.75 * len(chosen[8:])  # all but the exploration rounds


def test_adaptive_policy_keeps_greedy_output_exact():
    s = make_session("e", block_size=3, draft={"policy": "adaptive", "max_block_size": 6})
    ids = list(range(5, 45))
    res = generate(s, ids, max_tokens=60)
    assert res.tokens == target_only_greedy(s.target, ids, 60, s.target.eos_ids)
    assert {1, 3} <= set(s.block_policy.seen)  # the configured size and the null path were measured
