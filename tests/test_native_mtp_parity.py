"""Parity with mlx-vlm 0.7.10's native-MTP path on a tiny GLM-5 checkpoint.

``tests/fixtures/native_mtp/glm_moe_dsa/`` and its ``reference.json`` come
from ``tests/fixtures/tools/make_native_mtp_fixtures.py`` (mlx-vlm in its own
virtualenv).  With ``context = "drafted"`` mtpflow keeps the head's cache as
mlx-vlm does and must draft, per round, what mlx-vlm drafted; the default
``"verified"`` re-makes accepted positions from the target's verified hidden
states (as the head was trained), so its rounds may differ.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from mlx_vlm_parity import Reference

REF = Reference(Path(__file__).parent / "fixtures" / "native_mtp" / "glm_moe_dsa")


@pytest.mark.parametrize("block", [2, 3, 4])
def test_same_tokens_drafts_and_accepted_per_round(block):
    assert REF.rounds_match(block)


def test_ragged_batch_gives_each_prompt_mlx_vlm_tokens():
    runs = REF.runs(3)
    s = REF.session(3, "verified")
    assert REF.decode(s, [r["prompt"] for r in runs]) == [r["tokens"] for r in runs]


def test_verified_context_accepts_at_least_as_much():
    """The default keeps nothing the head made from its own guesses: τ over the
    fixture's prompts is at least mlx-vlm's."""
    for block in (3, 4):
        s = REF.session(block, "verified")
        REF.decode(s, [r["prompt"] for r in REF.runs(block)])
        st = s.stats.as_dict()
        ours, theirs = 1 + st["accepted_tokens"] / st["drafts"], REF.tau_of_theirs(block)
        assert ours >= theirs - 1e-9, (block, ours, theirs)


def test_head_logits_match_mlx_vlm():
    ours, theirs = REF.head_logits(REF.session(3, "verified"))
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_sampling_with_the_native_head_is_lossless():
    """At temperature 1 (top-k 4: 16 outcomes, a tight bound) the first two tokens (the second one from the first
    speculative round) are distributed as target-only sampling."""
    from mtpflow.state import SamplingParams
    from test_sampling_engine import empirical, exact_joint, tv, tv_bound

    n, chunk = 4000, 2000
    s = REF.session(3, "verified", batch={"max_batch_size": chunk}, sampling={"temperature": 1.0})
    prompt = REF.ref["runs"][0]["prompt"]

    def sp(seed):
        return SamplingParams(temperature=1.0, top_k=4, seed=seed)

    P = exact_joint(s.target, sp(0), 2, prompt)
    Q = empirical(s, sp, 2, prompt, n=n, chunk=chunk)
    bound = tv_bound(P, n)
    assert s.stats.draft_tokens >= n and s.stats.accepted_tokens > 0
    assert tv(P, Q) < bound
    assert tv(exact_joint(s.target, SamplingParams(temperature=0.4, top_k=4), 2, prompt), Q) > bound  # the check can fail
