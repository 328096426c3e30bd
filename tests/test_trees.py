"""Draft trees: one target forward over every candidate, the accepted path kept,
lossless at T = 0 and T > 0, in ragged and continuous batches."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES, ModelFreeDrafter, RoundLog, drive_with_late_joiners, make_session, reference

from mtpflow import hookimpl
from mtpflow.engine import Batcher, generate, make_request
from mtpflow.plugins import make_plugin_manager
from mtpflow.state import DraftBlock, SamplingParams, TreeShape

SHAPES = ["1,1,1", "2,1", "4,2,1", "3,3,2", "dynamic:4:6:4", "dynamic:4:6:4:7"]
PROMPTS = [json.loads((FIXTURES / "pair_e" / f"generate_{n}.json").read_text())["prompt_ids"] for n in ("long", "short", "edge")]


def test_tree_shapes_parse_and_count():
    assert TreeShape.parse("4,2,1").nodes == 4 + 8 + 8 and TreeShape.parse("[2,1]").levels == 2
    assert TreeShape.parse("1,1,1").is_chain and TreeShape.parse("dynamic:4:6:3").nodes == 4 + 6 + 6
    ranked = TreeShape.parse("dynamic:4:6:3:5")
    assert (ranked.candidates, ranked.nodes, ranked.levels) == (16, 5, 3) and ranked.describe() == "dynamic:4x6x3x5"
    assert TreeShape.parse("dynamic:4:6:3:99").nodes == 16
    for bad in ("", "0,1", "dynamic:4:6", "x", "dynamic:4:6:3:0", "dynamic:4:6:3:5:1"):
        with pytest.raises(ValueError, match="tree shape"):
            TreeShape.parse(bad)


def _grown_tree(rng, B, shape):
    """Random level-by-level candidates as a drafter builds them: per level, tokens,
    parents (input index), depth and cumulative log-probabilities (a child's
    = its parent's + a log-probability <= 0, some exactly 0)."""
    toks, pars, deps, cums = [], [], [], []
    prev = np.zeros((B, 1), np.float32)
    start = 0  # input index of the previous level's first node (the root: 0)
    for d in range(shape.levels):
        F = prev.shape[1]
        m = min(shape.width, F * shape.branching[0])
        parent = rng.integers(0, F, size=(B, m))
        lp = np.where(rng.random((B, m)) < 0.2, 0.0, -rng.exponential(2.0, size=(B, m))).astype(np.float32)
        cum = np.take_along_axis(prev, parent, axis=1) + lp
        toks.append(mx.array(np.stack([rng.permutation(m) for _ in range(B)]) + 1 + 100 * d, dtype=mx.int32))  # distinct
        pars.append(mx.array(start + parent, dtype=mx.int32))
        deps.append(mx.full((B, m), d + 1, dtype=mx.int32))
        cums.append(mx.array(cum))
        start = start + F if d else 1
        prev = cum
    return toks, pars, deps, cums


def test_a_budget_keeps_the_most_probable_nodes_as_a_tree():
    from mtpflow.drafters.base import finish_tree

    rng = np.random.default_rng(0)
    full_shape, shape = TreeShape.parse("dynamic:4:6:4"), TreeShape.parse("dynamic:4:6:4:9")
    for _ in range(20):
        grown = _grown_tree(rng, 3, full_shape)
        full = finish_tree(*grown, full_shape)
        kept = finish_tree(*grown, shape)
        assert full.n_draft == 22 and kept.n_draft == kept.tokens.shape[1] == 9 and kept.max_depth == 4
        score = np.concatenate([np.array(c) for c in grown[3]], axis=1)
        ftok, fpar, fdep = (np.array(x) for x in (full.tokens, full.parents, full.depth))
        ktok, kpar, kdep = (np.array(x) for x in (kept.tokens, kept.parents, kept.depth))
        for b in range(3):
            # the kept nodes, mapped back to the full tree by (token, depth, parent chain)
            def chain(tok, par, i):
                out = []
                while i > 0:
                    out.append(int(tok[i - 1]))
                    i = int(par[i - 1])
                return tuple(out)
            full_paths = {chain(ftok[b], fpar[b], i + 1): i for i in range(22)}
            idx = [full_paths[chain(ktok[b], kpar[b], i + 1)] for i in range(9)]
            assert idx == sorted(idx)  # parents before children, as grown
            assert all(0 <= kpar[b, i] <= i for i in range(9))  # each parent is the root or an earlier kept node
            assert all(kdep[b, i] == (1 if kpar[b, i] == 0 else kdep[b, kpar[b, i] - 1] + 1) for i in range(9))
            # the 9 best by score (ties at probability 1 resolved towards the shallower node)
            key = score[b] - 1e-3 * fdep[b]
            assert sorted(key[idx]) == sorted(np.sort(key)[::-1][:9])
    # every draft of probability 1: the shallowest nodes are kept, never a child without its parent
    toks, pars, deps, cums = _grown_tree(rng, 2, full_shape)
    kept = finish_tree(toks, pars, deps, [mx.zeros_like(c) for c in cums], shape)
    assert np.array(kept.depth).tolist() == [[1] * 4 + [2] * 5] * 2


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pair", ["e", "d"])
def test_greedy_trees_equal_target_only(pair, shape):
    log = RoundLog()
    s = make_session(pair, block_size=4, draft={"tree": shape}, plugins=make_plugin_manager([log], autoload=False))
    ids = PROMPTS[0]
    assert generate(s, ids, max_tokens=40).tokens == reference(s, ids, 40)
    trees = [r for r in log.records if r.tree is not None]
    assert trees and trees[0].tree == TreeShape.parse(shape).describe() and trees[0].nodes == TreeShape.parse(shape).nodes


def test_a_tree_deeper_than_the_sliding_window():
    s = make_session("e", block_size=4, draft={"tree": "2" + ",1" * 18})  # depth 19 > window 16
    assert s.target.sliding_window == 16
    ids = PROMPTS[0]
    assert generate(s, ids, max_tokens=45).tokens == reference(s, ids, 45)


def test_trees_beat_chains_in_acceptance_on_the_fixture_pair():
    ids = list(range(5, 45))  # a prompt where the chain's first guesses often miss
    chain = make_session("d", block_size=4)
    tree = make_session("d", block_size=4, draft={"tree": "dynamic:4:6:3"})
    generate(chain, ids, max_tokens=40)
    generate(tree, ids, max_tokens=40)
    assert tree.stats.tau > chain.stats.tau  # same depth, more candidates per depth


class WrongTreeDrafter(ModelFreeDrafter):
    """A tree whose every branch is wrong: token 0 (the fixture target never emits it) everywhere."""

    def propose(self, session, state, shared, n):
        return DraftBlock(tokens=mx.zeros((state.size, n), mx.int32), n_draft=n)

    def propose_tree(self, session, state, shared, shape):
        B, N = state.size, shape.nodes
        parents, depth, n, frontier = [], [], 0, [0]
        for d, b in enumerate(shape.branching):
            nxt = []
            for p in frontier:
                for _ in range(b):
                    n += 1
                    parents.append(p)
                    depth.append(d + 1)
                    nxt.append(n)
            frontier = nxt
        rep = lambda v: mx.broadcast_to(mx.array(v, dtype=mx.int32)[None], (B, N))  # noqa: E731
        return DraftBlock(tokens=mx.zeros((B, N), mx.int32), n_draft=N, parents=rep(parents), depth=rep(depth),
                          max_depth=len(shape.branching))


class WrongPlugin:
    @hookimpl
    def mtpflow_register_drafters(self, register):
        register("wrong-tree", WrongTreeDrafter)


def test_a_tree_where_every_branch_is_wrong():
    s = make_session("e", block_size=4, with_drafter=False, plugins=make_plugin_manager([WrongPlugin()], autoload=False),
                     model={"draft_kind": "wrong-tree"}, draft={"tree": "3,2"})
    ids = PROMPTS[0]
    ref = reference(s, ids, 20)
    assert 0 not in ref and generate(s, ids, max_tokens=20).tokens == ref
    assert s.stats.accepted_tokens == 0 and s.stats.rounds == 19


def test_ragged_and_continuous_batches_with_trees():
    s = make_session("e", block_size=4, draft={"tree": "3,2,1"}, batch={"policy": "continuous", "max_batch_size": 2})
    first = [make_request(s, PROMPTS[0], max_tokens=22, request_id="a"), make_request(s, PROMPTS[1], max_tokens=7, request_id="b")]
    late = [make_request(s, PROMPTS[2], max_tokens=15, request_id="c"), make_request(s, PROMPTS[1][:5], max_tokens=11, request_id="d")]
    out = drive_with_late_joiners(s, first, late, join_after=2, max_live=2)
    for r in first + late:
        assert out[r.id] == reference(s, r.prompt, r.max_tokens), r.id


def test_cache_after_an_accepted_side_branch_is_the_paths():
    """After tree rounds (a side branch accepted in some of them), the target
    cache holds exactly the K/V a fresh prefill of the accepted sequence gives."""
    log = RoundLog()
    s = make_session("d", block_size=4, draft={"tree": "dynamic:4:6:3:8"}, plugins=make_plugin_manager([log], autoload=False))
    b = Batcher(s)
    b.add([make_request(s, PROMPTS[0], max_tokens=30)])
    for _ in range(4):
        b.step()
    assert any(r.accepted[0] > 0 for r in log.records)
    st = b.state
    row = st.rows[0]
    seq = list(row.request.prompt) + list(row.generated)
    fresh, _ = s.target.prefill([seq[:-1]])
    for live, ref in zip(st.cache, fresh):
        lk, lv, lp = (np.array(a[0]) for a in live.view())
        rk, rv, rp = (np.array(a[0]) for a in ref.view())
        lsel, rsel = lp >= 0, rp >= 0
        lorder, rorder = np.argsort(lp[lsel]), np.argsort(rp[rsel])
        assert (lp[lsel][lorder] == rp[rsel][rorder]).all()  # exactly the path's positions, no rejected node
        assert np.abs(lk[:, lsel][:, lorder] - rk[:, rsel][:, rorder]).max() < 1e-4
        assert np.abs(lv[:, lsel][:, lorder] - rv[:, rsel][:, rorder]).max() < 1e-4


def test_sampling_through_a_tree_is_lossless_and_seed_invariant():
    import test_sampling_engine as tse

    sp = lambda seed: SamplingParams(temperature=0.8, top_p=0.9, seed=seed)  # noqa: E731
    P = tse.exact_joint(make_session("e", block_size=1, with_drafter=False).target, sp(0), 2)
    s = make_session("e", block_size=4, draft={"tree": "3,2"}, batch={"max_batch_size": 4000})
    Q = tse.empirical(s, sp, 2, n=8000, chunk=4000)
    assert s.stats.accepted_tokens > 0 and tse.tv(P, Q) < tse.tv_bound(P, 8000)
    # a seeded row gets its target-only sampled output through a tree too
    alone = make_session("e", block_size=1, with_drafter=False)
    for seed in (3, 4):
        assert generate(s, PROMPTS[1], max_tokens=16, sampling=sp(seed)).tokens == \
            generate(alone, PROMPTS[1], max_tokens=16, sampling=sp(seed)).tokens


@pytest.mark.parametrize("shape", ["2,2,1", "dynamic:3:4:5", "dynamic:3:4:5:7"])
def test_dflash_trees_over_the_blocks_distributions(shape):
    from pathlib import Path

    from mtpflow.config import load_config
    from mtpflow.engine import load_session, target_only_greedy

    fx = Path(__file__).parent / "fixtures" / "dflash"
    chain = load_session(load_config(overrides={"model": {"model": str(fx / "target"), "draft_model": str(fx / "drafter")},
                                                "draft": {"block_size": TreeShape.parse(shape).levels + 1}}))
    tree = load_session(load_config(overrides={"model": {"model": str(fx / "target"), "draft_model": str(fx / "drafter")},
                                               "draft": {"block_size": 8, "tree": shape}}))
    ids = json.loads((fx / "generate_medium.json").read_text())["prompt_ids"]
    want = target_only_greedy(tree.target, ids, 40, tree.target.eos_ids)
    assert generate(tree, ids, max_tokens=40).tokens == want == generate(chain, ids, max_tokens=40).tokens
    if TreeShape.parse(shape).budget is None:  # a re-ranked tree may drop the deep end of the argmax chain
        assert tree.stats.tau >= chain.stats.tau  # the tree holds the chain (each depth's argmax)
