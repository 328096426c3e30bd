"""Hybrid-attention targets (Qwen3.5 / Qwen3.5-MoE / Qwen3-Next): Gated DeltaNet
layers on a per-row rollback cache, full attention on the slot cache."""

import json
import os
import shutil
import subprocess
import sys
import warnings

import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES, ModelFreeDrafter, RoundLog, drive_with_late_joiners, quiet_log, run_requests
from tiny_hybrid import build, load_reference

from mtpflow import hookimpl
from mtpflow.config import load_config
from mtpflow.engine import generate_stream, load_session, make_request, target_only_greedy
from mtpflow.plugins import make_plugin_manager
from mtpflow.state import DraftBlock, SamplingParams
from mtpflow.targets.cache import SlotKVCache
from mtpflow.targets.hybrid import Qwen3NextTarget, Qwen35Target
from mtpflow.targets.recurrent import RecurrentCache

QWEN3 = __import__("pathlib").Path(__file__).parent / "fixtures" / "dflash" / "target"  # same vocabulary


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    out = {f: build(root, f, seed=0) for f in ("qwen3_5", "qwen3_5_moe", "qwen3_next")}
    # the EAGLE-3 fixture drafter (hidden 64, vocab 2048, aux layers 2, 4, 5) declared for this target
    eagle = root / "eagle3"
    shutil.copytree(FIXTURES.parent / "eagle3" / "drafter_default", eagle)
    cfg = json.loads((eagle / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["architectures"] = ["Qwen3_5ForConditionalGeneration"]
    (eagle / "config.json").write_text(json.dumps(cfg))
    out["eagle3"] = eagle
    return out


class OracleDrafter(ModelFreeDrafter):
    """Drafts each row's target-only greedy continuation (``refs`` by request
    id) with a wrong token from a row- and round-dependent depth on: ragged
    acceptance, every count from 0 to all."""

    refs: dict = {}

    def propose(self, session, state, shared, n_draft):
        V = session.target.vocab_size
        rows = []
        for b, r in enumerate(state.rows):
            ref = self.refs[r.request.id]
            done = len(r.generated)
            good = [ref[i] if i < len(ref) else 4 for i in range(done, done + n_draft)]
            cut = (b + state.round) % (n_draft + 1)
            rows.append([t if j < cut else (t + 1) % V for j, t in enumerate(good)])
        return DraftBlock(tokens=mx.array(rows, dtype=mx.int32), n_draft=n_draft)


class OraclePlugin:
    @hookimpl
    def mtpflow_register_drafters(self, register):
        register("oracle", OracleDrafter)


def session(path, rounds=None, **overrides):
    ov = {"model": {"model": str(path)}, "draft": {"block_size": 4}}
    for k, v in overrides.items():
        ov.setdefault(k, {}).update(v)
    plugins = make_plugin_manager([OraclePlugin()] + ([rounds] if rounds is not None else []), autoload=False)
    return load_session(load_config(overrides=ov), plugins=plugins, log=quiet_log())


PROMPTS = [[2, 17, 300, 41, 999, 5, 77, 1200, 64, 8, 33], [2, 501, 502], [2, 9, 9, 9, 1500, 23, 7]]
MAX = [20, 14, 17]


# -- the adapter against mlx-lm ----------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_forward_equals_mlx_lm(ckpts, family):
    """Prefill and single-token steps on mtpflow's caches give mlx-lm's own logits (its caches, its code)."""
    ref = load_reference(ckpts[family])
    t = (Qwen3NextTarget if family == "qwen3_next" else Qwen35Target).from_path(ckpts[family])
    rc = ref.make_cache()
    cache = t.make_cache()
    t.set_offsets(cache, mx.array([0], mx.int32))
    want = ref(mx.array([PROMPTS[0]]), cache=rc)
    got = t.logits(t.forward(mx.array([PROMPTS[0]]), cache))
    assert mx.abs(want - got).max().item() < 1e-5
    for tok in (5, 900, 1300):
        want = ref(mx.array([[tok]]), cache=rc)
        got = t.logits(t.forward(mx.array([[tok]]), cache))
        assert mx.abs(want - got).max().item() < 1e-5
    assert [type(c) for c in cache] == [RecurrentCache, RecurrentCache, SlotKVCache] * 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(1, 1, 2, 16), (1, 3, 2, 16), (4, 5, 16, 128)])
