"""Block-size policies."""

import pytest
from conftest import make_session

from mtpflow.builtins.policies import AdaptiveBlockPolicy
from mtpflow.config import load_config
from mtpflow.engine import generate, target_only_greedy
from mtpflow.state import RoundRecord


def simulate(policy, tokens_per_s, rounds=80):
    """Feed the policy rounds whose throughput depends only on the block size."""
    chosen = []
    for i in range(rounds):
        k = policy.block_size(None)
        chosen.append(k)
        t = 1.0 / tokens_per_s[k]
        policy.observe(RoundRecord(round=i, batch_size=1, block_size=k, drafted=k - 1, accepted=[0], emitted=[1],
                                   draft_s=t / 2, verify_s=t / 2, host_s=0.0))
    return chosen


@pytest.mark.parametrize("best", [1, 3, 6])
def test_adaptive_policy_settles_on_the_fastest_block_size(best):
    cfg = load_config(overrides={"draft": {"block_size": 4, "max_block_size": 6, "policy": "adaptive"}})
    speeds = {k: 100.0 - 10 * abs(k - best) for k in range(1, 7)}
    chosen = simulate(AdaptiveBlockPolicy(cfg), speeds)
    tail = chosen[-40:]
    assert tail.count(best) >= 0.85 * len(tail)
    assert set(chosen[:12]) == set(range(1, 7))  # every size measured during warm-up


def test_adaptive_policy_keeps_greedy_output_exact():
    s = make_session("e", block_size=3, draft={"policy": "adaptive", "max_block_size": 6})
    ids = list(range(5, 45))
    res = generate(s, ids, max_tokens=60)
    assert res.tokens == target_only_greedy(s.target, ids, 60, s.target.eos_ids)
    assert len(s.block_policy.seen) >= 3
