"""Nemotron-H targets: Mamba2 layers on a per-row rollback cache (ScanCache),
attention on the slot cache, MLP / MoE layers without a cache."""

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from conftest import RoundLog, drive_with_late_joiners, run_requests
from test_hybrid import QWEN3, OracleDrafter, _refs, session
from tiny_hybrid import load_reference
from tiny_nemotron import build

from mtpflow.engine import generate_stream, make_request
from mtpflow.state import SamplingParams
from mtpflow.targets.cache import SlotKVCache, merge_caches
from mtpflow.targets.nemotron_h import NemotronHTarget
from mtpflow.targets.recurrent import ScanCache

PROMPTS = [[2, 17, 300, 41, 999, 5, 77, 1200, 64, 8, 33], [2, 501, 502], [2, 9, 9, 9, 1500, 23, 7]]
MAX = [20, 14, 17]
BITWISE = bool(os.environ.get("MTPFLOW_HYBRID_BITWISE"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build(tmp_path_factory.mktemp("nemotron_h"), seed=0, mtp=False)


def test_forward_equals_mlx_lm(ckpt):
    """Prefill and single-token steps give mlx-lm's own logits (its chunked
    scan, its caches) to float rounding; only M and * layers own a cache."""
    ref = load_reference(ckpt)
    t = NemotronHTarget.from_path(ckpt)
    rc, cache = ref.make_cache(), t.make_cache()
    t.set_offsets(cache, mx.array([0], mx.int32))
    want = ref(mx.array([PROMPTS[0]]), cache=rc)
    got = t.logits(t.forward(mx.array([PROMPTS[0]]), cache))
    assert mx.abs(want - got).max().item() < 1e-4
    for tok in (5, 900, 1300):
        want = ref(mx.array([[tok]]), cache=rc)
        got = t.logits(t.forward(mx.array([[tok]]), cache))
        assert mx.abs(want - got).max().item() < 1e-4
    assert [type(c) for c in cache] == [ScanCache, SlotKVCache] * 2  # pattern M*M-*E


def _assert_as_fresh(t, caches, seqs):
    """Every row's Mamba (conv window, SSM state) and attention state equals a
    fresh one-row prefill of its sequence, bitwise."""
    same = np.array_equal
    for b, seq in enumerate(seqs):
        fresh, _ = t.prefill([seq])
        for cache in caches:
            for c, f in zip(cache, fresh):
                if isinstance(c, ScanCache):
                    assert same(np.array(c.recurrent[b]), np.array(f.recurrent[0]))
                    assert same(np.array(c.conv[b]), np.array(f.conv[0]))
                else:
                    k, v, p = c.view()
                    pos = np.array(p[b])
                    order = mx.array(np.argsort(np.where(pos >= 0, pos, 10**9))[: len(seq)])
                    assert sorted(pos[pos >= 0].tolist()) == list(range(len(seq)))
                    fk, fv, _ = f.view()
                    assert same(np.array(k[b][:, order]), np.array(fk[0]))
                    assert same(np.array(v[b][:, order]), np.array(fv[0]))


@pytest.mark.skipif(not BITWISE, reason="run by test_rollback_is_bitwise_with_the_reference_blas")
def test_rollback_leaves_the_state_of_a_fresh_prefill(ckpt):
    """Ragged left-padded prefill, verifies of 4 tokens with rows keeping their
    own counts (all-equal rounds too), a row leaving and one joining, and a
    trim: in both rollback modes the Mamba and attention state equal a fresh
    prefill of the accepted prefix."""
    t = NemotronHTarget.from_path(ckpt)
    rng = np.random.default_rng(0)
    seqs = [list(p) for p in PROMPTS]
    caches = {}
    for name in ("steps", "steps, host counts", "replay"):
        t.rollback_mode = name.split(",")[0]
        caches[name] = t.prefill(seqs)[0]
    t.rollback_mode = "steps"
    _assert_as_fresh(t, caches.values(), seqs)
    for r, keep in enumerate([[1, 4, 2], [3, 3, 3], [2, 1, 4], [1, 1, 1]]):
        inputs = rng.integers(4, 2048, (len(seqs), 4)).tolist()
        if r == 2:  # row 1 leaves, a new row joins
            new = [2, 640, 12, 1999, 3]
            fresh = t.prefill([new])[0]
            for name, cache in caches.items():
                for c in cache:
                    c.select(mx.array([0, 2], dtype=mx.int32))
                caches[name] = merge_caches([cache, fresh])
            seqs = [seqs[0], seqs[2], new]
        pos = mx.array([len(s) for s in seqs], dtype=mx.int32)
        keep_a = mx.array(keep, dtype=mx.int32)
        for name, cache in caches.items():
            t.set_offsets(cache, pos)
            mx.eval(t.forward(mx.array(inputs, dtype=mx.int32), cache))
            for c in cache:
                c.rollback(4, keep_a, pos + keep_a, 4 - max(keep), min(keep) != max(keep),
                           kept=keep if "host" in name else None)
            t.compact(cache, n_valid_max=max(len(s) + k for s, k in zip(seqs, keep)),
                      min_positions=[len(s) + k for s, k in zip(seqs, keep)])
        seqs = [s + i[:k] for s, i, k in zip(seqs, inputs, keep)]
        if r in (0, 2, 3):
            _assert_as_fresh(t, caches.values(), seqs)
    cache = caches["steps"]
    t.set_offsets(cache, mx.array([len(s) for s in seqs], dtype=mx.int32))
    mx.eval(t.forward(mx.array([[5, 6]] * 3, dtype=mx.int32), cache))
    for c in cache:
        c.trim(1)
    _assert_as_fresh(t, [cache], [s + [5] for s in seqs])


def test_rollback_is_bitwise_with_the_reference_blas():
    """The check above in a subprocess on MLX's bundled reference BLAS (OpenBLAS
    rounds a ragged batch's matmuls differently from one row's; see test_hybrid)."""
    if BITWISE:
        pytest.skip("this is the bitwise run")
    env = dict(os.environ, MTPFLOW_BLAS="none", MTPFLOW_HYBRID_BITWISE="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
                        "-k", "fresh_prefill"], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:]


def _eagle3_for_nemotron(tmp_path):
    """The EAGLE-3 fixture drafter (hidden 64, vocab 2048, aux layers 2, 4, 5) declared for a Nemotron-H verifier."""
    import json
    import shutil

    from conftest import FIXTURES

    eagle = tmp_path / "eagle3"
    shutil.copytree(FIXTURES.parent / "eagle3" / "drafter_default", eagle)
    cfg = json.loads((eagle / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["architectures"] = ["NemotronHForCausalLM"]
    (eagle / "config.json").write_text(json.dumps(cfg))
    return eagle


@pytest.mark.parametrize("kind", ["oracle", "ngram", "model", "dflash", "eagle3"])
def test_greedy_equals_target_only_in_ragged_batches(ckpt, tmp_path, kind):
    """Each row equals its own target-only greedy output, with every drafter
    kind (DFlash and EAGLE-3 read the target's layers and embedding table);
    the oracle drafts every accepted count, rows of one round differing."""
    rounds = RoundLog()
    drafter = {"model": lambda: QWEN3, "dflash": lambda: QWEN3.parent / "drafter",
               "eagle3": lambda: _eagle3_for_nemotron(tmp_path)}.get(kind)
    model = {"draft_kind": kind} | ({"draft_model": str(drafter())} if drafter else {})
    s = session(ckpt, rounds=rounds, model=model, batch={"max_batch_size": 8})
    assert isinstance(s.target, NemotronHTarget) and s.draft_kind == kind
    want = _refs(s, PROMPTS, MAX)
    OracleDrafter.refs = {str(i): w for i, w in enumerate(want)}
    for bs in (1, 4):
        s.block_policy.size = bs
        reqs, out = run_requests(s, PROMPTS, MAX, ids=[str(i) for i in range(3)])
        assert [out[r.id] for r in reqs] == want, bs
    if kind == "oracle":
        accepted = [a for rec in rounds.records for a in rec.accepted if rec.drafted]
        assert set(accepted) == {0, 1, 2, 3}
        assert any(len(set(rec.accepted)) > 1 for rec in rounds.records)


def test_continuous_batching(ckpt):
    s = session(ckpt, model={"draft_kind": "oracle"}, batch={"max_batch_size": 8, "policy": "continuous"})
    prompts = PROMPTS + [[2, 44, 45, 46, 47, 48, 49, 50, 51], [2, 1000]]
    maxes = MAX + [11, 16]
    want = _refs(s, prompts, maxes)
    OracleDrafter.refs = {str(i): w for i, w in enumerate(want)}
    reqs = [make_request(s, p, max_tokens=m, request_id=str(i)) for i, (p, m) in enumerate(zip(prompts, maxes))]
    out = drive_with_late_joiners(s, reqs[:3], reqs[3:], join_after=2)
    assert [out[str(i)] for i in range(5)] == want


def test_seeded_sampling_through_speculation_equals_target_only(ckpt):
    sps = [SamplingParams(temperature=0.9, top_p=0.95, seed=11), SamplingParams(temperature=0.7, seed=5),
           SamplingParams(temperature=1.2, top_k=20, seed=3)]

    def run(s):
        reqs = [make_request(s, p, max_tokens=14, sampling=sp, request_id=str(i)) for i, (p, sp) in enumerate(zip(PROMPTS, sps))]
        out = {r.id: [] for r in reqs}
        for ev in generate_stream(s, reqs):
            out[ev.request_id].extend(ev.tokens)
        return out

    want = run(session(ckpt, draft={"block_size": 1}))
    assert len({tuple(v) for v in want.values()}) == 3
    s = session(ckpt, model={"draft_kind": "oracle"})
    OracleDrafter.refs = {str(i): _refs(s, [p], [14])[0] for i, p in enumerate(PROMPTS)}
    assert run(s) == want


def _perturbed(src, dst, scale):
    """A copy of checkpoint ``src`` with noise on its LM head: a draft model
    that agrees with ``src`` often, not always."""
    import shutil

    shutil.copytree(src, dst)
    w = mx.load(str(dst / "model.safetensors"))
    rng = np.random.default_rng(1)
    w["lm_head.weight"] = w["lm_head.weight"] + mx.array(rng.normal(0, scale, w["lm_head.weight"].shape).astype(np.float32))
    mx.save_safetensors(str(dst / "model.safetensors"), w, metadata={"format": "pt"})
    return dst


def test_a_hybrid_draft_model_keeps_each_rows_accepted_state(ckpt, tmp_path):
    """A Nemotron-H draft model (a noisy copy of the target): after every
    commit each row's Mamba state in the draft model's cache is a fresh
    prefill's of what it accepted (ragged acceptance, rows joining), and
    every row equals its target-only output."""
    rounds = RoundLog()
    s = session(ckpt, rounds=rounds, model={"draft_kind": "model", "draft_model": str(_perturbed(ckpt, tmp_path / "d", 0.15))},
                batch={"max_batch_size": 8, "policy": "continuous"})
    d, checked = s.drafter, []
    commit = d.commit

    def checking(session, state, accepted):
        commit(session, state, accepted)
        for r in state.rows:
            seq, fed = list(r.request.prompt) + list(r.generated), d.rows[r.request.id].fed
            if fed >= len(seq):  # the row ended inside the drafts (max_tokens): it leaves
                continue
            seq = seq[:fed]
            fresh = d.model.prefill([seq])[0]
            b = d.ids.index(r.request.id)
            for c, f in zip(d._states(), [c for c in fresh if isinstance(c, ScanCache)]):
                np.testing.assert_allclose(np.array(c.recurrent[b]), np.array(f.recurrent[0]), atol=1e-4, rtol=0)
                np.testing.assert_allclose(np.array(c.conv[b]), np.array(f.conv[0]), atol=1e-4, rtol=0)
        checked.append(len(state.rows))

    d.commit = checking
    prompts = PROMPTS + [[2, 44, 45, 46, 47, 48, 49, 50, 51]]
    maxes = MAX + [11]
    want = _refs(s, prompts, maxes)
    reqs = [make_request(s, p, max_tokens=m, request_id=str(i)) for i, (p, m) in enumerate(zip(prompts, maxes))]
    out = drive_with_late_joiners(s, reqs[:3], reqs[3:], join_after=2)
    assert [out[str(i)] for i in range(4)] == want
    acc = [rec.accepted for rec in rounds.records if rec.drafted]
    assert 0 < sum(map(sum, acc)) < sum(rec.drafted * len(rec.accepted) for rec in rounds.records if rec.drafted)
    assert any(len(set(a)) > 1 for a in acc) and max(checked) == 4


def test_a_hybrid_draft_model_for_a_dense_target(ckpt):
    s = session(QWEN3, model={"draft_kind": "model", "draft_model": str(ckpt)}, batch={"max_batch_size": 8})
    _, out = run_requests(s, PROMPTS, MAX)
    assert [out[str(i)] for i in range(3)] == _refs(s, PROMPTS, MAX)


def test_a_tree_with_a_hybrid_draft_model_is_a_one_line_error(ckpt):
    from mtpflow.drafters.draft_model import DraftModelError

    with pytest.raises(DraftModelError, match="chains only") as e:
        session(QWEN3, model={"draft_kind": "model", "draft_model": str(ckpt)}, draft={"tree": "2,1"})
    assert "\n" not in str(e.value)