def test_fused_qk_norm_is_mlx_lms_normalize_qk_bit_for_bit(dtype, shape):
    from mlx_lm.models.gated_delta import normalize_qk

    from mtpflow.backend import fusion
    from mtpflow.targets.hybrid import _qk_consts

    B, S, Hk, Dk = shape
    mx.random.seed(sum(shape))
    q, k = (mx.random.normal(shape).astype(getattr(mx, dtype)) for _ in range(2))
    want_q, want_k = normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    qk = fusion.rms_norm(mx.concatenate([q, k], axis=2), *_qk_consts(Hk, Dk, q.dtype))
    got_q, got_k = qk[:, :, :Hk], qk[:, :, Hk:]
    assert got_q.dtype == want_q.dtype and got_k.dtype == want_k.dtype
    assert mx.array_equal(got_q, want_q).item() and mx.array_equal(got_k, want_k).item()


# -- rollback: the state after rejected drafts is a fresh prefill's ----------------------
#: the state checks are bitwise, run where batched and one-row matmuls round
#: alike: MLX's bundled reference BLAS, in a subprocess (OpenBLAS, the tests'
#: BLAS, rounds a ragged batch's prefill differently from one row's by 4e-6
#: before any rollback, and this random model amplifies it over rounds)
BITWISE = bool(os.environ.get("MTPFLOW_HYBRID_BITWISE"))
bitwise_only = pytest.mark.skipif(not BITWISE, reason="run by test_rollback_is_bitwise_with_the_reference_blas")


def _close(a, b):
    a, b = np.array(a), np.array(b)
    assert a.shape == b.shape
    return np.array_equal(a, b)


def _assert_as_fresh(t, caches, seqs):
    """Every row's recurrent and attention state, in every cache of ``caches``,
    equals a fresh one-row prefill of its sequence."""
    for b, seq in enumerate(seqs):
        fresh, _ = t.prefill([seq])
        for cache in caches:
            for c, f in zip(cache, fresh):
                if isinstance(c, RecurrentCache):
                    assert _close(c.recurrent[b], f.recurrent[0]) and _close(c.conv[b], f.conv[0])
                else:
                    k, v, p = c.view()
                    pos = np.array(p[b])
                    order = mx.array(np.argsort(np.where(pos >= 0, pos, 10**9))[: len(seq)])
                    assert sorted(pos[pos >= 0].tolist()) == list(range(len(seq)))
                    fk, fv, _ = f.view()
                    assert _close(k[b][:, order], fk[0]) and _close(v[b][:, order], fv[0])


@bitwise_only
def test_rollback_leaves_the_state_of_a_fresh_prefill(ckpts):
    """Ragged left-padded prefill, verifies of 4 tokens with every row keeping
    its own count (1..4, all-equal rounds too), a row leaving and one joining:
    in both rollback modes (per-step states gathered from device or host
    counts, snapshot + replay), recurrent and attention state equal a fresh
    prefill of the accepted prefix."""
    from mtpflow.targets.cache import merge_caches

    t = Qwen35Target.from_path(ckpts["qwen3_5"])
    rng = np.random.default_rng(0)
    seqs = [list(p) for p in PROMPTS]
    caches = {}
    for name in ("steps", "steps, host counts", "replay"):
        mode = name.split(",")[0]
        t.rollback_mode = mode
        caches[name] = t.prefill(seqs)[0]
        assert {c.mode for c in caches[name] if isinstance(c, RecurrentCache)} == {mode}
    _assert_as_fresh(t, caches.values(), seqs)
    plans = [[1, 4, 2], [3, 3, 3], [4, 4, 4], [2, 1, 4], [1, 1, 1]]
    for r, keep in enumerate(plans):
        inputs = rng.integers(4, 2048, (len(seqs), 4)).tolist()
        if r == 3:  # row 1 leaves, a new row joins
            new = [2, 640, 12, 1999, 3]
            fresh = t.prefill([new])[0]
            for mode, cache in caches.items():
                for c in cache:
                    c.select(mx.array([0, 2], dtype=mx.int32))
                caches[mode] = merge_caches([cache, fresh])
            seqs = [seqs[0], seqs[2], new]
        pos = mx.array([len(s) for s in seqs], dtype=mx.int32)
        keep_a = mx.array(keep, dtype=mx.int32)
        for name, cache in caches.items():
            t.set_offsets(cache, pos)
            mx.eval(t.forward(mx.array(inputs, dtype=mx.int32), cache))
            for c in cache:
                c.rollback(4, keep_a, pos + keep_a, 4 - max(keep), min(keep) != max(keep), kept=keep if "host" in name else None)
            t.compact(cache, n_valid_max=max(len(s) + k for s, k in zip(seqs, keep)),
                      min_positions=[len(s) + k for s, k in zip(seqs, keep)])
        seqs = [s + i[:k] for s, i, k in zip(seqs, inputs, keep)]
        if r in (0, 3, 4):
            _assert_as_fresh(t, caches.values(), seqs)


