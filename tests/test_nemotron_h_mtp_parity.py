"""Parity with mlx-vlm 0.7.10's native-MTP path (``nemotron_h_mtp``) on a tiny Nemotron-H checkpoint.

``tests/fixtures/native_mtp/nemotron_h/`` and its ``reference.json`` come from
``tests/fixtures/tools/make_nemotron_h_mtp_fixture.py`` (mlx-vlm in its own
virtualenv).  With ``context = "drafted"`` mtpflow keeps the head's cache as
mlx-vlm does and drafts, per round, what mlx-vlm drafted -- on a Mamba2 hybrid
target, so the Mamba rollback is what keeps the target's state right after
every rejected draft.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from mlx_vlm_parity import Reference

REF = Reference(Path(__file__).parent / "fixtures" / "native_mtp" / "nemotron_h")


@pytest.mark.parametrize("block", [2, 4])
def test_same_tokens_drafts_and_accepted_per_round(block):
    rounds = REF.rounds_match(block)
    assert 0 < sum(a for _, a, _ in rounds) < sum(d for d, _, _ in rounds)  # accepted and rejected drafts


def test_ragged_batch_gives_each_prompt_mlx_vlm_tokens_and_verified_context_accepts_as_much():
    runs = REF.runs(3)
    s = REF.session(3, "verified")
    assert s.drafter.family.__name__ == "NemotronHLayout"
    assert REF.decode(s, [r["prompt"] for r in runs]) == [r["tokens"] for r in runs]
    st = s.stats.as_dict()
    assert 1 + st["accepted_tokens"] / st["drafts"] >= REF.tau_of_theirs(3) - 1e-9


def test_head_logits_match_mlx_vlm():
    ours, theirs = REF.head_logits(REF.session(3, "verified"))
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
