"""Greedy speculative decoding equals target-only decoding in bfloat16 and
float16 too, for every drafter kind, on a CPU device: the verify, the
drafter hand-over and the rollback compute nothing the target-only path does
not (same masks, RoPE positions and dtypes), and the drafter runs in the
target's dtype."""

import mlx.core as mx
import pytest
from conftest import FIXTURES, prompt, quiet_log
from conftest import run_requests as run

from mtpflow.config import load_config
from mtpflow.engine import load_session, target_only_greedy

E = FIXTURES / "pair_e"
EAGLE3 = FIXTURES.parent / "eagle3"
DFLASH = FIXTURES.parent / "dflash"

#: kind -> (target, [model] overrides); "mtp" builds its drafter at test time
KINDS = {
    "assistant": (E / "target", {"draft_model": str(E / "drafter")}),
    "mtp": (E / "target", None),
    "eagle3": (EAGLE3 / "target", {"draft_model": str(EAGLE3 / "drafter_default")}),
    "dflash": (DFLASH / "target", {"draft_model": str(DFLASH / "drafter")}),
    # the target drafting for itself (pair_d's target is a MoE: MLX's CPU gather_mm is float32-only)
    "model": (E / "target", {"draft_kind": "model", "draft_model": str(E / "target")}),
    "ngram": (E / "target", {"draft_kind": "ngram"}),
}

#: the kinds whose fixture drafter gets drafts accepted (the mtp and EAGLE-3 ones are random)
ACCEPTING = ("assistant", "dflash", "model")


def _prompts(kind):
    if kind in ("eagle3", "dflash"):
        import json

        d = EAGLE3 if kind == "eagle3" else DFLASH
        names = ("long", "short") if kind == "eagle3" else ("long", "medium")
        if kind == "eagle3":
            import numpy as np

            return [np.load(d / "drafter_default" / f"ref_{n}.npz")["prompt_ids"].tolist() for n in names]
        return [json.loads((d / f"generate_{n}.json").read_text())["prompt_ids"] for n in names]
    return [prompt("e", "long"), prompt("e", "short")]


@pytest.fixture(scope="module")
def mtp_drafter(tmp_path_factory):
    from test_mtpflow_assistant import random_drafter

    return str(random_drafter(E / "target", tmp_path_factory.mktemp("mtp") / "drafter", seed=3))


def _float_dtypes(module):
    from mlx.utils import tree_flatten

    return {v.dtype for _, v in tree_flatten(module.parameters()) if mx.issubdtype(v.dtype, mx.floating)}


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_equals_target_only_in_low_precision(kind, dtype, request):
    target, model = KINDS[kind]
    model = dict(model or {"draft_model": request.getfixturevalue("mtp_drafter")})
    model.update(model=str(target), dtype=dtype)
    s = load_session(load_config(overrides={"model": model, "draft": {"block_size": 4}, "batch": {"max_batch_size": 4}}),
                     log=quiet_log())
    want = getattr(mx, dtype)
    assert s.dtype == dtype and _float_dtypes(s.target.model) == {want}
    dm = getattr(s.drafter, "model", None)
    if dm is not None:  # the drafter runs in the target's dtype
        dm = getattr(dm, "model", dm)
        assert _float_dtypes(dm) <= {want}, _float_dtypes(dm)
    prompts = _prompts(kind)
    n = [20, 14]
    refs = [target_only_greedy(s.target, p, k, s.target.eos_ids) for p, k in zip(prompts, n)]
    s.reset_stats()
    for block, batch in ((2, 1), (5, 2)):
        s.block_policy.size = block
        reqs, out = run(s, prompts[:batch], n[:batch], ids=[f"{block}-{batch}-{i}" for i in range(batch)])
        for r, ref in zip(reqs, refs):
            assert out[r.id] == ref, (kind, dtype, block, batch, r.id)
    if kind in ACCEPTING:
        assert s.stats.as_dict()["accepted_tokens"] > 0  # the drafter's tokens were verified, not all rejected
