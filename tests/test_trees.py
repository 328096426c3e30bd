"""Draft trees: one target forward over every candidate, the accepted path kept,
lossless at T = 0 and T > 0, in ragged and continuous batches."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES, ModelFreeDrafter, RoundLog, drive_with_late_joiners, make_session, reference, run_requests

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


# --------------------------------------------------------------------------------------
# every kind that drafts trees level by level: the assistant (no cache of its own),
# EAGLE-3 and the draft model (each appends a level's nodes to a cache of its own)
# --------------------------------------------------------------------------------------
EAGLE3 = FIXTURES.parent / "eagle3"
DRAFT_MODEL = {"draft_kind": "model", "draft_model": str(FIXTURES / "pair_d" / "target")}


def _kind_session(kind, shape, plugins=None, policy="adaptive", **over):
    """A session of drafter ``kind`` with ``[draft] tree = shape`` (``policy``:
    ``fixed`` drafts that tree from the first round on)."""
    from mtpflow.config import load_config
    from mtpflow.engine import load_session

    draft = {"block_size": 4, "tree": shape, "policy": policy}
    if kind == "eagle3":
        ov = {"model": {"model": str(EAGLE3 / "target"), "draft_model": str(EAGLE3 / "drafter_train")}, "draft": draft}
        for k, v in over.items():
            ov.setdefault(k, {}).update(v)
        return load_session(load_config(overrides=ov), plugins=plugins)
    if kind == "model":
        return make_session("e", block_size=4, with_drafter=False, model=DRAFT_MODEL, draft=draft, plugins=plugins, **over)
    return make_session("e", block_size=4, draft=draft, plugins=plugins, **over)


def _kind_prompts(kind):
    if kind == "eagle3":
        return [np.load(EAGLE3 / "drafter_default" / f"ref_{p}.npz")["prompt_ids"].tolist() for p in ("long", "short", "mid")]
    return PROMPTS


def _first_tree(kind, shape, ids):
    """The tree the drafter proposes in the first round for prompt ``ids``."""
    s = _kind_session(kind, shape, policy="fixed")
    got, own = [], s.drafter.propose_tree
    s.drafter.propose_tree = lambda *a: got.append(own(*a)) or got[-1]
    generate(s, ids, max_tokens=6)
    return got[0]


def _paths(block, row=0):
    """Every node's token path from the root, as tuples."""
    tok, par = np.array(block.tokens[row]).tolist(), np.array(block.parents[row]).tolist()
    out = set()
    for i in range(len(tok)):
        path, j = [], i + 1
        while j > 0:
            path.append(tok[j - 1])
            j = par[j - 1]
        out.add(tuple(reversed(path)))
    return out


TREE_KINDS = ["assistant", "eagle3", "model"]


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_a_nodes_subtree_does_not_depend_on_its_siblings(kind):
    """From the same context, the subtree under the first draft is the same
    whether the tree has one first draft or four: a node's distribution is
    its own path's, whatever else the drafter's cache holds that round."""
    for ids in _kind_prompts(kind)[:2]:
        alone, wide = _first_tree(kind, "1,4,3", ids), _first_tree(kind, "4,4,3", ids)
        first = next(iter(_paths(alone)))[0]
        under = {p for p in _paths(wide) if p[0] == first}
        assert len(under) == 1 + 4 + 12 and under == _paths(alone)


def _spy_logits(session, kind):
    """A list that records every draft distribution the drafter computes (its
    head's or the draft model's logits)."""
    drawn = []
    if kind == "eagle3":
        model = session.drafter.model
        own = model.head

        def head(out):
            lg, h = own(out)
            drawn.append(lg)
            return lg, h
        model.head = head
    else:
        own = session.drafter.model.logits
        session.drafter.model.logits = lambda h: drawn.append(own(h)) or drawn[-1]
    return drawn