def test_rollback_is_bitwise_with_the_reference_blas():
    """Rollback (both modes, rows leaving and joining) and trim leave the
    state a fresh prefill gives, bitwise (see BITWISE)."""
    if BITWISE:
        pytest.skip("this is the bitwise run")
    env = dict(os.environ, MTPFLOW_BLAS="none", MTPFLOW_HYBRID_BITWISE="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
                        "-k", "fresh_prefill or undoes"], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "2 passed" in r.stdout, r.stdout[-3000:]


@bitwise_only
def test_trim_undoes_the_last_tokens(ckpts):
    """``trim(n)`` (a dropped lookahead) leaves the state as before those tokens."""
    t = Qwen35Target.from_path(ckpts["qwen3_5"])
    cache, _ = t.prefill([PROMPTS[0]])
    t.set_offsets(cache, mx.array([len(PROMPTS[0])], mx.int32))
    mx.eval(t.forward(mx.array([[5, 6]], dtype=mx.int32), cache))
    for c in cache:
        c.trim(1)
    _assert_as_fresh(t, [cache], [PROMPTS[0] + [5]])


# -- greedy equality through the engine ----------------------------------------------------
def _refs(s, prompts, max_tokens):
    return [target_only_greedy(s.target, p, m, s.target.eos_ids) for p, m in zip(prompts, max_tokens)]


@pytest.mark.parametrize("family,kind", [("qwen3_5", "oracle"), ("qwen3_5", "ngram"), ("qwen3_5", "model"),
                                         ("qwen3_5", "dflash"), ("qwen3_5", "eagle3"),
                                         ("qwen3_next", "oracle"), ("qwen3_5_moe", "oracle")])
def test_greedy_equals_target_only_in_ragged_batches(ckpts, family, kind):
    """Each row equals its own target-only greedy output, with every drafter
    kind that runs on a hybrid (DFlash and EAGLE-3 read its layers)."""
    rounds = RoundLog()
    drafter = {"model": str(QWEN3), "dflash": str(QWEN3.parent / "drafter"), "eagle3": str(ckpts["eagle3"])}.get(kind)
    model = {"draft_kind": kind} | ({"draft_model": drafter} if drafter else {})
    s = session(ckpts[family], rounds=rounds, model=model, batch={"max_batch_size": 8})
    want = _refs(s, PROMPTS, MAX)
    OracleDrafter.refs = {str(i): w for i, w in enumerate(want)}
    for bs in (1, 4):
        s.block_policy.size = bs
        reqs, out = run_requests(s, PROMPTS, MAX, ids=[str(i) for i in range(3)])
        assert [out[r.id] for r in reqs] == want, bs
    accepted = [a for rec in rounds.records for a in rec.accepted if rec.drafted]
    assert s.draft_kind == kind
    if kind == "oracle":
        assert set(accepted) == {0, 1, 2, 3}  # every count, rows of one round differing
        assert any(len(set(rec.accepted)) > 1 for rec in rounds.records)
    assert max(rec.batch_size for rec in rounds.records) == 3


