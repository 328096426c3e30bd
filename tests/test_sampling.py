"""Tests for mtpflow.sampling: processors vs numpy references, acceptance rules,
and a statistical losslessness test of speculative sampling."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mtpflow.sampling import (
    ProcessParams,
    greedy,
    greedy_accept,
    process_logits,
    rejection_accept,
    sample,
    row_keys,
    sample_logits,
    split_keys,
)
from mtpflow.state import SamplingParams as SP

NEG_INF = -np.inf


# ---------------------------------------------------------------------------
# numpy reference (float64, explicit loops over rows and positions)


def _np_log_softmax(y):
    m = np.max(y)
    z = np.exp(y - m)
    return y - m - np.log(z.sum())


def ref_process(logits, rows, context=None, appended=None):
    logits = np.asarray(logits, dtype=np.float64)
    B, L, V = logits.shape
    out = np.empty_like(logits)
    for b, r in enumerate(rows):
        for pos in range(L):
            x = logits[b, pos].copy()
            for tok, val in r.logit_bias.items():
                x[tok] += val
            if context is not None and r.repetition_penalty != 1.0:
                present = {int(t) for t in context[b] if t >= 0}
                if appended is not None:
                    present |= {int(t) for t in appended[b][:pos]}
                for t in present:
                    x[t] = x[t] / r.repetition_penalty if x[t] > 0 else x[t] * r.repetition_penalty
            if r.temperature <= 0:
                o = np.full(V, NEG_INF)
                o[int(np.argmax(x))] = 0.0
                out[b, pos] = o
                continue
            y = x / r.temperature
            if 0 < r.top_k < V:
                kth = np.sort(y)[::-1][r.top_k - 1]
                y[y < kth] = NEG_INF
            if r.top_p < 1.0:
                p = np.exp(_np_log_softmax(y))
                order = np.argsort(-p, kind="stable")
                cum = 0.0
                thresh = None
                for t in order:
                    if cum >= r.top_p or p[t] == 0:
                        break
                    thresh = p[t]
                    cum += p[t]
                y[p < thresh] = NEG_INF
            if r.min_p > 0:
                p = np.exp(_np_log_softmax(y))
                y[p < r.min_p * p.max()] = NEG_INF
            out[b, pos] = _np_log_softmax(y)
    return out


def _check_against_ref(rows, V=64, L=3, seed=0, context=None, appended=None, scale=2.0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(len(rows), L, V)).astype(np.float32) * scale
    params = ProcessParams.from_rows(rows, V)
    got = np.array(
        process_logits(
            mx.array(logits),
            params,
            context=None if context is None else mx.array(context),
            appended=None if appended is None else mx.array(appended),
        )
    )
    want = ref_process(logits, rows, context=context, appended=appended)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-4, atol=1e-4)
    return got


# ---------------------------------------------------------------------------
# processors


def test_temperature_per_row():
    rows = [SP(temperature=0.5), SP(temperature=1.0), SP(temperature=1.7)]
    _check_against_ref(rows)


def test_greedy_rows_one_hot_mixed_batch():
    rows = [SP(temperature=0.0), SP(temperature=0.8, top_p=0.5), SP(temperature=0.0, top_k=3)]
    got = _check_against_ref(rows)
    assert np.all(np.isfinite(got[[0, 2]]).sum(-1) == 1)


def test_top_k_per_row():
    rows = [
        SP(temperature=1.0, top_k=1),
        SP(temperature=0.9, top_k=0),
        SP(temperature=1.2, top_k=7),
    ]
    got = _check_against_ref(rows)
    assert (np.isfinite(got).sum(-1) == np.array([[1], [64], [7]])).all()


def test_top_p_per_row():
    rows = [
        SP(temperature=1.0, top_p=0.9),
        SP(temperature=0.7, top_p=1.0),
        SP(temperature=1.3, top_p=0.3),
    ]
    _check_against_ref(rows, seed=1)


def test_small_top_k_filters_the_largest_values_without_a_full_sort():
    """When every sampling row has a top-k of at most V / 4 the filters work on
    the K largest values (mx.topk) instead of sorting the vocabulary: the same
    distributions, also when ties with the k-th value reach past the K candidates."""
    import attrs

    V = 256
    rows = [SP(temperature=0.8, top_k=40, top_p=0.77), SP(temperature=1.0, top_k=5), SP(temperature=0.0),
            SP(temperature=1.3, top_k=64, top_p=0.93, min_p=0.01)]
    params = ProcessParams.from_rows(rows, V)
    assert params.candidates == 64
    assert ProcessParams.from_rows(rows + [SP(temperature=0.5)], V).candidates == V  # a row without top-k
    assert ProcessParams.from_rows([SP(temperature=0.5, top_k=65)], V).candidates == V  # above V / 4
    rng = np.random.default_rng(3)
    for trial in range(5):
        # half-integer logits: groups of ~20 equal values, so the k-th value is tied
        logits = (rng.integers(-6, 6, size=(4, 3, V)) * 0.5 + (trial >= 3) * rng.normal(size=(4, 3, V))).astype(np.float32)
        if trial == 4:  # a grammar's mask: fewer allowed tokens than the top-k (the k-th value is -inf)
            logits[:, :, 10:] = -np.inf
        got = np.array(process_logits(mx.array(logits), params))
        full = np.array(process_logits(mx.array(logits), attrs.evolve(params, candidates=V)))
        want = ref_process(logits, rows)
        for other in (full, want):
            np.testing.assert_array_equal(np.isfinite(got), np.isfinite(other))
            fin = np.isfinite(other)
            np.testing.assert_allclose(got[fin], other[fin], rtol=1e-5, atol=1e-5)
        if trial < 3:  # the data reaches the case: row 3's 64th value is tied past the 64 candidates
            desc = -np.sort(-logits[3], axis=-1)
            assert (desc[:, 63] == desc[:, 64]).all()


def test_min_p_per_row():
    rows = [
        SP(temperature=1.0, min_p=0.1),
        SP(temperature=1.0, min_p=0.0),
        SP(temperature=0.6, min_p=0.5),
    ]
    _check_against_ref(rows, seed=2)


def test_repetition_penalty_per_row():
    rows = [
        SP(temperature=1.0, repetition_penalty=1.5),
        SP(temperature=1.0),
        SP(temperature=0.8, repetition_penalty=0.7),
    ]
    context = np.array([[1, 5, 9, 5], [1, 2, -1, -1], [0, 63, -1, -1]])
    _check_against_ref(rows, seed=3, context=context)


def test_repetition_penalty_counts_drafts_in_block():
    rows = [
        SP(temperature=1.0, repetition_penalty=1.5),
        SP(temperature=0.0, repetition_penalty=3.0),
        SP(temperature=0.8, repetition_penalty=1.2),
    ]
    context = np.array([[1, 5, -1], [2, -1, -1], [-1, -1, -1]])
    appended = np.array([[7, 8], [11, 11], [3, 1]])
    _check_against_ref(rows, seed=4, context=context, appended=appended)


def test_logit_bias_per_row():
    rows = [
        SP(temperature=1.0, logit_bias={3: 5.0, 4: -100.0}),
        SP(temperature=1.0),
        SP(temperature=0.0, logit_bias={10: 50.0}),
    ]
    got = _check_against_ref(rows, seed=5)
    assert (np.argmax(got[2], -1) == 10).all()


def test_all_processors_combined():
    rows = [
        SP(
            temperature=0.7,
            top_k=20,
            top_p=0.8,
            min_p=0.05,
            repetition_penalty=1.3,
            logit_bias={0: 1.0},
        ),
        SP(temperature=1.1, top_k=5, top_p=0.95, min_p=0.0, repetition_penalty=1.0),
        SP(temperature=0.0, top_k=3, repetition_penalty=2.0, logit_bias={1: 0.5}),
    ]
    context = np.array([[0, 4, 9, -1], [1, 2, 3, 4], [5, -1, -1, -1]])
    appended = np.array([[9, 12], [40, 41], [6, 7]])
    for seed in range(3):
        _check_against_ref(rows, seed=seed, context=context, appended=appended)


def test_process_2d_and_compilable():
    """[B, V] input works, and the function traces under mx.compile (which
    would fail on a host sync)."""
    rows = [
        SP(temperature=0.7, top_k=5, top_p=0.9, min_p=0.02, repetition_penalty=1.2),
        SP(temperature=0.0),
    ]
    params = ProcessParams.from_rows(rows, 32)
    lg = mx.random.normal((2, 32), key=mx.random.key(0))
    ctx = mx.array([[1, 2, -1], [3, -1, -1]])
    eager = process_logits(lg, params, context=ctx)
    compiled = mx.compile(lambda x, c: process_logits(x, params, context=c))(lg, ctx)
    assert eager.shape == (2, 32)
    np.testing.assert_array_equal(np.array(eager), np.array(compiled))


# ---------------------------------------------------------------------------
# greedy acceptance


def _onehot_logits(seq, V=10):
    out = np.full((len(seq), len(seq[0]), V), -1.0, dtype=np.float32)
    for b, row in enumerate(seq):
        for i, t in enumerate(row):
            out[b, i, t] = 1.0
    return mx.array(out)


def test_greedy_accept_cases():
    # target argmax per row: positions 0..3
    target = _onehot_logits([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8]])
    drafts = mx.array([[1, 2, 3], [9, 2, 3], [1, 2, 0], [5, 0, 7]])
    counts, tokens = greedy_accept(target, drafts)
    assert counts.tolist() == [3, 0, 2, 1]
    assert tokens.tolist() == [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8]]
    assert counts.dtype == mx.int32 and tokens.dtype == mx.int32


def test_greedy_accept_k0():
    target = _onehot_logits([[3], [7]])
    counts, tokens = greedy_accept(target, mx.zeros((2, 0), dtype=mx.int32))
    assert counts.tolist() == [0, 0]
    assert tokens.tolist() == [[3], [7]]


def test_rejection_accept_on_greedy_rows_matches_greedy_accept():
    rng = np.random.default_rng(0)
    B, k, V = 64, 3, 6
    logits = mx.array(rng.normal(size=(B, k + 1, V)).astype(np.float32))
    lp = process_logits(logits, ProcessParams.from_rows([SP()] * B, V))
    sel = np.array(greedy(lp))
    drafts = sel[:, :k].copy()
    # corrupt some drafts at random positions
    flip = rng.random((B, k)) < 0.3
    drafts[flip] = (drafts[flip] + 1) % V
    drafts = mx.array(drafts)
    want = greedy_accept(logits, drafts)
    for q in (None, mx.softmax(mx.array(rng.normal(size=(B, k, V)).astype(np.float32)), axis=-1)):
        got = rejection_accept(lp, drafts, q, mx.random.key(1))
        assert got[0].tolist() == want[0].tolist()
        c = want[0].tolist()
        gt, wt = got[1].tolist(), want[1].tolist()
        assert all(gt[b][: c[b] + 1] == wt[b][: c[b] + 1] for b in range(B))


def test_rejection_accept_k0_is_plain_sampling():
    lp = mx.log(mx.array([[[0.0, 1.0, 0.0]], [[0.0, 0.0, 1.0]]]))
    counts, tokens = rejection_accept(lp, mx.zeros((2, 0), dtype=mx.int32), None, mx.random.key(0))
    assert counts.tolist() == [0, 0] and tokens.tolist() == [[1], [2]]


# ---------------------------------------------------------------------------
# distribution test: speculative sampling == target-only sampling
#
# Target: fixed random bigram model T [V, V] (next-token logits depend on the
# previous token).  Drafter: bigram D, good (T + small noise), random, or
# adversarial (-T).  Each of the B rows is an independent run starting from
# token X0; we record the first two emitted tokens (y1, y2) -- from one round
# if it accepted >= 1 draft, else y2 is the first token of a second round
# started from y1.  Their exact joint under target-only sampling is
# P(y1, y2) = p(y1 | X0) * p(y2 | y1), with p computed by the numpy reference
# processor, so K = V^2 outcomes.
#
# Bound on the total variation distance TV = 1/2 sum_i |phat_i - P_i| of the
# empirical distribution phat of N i.i.d. samples (if the sampler is exact):
#   E|phat_i - P_i| <= sqrt(Var phat_i) = sqrt(P_i (1 - P_i) / N)    (Jensen)
#   => E[TV] <= 1/2 sum_i sqrt(P_i (1-P_i) / N) <= 1/2 sqrt(K / N)  (Cauchy-Schwarz)
# TV is a function of N independent samples, and changing one sample moves
# TV by at most 1/N, so McDiarmid gives P(TV >= E[TV] + t) <= exp(-2 N t^2).
# With failure probability delta = 1e-6 per check, t = sqrt(ln(1/delta) / (2N)).
#   bound = 1/2 sum_i sqrt(P_i (1-P_i) / N) + sqrt(ln(1e6) / (2N))
# (for N = 40,000 and K = 144 this is <= 0.030 + 0.0131; with the effective
# support after top-p it is smaller.)  Each check is a fixed-seed run, so the
# test is deterministic; the bound says a correct sampler passes for all but
# ~1e-6 of seeds.

V_BI = 12
X0 = 0
N_PER = 40_000
TEMPS = (0.7, 1.0)
TOP_P = 0.9


def _tables():
    rng = np.random.default_rng(1234)
    T = rng.normal(size=(V_BI, V_BI)) * 1.0
    drafters = {
        "good": T + rng.normal(size=T.shape) * 0.3,
        "random": rng.normal(size=T.shape) * 1.0,
        "adversarial": -T,
    }
    return T.astype(np.float32), {k: v.astype(np.float32) for k, v in drafters.items()}


def _rows():
    return [SP(temperature=t, top_p=TOP_P) for t in TEMPS for _ in range(N_PER)]


def _exact_joint(T, temp):
    row = SP(temperature=temp, top_p=TOP_P)
    P = np.exp(ref_process(T[None], [row])[0])  # [V, V]: P[a] = p(. | a)
    return P[X0][:, None] * P  # joint[y1, y2]


def _tv_bound(P, N, delta=1e-6):
    P = P.ravel()
    return 0.5 * np.sum(np.sqrt(P * (1 - P) / N)) + math.sqrt(math.log(1 / delta) / (2 * N))


def _round(prev, T, D, params, k, mode, key, accept_fn=rejection_accept):
    """One speculative round for every row, starting after token ``prev``."""
    keys = split_keys(key, k + 1)
    cur = prev
    drafts, qs = [], []
    for i in range(k):
        qlp = process_logits(D[cur], params)  # [B, V]
        if mode == "argmax":
            t = greedy(qlp)
        else:
            t = sample(qlp, keys[i])
        drafts.append(t)
        qs.append(mx.exp(qlp) if mode == "sampled" else mx.softmax(D[cur], axis=-1))
        cur = t
    d = mx.stack(drafts, axis=1)  # [B, k]
    block = mx.concatenate([prev[:, None], d], axis=1)  # [B, k+1]
    tlp = process_logits(T[block], params)  # [B, k+1, V]
    if mode == "sampled":
        q = mx.stack(qs, axis=1)
    elif mode == "hf_bug":  # argmax drafts, but q = softmax(drafter logits)
        q = mx.stack(qs, axis=1)
    else:
        q = None
    return accept_fn(tlp, d, q, keys[k]), d, tlp


def _first_two(T, D, k, mode, seed, per_row_keys=False):
    params = ProcessParams.from_rows(_rows(), V_BI)
    Tm, Dm = mx.array(T), mx.array(D)
    B = len(TEMPS) * N_PER
    key = mx.random.key(seed)
    if per_row_keys:
        key = row_keys([None] * B, key)
    k1, k2 = split_keys(key)
    start = mx.full((B,), X0, dtype=mx.int32)
    (c1, t1), _, _ = _round(start, Tm, Dm, params, k, mode, k1)
    (c2, t2), _, _ = _round(t1[:, 0], Tm, Dm, params, k, mode, k2)
    y1 = t1[:, 0]
    y2 = mx.where(c1 >= 1, t1[:, 1], t2[:, 0])
    mx.eval(y1, y2, c1)
    return np.array(y1), np.array(y2), np.array(c1)


def _tvs(T, D, k, mode, seed, per_row_keys=False):
    y1, y2, c1 = _first_two(T, D, k, mode, seed, per_row_keys)
    out = []
    for j, temp in enumerate(TEMPS):
        sl = slice(j * N_PER, (j + 1) * N_PER)
        emp = np.bincount(y1[sl] * V_BI + y2[sl], minlength=V_BI * V_BI) / N_PER
        P = _exact_joint(T, temp).ravel()
        tv = 0.5 * np.abs(emp - P).sum()
        out.append((temp, tv, _tv_bound(P, N_PER), c1[sl].mean()))
    return out


@pytest.mark.parametrize("mode,k", [("argmax", 2), ("sampled", 3)])
@pytest.mark.parametrize("drafter", ["good", "random", "adversarial"])
def test_speculative_sampling_is_lossless(mode, k, drafter):
    T, Ds = _tables()
    seed = {"good": 1, "random": 2, "adversarial": 3}[drafter] + 10 * k
    for temp, tv, bound, mean_acc in _tvs(T, Ds[drafter], k, mode, seed):
        print(
            f"{mode} k={k} {drafter} T={temp}: TV={tv:.4f} bound={bound:.4f} mean_accepted={mean_acc:.3f}"
        )
        assert tv < bound, (temp, tv, bound)


def test_speculative_sampling_is_lossless_with_per_row_keys():
    T, Ds = _tables()
    for temp, tv, bound, mean_acc in _tvs(T, Ds["random"], 3, "sampled", 5, per_row_keys=True):
        print(
            f"per-row keys sampled k=3 random T={temp}: TV={tv:.4f} bound={bound:.4f} mean_accepted={mean_acc:.3f}"
        )
        assert tv < bound, (temp, tv, bound)


def test_distribution_test_detects_hf_bug():
    """Argmax drafts verified as if q = softmax(drafter logits) is biased."""
    T, Ds = _tables()
    for temp, tv, bound, _ in _tvs(T, Ds["good"], 2, "hf_bug", seed=7):
        print(f"hf_bug T={temp}: TV={tv:.4f} bound={bound:.4f}")
        assert tv > 2 * bound, (temp, tv, bound)


def _exact_match_accept(target_logprobs, draft_tokens, draft_probs, key):
    """Naive baseline: accept a draft only if it equals a token drawn from p."""
    y = sample(target_logprobs, key)  # [B, k+1]
    k = draft_tokens.shape[1]
    m = (draft_tokens == y[:, :k]).astype(mx.int32)
    counts = mx.sum(mx.cumprod(m, axis=1), axis=1).astype(mx.int32)
    return counts, y


@pytest.mark.parametrize("drafter", ["good", "random"])
def test_rejection_beats_exact_match_acceptance(drafter):
    T, Ds = _tables()
    params = ProcessParams.from_rows(_rows(), V_BI)
    B = len(TEMPS) * N_PER
    start = mx.full((B,), X0, dtype=mx.int32)
    key = mx.random.key(99)
    (c_rej, _), d, tlp = _round(
        start, mx.array(T), mx.array(Ds[drafter]), params, 3, "sampled", key
    )
    (c_ex, _), d2, _ = _round(
        start,
        mx.array(T),
        mx.array(Ds[drafter]),
        params,
        3,
        "sampled",
        key,
        accept_fn=_exact_match_accept,
    )
    assert np.array_equal(np.array(d), np.array(d2))  # same drafts
    c_rej, c_ex = np.array(c_rej), np.array(c_ex)
    print(f"{drafter}: mean accepted rejection={c_rej.mean():.3f} exact-match={c_ex.mean():.3f}")
    for j, temp in enumerate(TEMPS):
        sl = slice(j * N_PER, (j + 1) * N_PER)
        # First-draft acceptance: P(accept) = sum_x min(p, q) for rejection
        # sampling vs sum_x p q for exact match (always <=, since q <= 1).
        row = SP(temperature=temp, top_p=TOP_P)
        p = np.exp(ref_process(T[None, X0 : X0 + 1], [row])[0, 0])
        q = np.exp(ref_process(Ds[drafter][None, X0 : X0 + 1], [row])[0, 0])
        a_rej, a_ex = np.minimum(p, q).sum(), (p * q).sum()
        e_rej, e_ex = (c_rej[sl] >= 1).mean(), (c_ex[sl] >= 1).mean()
        print(
            f"  T={temp}: first-draft acceptance rejection={e_rej:.4f} (exact {a_rej:.4f}) "
            f"exact-match={e_ex:.4f} (exact {a_ex:.4f}); mean accepted {c_rej[sl].mean():.3f} vs {c_ex[sl].mean():.3f}"
        )
        se = 0.5 / math.sqrt(N_PER)  # max std of a Bernoulli mean
        assert abs(e_rej - a_rej) < 5 * se and abs(e_ex - a_ex) < 5 * se
        assert a_rej > a_ex
        assert e_rej > e_ex + 5 * se
        # mean counts in [0, 3]: each mean has std <= 1.5 / sqrt(N)
        assert c_rej[sl].mean() > c_ex[sl].mean() + 5 * 1.5 / math.sqrt(N_PER)


def test_identical_draft_distribution_accepts_everything():
    B, k, V = 512, 3, 10
    rng = np.random.default_rng(8)
    params = ProcessParams.from_rows([SP(temperature=1.0, top_k=4)] * B, V)
    lp = process_logits(mx.array(rng.normal(size=(B, k + 1, V)).astype(np.float32)), params)
    d = sample(lp[:, :k], mx.random.key(0))
    counts, tokens = rejection_accept(lp, d, mx.exp(lp[:, :k]), mx.random.key(1))
    assert (np.array(counts) == k).all()
    assert np.array_equal(np.array(tokens)[:, :k], np.array(d))


# ---------------------------------------------------------------------------
# reproducibility


def test_same_key_same_outputs():
    rng = np.random.default_rng(3)
    B, k, V = 256, 3, 20
    rows = [SP(temperature=0.8 + 0.1 * (b % 3), top_p=0.95) for b in range(B)]
    params = ProcessParams.from_rows(rows, V)
    lp = process_logits(mx.array(rng.normal(size=(B, k + 1, V)).astype(np.float32)), params)
    q = mx.softmax(mx.array(rng.normal(size=(B, k, V)).astype(np.float32)), axis=-1)
    d = mx.array(rng.integers(0, V, size=(B, k)).astype(np.int32))
    for qq in (None, q):
        a = rejection_accept(lp, d, qq, mx.random.key(5))
        b = rejection_accept(lp, d, qq, mx.random.key(5))
        c = rejection_accept(lp, d, qq, mx.random.key(6))
        assert a[0].tolist() == b[0].tolist() and a[1].tolist() == b[1].tolist()
        assert a[1].tolist() != c[1].tolist()
    x = mx.array(rng.normal(size=(B, V)).astype(np.float32))
    s1 = sample_logits(x, params, mx.random.key(2))
    s2 = sample(process_logits(x, params), mx.random.key(2))
    assert s1.shape == (B,)
    assert s1.tolist() == s2.tolist() == sample_logits(x, params, mx.random.key(2)).tolist()


def test_per_row_keys_independent_of_batch_composition():
    rng = np.random.default_rng(11)
    B, k, V = 16, 3, 20
    rows = [
        SP(temperature=0.6 + 0.1 * (b % 5), top_k=8, seed=100 + b if b % 2 else None)
        for b in range(B)
    ]
    params = ProcessParams.from_rows(rows, V)
    keys = row_keys(params.seeds, mx.random.key(4))
    assert keys.shape == (B, 2)
    assert np.array_equal(np.array(keys[1]), np.array(mx.random.key(101)))
    lp = process_logits(mx.array(rng.normal(size=(B, k + 1, V)).astype(np.float32)), params)
    q = mx.softmax(mx.array(rng.normal(size=(B, k, V)).astype(np.float32)), axis=-1)
    d = sample(mx.log(q), keys)
    full = rejection_accept(lp, d, q, keys)
    sub = mx.array([7, 2, 11])
    part = rejection_accept(lp[sub], d[sub], q[sub], keys[sub])
    assert np.array_equal(np.array(full[0])[np.array(sub)], np.array(part[0]))
    assert np.array_equal(np.array(full[1])[np.array(sub)], np.array(part[1]))
    assert np.array_equal(np.array(d)[np.array(sub)], np.array(sample(mx.log(q[sub]), keys[sub])))
    ks = split_keys(keys, 3)
    assert ks.shape == (3, B, 2)
    assert np.array_equal(np.array(ks[:, 5]), np.array(mx.random.split(keys[5], 3)))