@pytest.mark.parametrize("kind", ["eagle3", "model"])
def test_a_chain_shaped_tree_drafts_the_chain(kind):
    """Tree ``1,1,1`` computes, depth by depth, the very distributions the
    chain of three drafts does: the same tokens at the same positions, over
    the same cache."""
    ids = _kind_prompts(kind)[0]
    chain, tree = _kind_session(kind, "off", policy="fixed"), _kind_session(kind, "1,1,1", policy="fixed")
    blocks, drawn = [], []
    for s, name in ((chain, "propose"), (tree, "propose_tree")):
        got, own = [], getattr(s.drafter, name)
        setattr(s.drafter, name, lambda *a, own=own, got=got: got.append(own(*a)) or got[-1])
        drawn.append(_spy_logits(s, kind))
        generate(s, ids, max_tokens=6)
        blocks.append(got[0])
    assert np.array(blocks[1].tokens).tolist() == np.array(blocks[0].tokens).tolist()
    assert np.array(blocks[1].depth).tolist() == [[1, 2, 3]]
    c, t = drawn[0][:3], drawn[1][:3]  # the first round's three draft distributions
    for a, b in zip(c, t):
        assert np.abs(np.array(a).reshape(-1) - np.array(b).reshape(-1)).max() < 1e-5


def test_draft_model_cache_after_tree_rounds_equals_a_fresh_prefill():
    """After tree rounds (drafts accepted) the draft model's next
    distribution is the one a fresh draft model gives on the whole sequence:
    no tree slot is left behind, the accepted path is read again."""
    from mtpflow.state import BatchState, RowState

    s = _kind_session("model", "dynamic:3:4:3", policy="fixed", batch={"max_batch_size": 3})
    b = Batcher(s)
    b.add([make_request(s, p, max_tokens=40, request_id=str(i)) for i, p in enumerate(PROMPTS)])
    for _ in range(5):
        b.step()
    assert s.stats.accepted_tokens > 0 and s.drafter.tail == 0
    live, _ = s.drafter._catch_up(s, b.state)
    for i, row in enumerate(b.state.rows):
        fresh = _kind_session("model", "off")
        one = BatchState(rows=[RowState(request=row.request, generated=list(row.generated), position=row.position)],
                         cache=None, last_tokens=None, hidden=None, positions=None)
        want, _ = fresh.drafter._catch_up(fresh, one)  # a new row: prefilled, then its last token read
        assert np.abs(np.array(want[0]) - np.array(live[i])).max() < 1e-4, i


@pytest.mark.parametrize("shape", ["3,2", "2,2,1", "dynamic:4:5:3", "dynamic:4:5:3:6", "2" + ",1" * 18])
@pytest.mark.parametrize("kind", ["eagle3", "model"])
def test_greedy_trees_equal_target_only_for_drafters_with_caches(kind, shape):
    from mtpflow.engine import target_only_greedy

    log = RoundLog()
    s = _kind_session(kind, shape, plugins=make_plugin_manager([log], autoload=False), batch={"max_batch_size": 3})
    reqs, out = run_requests(s, _kind_prompts(kind), [24, 13, 30])
    for r in reqs:
        assert out[r.id] == target_only_greedy(s.target, r.prompt, r.max_tokens, s.target.eos_ids), (shape, r.id)
    assert any(r.tree is not None and r.batch_size > 1 for r in log.records)


@pytest.mark.parametrize("kind", ["eagle3", "model"])
def test_continuous_batches_with_trees_for_drafters_with_caches(kind):
    """Rows join and leave between tree rounds: the drafter's own cache follows."""
    from mtpflow.engine import target_only_greedy

    s = _kind_session(kind, "3,2,1", policy="fixed", batch={"policy": "continuous", "max_batch_size": 2})
    ps = _kind_prompts(kind)
    first = [make_request(s, ps[0], max_tokens=22, request_id="a"), make_request(s, ps[1], max_tokens=7, request_id="b")]
    late = [make_request(s, ps[2], max_tokens=15, request_id="c"), make_request(s, ps[1][:5], max_tokens=11, request_id="d")]
    out = drive_with_late_joiners(s, first, late, join_after=2, max_live=2)
    for r in first + late:
        assert out[r.id] == target_only_greedy(s.target, r.prompt, r.max_tokens, s.target.eos_ids), r.id