def test_continuous_batching(ckpts):
    """Rows joining a running batch and rows leaving it each get their target-only output."""
    s = session(ckpts["qwen3_5"], model={"draft_kind": "oracle"}, batch={"max_batch_size": 8, "policy": "continuous"})
    prompts = PROMPTS + [[2, 44, 45, 46, 47, 48, 49, 50, 51], [2, 1000]]
    maxes = MAX + [11, 16]
    want = _refs(s, prompts, maxes)
    OracleDrafter.refs = {str(i): w for i, w in enumerate(want)}
    reqs = [make_request(s, p, max_tokens=m, request_id=str(i)) for i, (p, m) in enumerate(zip(prompts, maxes))]
    out = drive_with_late_joiners(s, reqs[:3], reqs[3:], join_after=2)
    assert [out[str(i)] for i in range(5)] == want


def test_seeded_sampling_through_speculation_equals_target_only(ckpts):
    """At T > 0 a seeded row gets its target-only sampled output through speculation."""
    sps = [SamplingParams(temperature=0.9, top_p=0.95, seed=11), SamplingParams(temperature=0.7, seed=5),
           SamplingParams(temperature=1.2, top_k=20, seed=3)]

    def run(s):
        reqs = [make_request(s, p, max_tokens=14, sampling=sp, request_id=str(i)) for i, (p, sp) in enumerate(zip(PROMPTS, sps))]
        out = {r.id: [] for r in reqs}
        for ev in generate_stream(s, reqs):
            out[ev.request_id].extend(ev.tokens)
        return out

    alone = session(ckpts["qwen3_5"], draft={"block_size": 1})
    want = run(alone)
    assert len({tuple(v) for v in want.values()}) == 3
    s = session(ckpts["qwen3_5"], model={"draft_kind": "oracle"})
    OracleDrafter.refs = {str(i): _refs(s, [p], [14])[0] for i, p in enumerate(PROMPTS)}
    assert run(s) == want


# -- what hybrids refuse ---------------------------------------------------------------------
def test_a_tree_request_drafts_chains_and_says_so_once(ckpts):
    rounds = RoundLog()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = session(ckpts["qwen3_5"], rounds=rounds, model={"draft_kind": "model", "draft_model": str(QWEN3)},
                    draft={"tree": "2,1"})
    notes = [w for w in caught if "chains only" in str(w.message)]
    assert len(notes) == 1 and s.config.draft.tree == "off"
    want = _refs(s, PROMPTS[:2], MAX[:2])
    reqs, out = run_requests(s, PROMPTS[:2], MAX[:2])
    assert [out[r.id] for r in reqs] == want
    assert all(rec.tree is None for rec in rounds.records) and any(rec.drafted for rec in rounds.records)


def test_the_prefix_cache_is_turned_off_with_one_line(ckpts):
    """(``mtpflow serve`` turns it on by default: a hybrid still serves.)"""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = session(ckpts["qwen3_next"], batch={"prefix_cache_mb": 64})
    notes = [str(w.message) for w in caught if "prefix cache" in str(w.message)]
    assert len(notes) == 1 and "\n" not in notes[0] and "prefix_cache_mb = 0" in notes[0]
    assert s.prefix_cache is None and s.config.batch.prefix_cache_mb == 0


def test_fused_targets_gated_deltanet_takes_the_fused_qk_norm_with_the_same_logits(ckpts, monkeypatch):
    """``[generation] fuse_ops`` on: each Gated DeltaNet layer normalises q and k through
    ``fusion.rms_norm`` (counted), and the prefill's logits equal the unfused target's bit for bit."""
    from mtpflow.backend import fusion

    t = Qwen35Target.from_path(ckpts["qwen3_5"])
    seqs = [PROMPTS[0], PROMPTS[1][:5]]
    _, plain = t.prefill(seqs)
    calls = []
    real = fusion.rms_norm
    monkeypatch.setattr(fusion, "rms_norm", lambda *a: calls.append(a[0].shape) or real(*a))
    assert fusion.fuse(t.model) > 0
    try:
        _, fused = t.prefill(seqs)
    finally:
        fusion.unfuse(t.model)
    n_linear = sum(tt == "linear_attention" for tt in Qwen35Target.layer_types_of(json.loads((ckpts["qwen3_5"] / "config.json").read_text())))
    assert n_linear > 0 and len(calls) >= n_linear
    assert mx.array_equal(plain, fused).item()
