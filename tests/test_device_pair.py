"""``scripts/make_gemma4_pair.py --accepting``: the copy drafter the device run measures with gets
its drafts accepted (τ > 1), and the speculative tokens stay target-only's."""

import importlib.util
import random
from pathlib import Path

import pytest
from conftest import quiet_log

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("make_gemma4_pair", ROOT / "scripts" / "make_gemma4_pair.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("accepting", [True, False])
def test_the_accepting_pair_is_accepted(tmp_path, accepting):
    from mtpflow.config import load_config
    from mtpflow.engine import generate, load_session, target_only_greedy

    t, d = _script().build(tmp_path / "pair", hidden=128, layers=3, vocab=2048, dtype="float32", accepting=accepting)
    s = load_session(load_config(overrides={"model": {"model": str(t), "draft_model": str(d)},
                                           "draft": {"block_size": 3, "policy": "fixed"}}), log=quiet_log())
    rng = random.Random(0)
    p = [rng.randrange(4, 2048) for _ in range(16)]
    r = generate(s, p, max_tokens=24)
    assert r.tokens == target_only_greedy(s.target, p, 24, s.target.eos_ids)
    tau = r.stats["mean_acceptance_length"]
    assert tau > 1.8 if accepting else tau < 1.3, tau