def test_a_draft_model_drafting_for_itself_has_every_tree_path_accepted():
    """The target as its own draft model: a static tree holds the argmax path,
    which is the target's output, so each tree round accepts its whole depth in
    every row -- in a ragged batch, with rows joining and leaving between
    rounds (continuous batching), and past the 16-token sliding window."""
    for shape in ("3,2,2", "2" + ",1" * 18):
        log = RoundLog()
        s = make_session("e", block_size=4, with_drafter=False, plugins=make_plugin_manager([log], autoload=False),
                         model={"draft_kind": "model", "draft_model": str(FIXTURES / "pair_e" / "target")},
                         draft={"tree": shape, "policy": "fixed"}, batch={"policy": "continuous", "max_batch_size": 2})
        first = [make_request(s, PROMPTS[0], max_tokens=45, request_id="a"), make_request(s, PROMPTS[1], max_tokens=9, request_id="b")]
        late = [make_request(s, PROMPTS[2], max_tokens=30, request_id="c"), make_request(s, PROMPTS[1][:5], max_tokens=25, request_id="d")]
        out = drive_with_late_joiners(s, first, late, join_after=1, max_live=2)
        for r in first + late:
            assert out[r.id] == reference(s, r.prompt, r.max_tokens), (shape, r.id)
        trees = [r for r in log.records if r.tree is not None]
        assert sum(r.batch_size == 2 for r in trees) >= 2, shape
        assert all(r.accepted == [r.drafted] * r.batch_size for r in trees), shape


def test_eagle3_cache_after_tree_rounds_equals_a_fresh_prefill():
    """After tree rounds (and a tree proposed but never committed) the EAGLE-3
    drafter's cache holds exactly the accepted context: the next chain's drafts
    and first logits equal those of a drafter that prefilled the whole sequence."""
    from test_eagle3 import assert_next_block_as_after_a_fresh_prefill

    log = RoundLog()
    s = _kind_session("eagle3", "dynamic:3:4:3", policy="fixed", plugins=make_plugin_manager([log], autoload=False))
    b = Batcher(s)
    ps = _kind_prompts("eagle3")
    b.add([make_request(s, p, max_tokens=40, request_id=str(i)) for i, p in enumerate(ps)])
    for i in range(6):
        if i == 3:  # a tree proposed and never committed (a round that failed after drafting)
            s.drafter.propose_tree(s, b.state, None, TreeShape.parse("3,2,2"))
        b.step()
    assert len(log.records) == 6 and all(r.tree == "dynamic:3x4x3" and r.batch_size == 3 for r in log.records)
    assert_next_block_as_after_a_fresh_prefill(s, b.state, lambda: _kind_session("eagle3", "off"))


@pytest.mark.parametrize("kind", ["eagle3", "model"])
def test_seeded_sampling_through_trees_of_drafters_with_caches(kind):
    """At T > 0 a seeded row gets exactly its target-only sampled output through
    these kinds' trees too (position-keyed coupling: the drafts decide only how
    many tokens a round emits); the distribution itself is checked above."""
    from mtpflow.config import load_config
    from mtpflow.engine import load_session

    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    s = _kind_session(kind, "dynamic:3:4:3", policy="fixed")
    alone = load_session(load_config(overrides={"model": {"model": str(s.target.path)}, "draft": {"block_size": 1}}))
    for ids in _kind_prompts(kind)[:2]:
        assert generate(s, ids, max_tokens=20, sampling=sp).tokens == generate(alone, ids, max_tokens=20, sampling=sp).tokens
    if kind == "model":  # its trees accept sampled tokens (the random EAGLE-3 fixture's never do)
        assert s.stats.accepted_tokens > 0
