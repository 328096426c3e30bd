"""The training objective's exp / logsumexp / log-softmax (mtpflow.train.objective): on a device
whose profile says ``power_exp`` (the CPU) they run through ``mx.power(e, x)``, and must give
mx.exp's and mx.logsumexp's values and gradients to float32 rounding, -inf entries included."""

from __future__ import annotations

import platform

import mlx.core as mx
import numpy as np
import pytest

from mtpflow.backend.profiles import PROFILES, current
from mtpflow.train import objective as obj


def _logits(scale: float, shape=(6, 257)) -> mx.array:
    x = mx.random.normal(shape, key=mx.random.key(int(scale * 10))) * scale
    x = mx.concatenate([x, mx.full((shape[0], 3), -float("inf"))], axis=-1)  # masked entries
    return x


def test_the_x86_cpu_profile_takes_power_exp_and_the_gpus_do_not():
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    assert current().device == "cpu" and current().power_exp is x86
    assert PROFILES["cuda"].power_exp is False and PROFILES["metal"].power_exp is False
    assert {"power_exp"} <= set(PROFILES["cpu"].why)


@pytest.fixture(autouse=True)
def _power(monkeypatch):
    monkeypatch.setattr(obj, "_power_exp", lambda: True)  # the x86-64 CPU path, on any machine


@pytest.mark.parametrize("scale", [0.1, 3.0, 30.0])
def test_power_exp_values_equal_mx_to_float32_rounding(scale):
    x = _logits(scale)
    ref = np.array(x - mx.logsumexp(x, axis=-1, keepdims=True))
    got = np.array(obj.log_softmax(x))
    finite = np.isfinite(ref)
    assert (np.isneginf(got) == np.isneginf(ref)).all()
    np.testing.assert_allclose(got[finite], ref[finite], rtol=2e-6, atol=2e-6 * max(1.0, scale))
    lp = ref[finite]  # exp is taken of log-probabilities in the losses; exact: float64
    exact = np.exp(lp.astype(np.float64))
    got_exp = np.array(obj.exp(mx.array(lp))).astype(np.float64)
    normal = exact > 1e-37  # below float32's normal range both flush towards 0
    assert np.max(np.abs(got_exp - exact)[normal] / exact[normal]) < 4e-6
    row = mx.full((1, 5), -float("inf"))
    assert np.isneginf(np.array(obj.logsumexp(row))).all()  # as mx.logsumexp, not nan


def test_power_exp_kl_gradient_equals_mx():
    lab = _logits(2.0)
    lab_logp = lab - mx.logsumexp(lab, axis=-1, keepdims=True)

    def kl(x, fast: bool):
        if fast:
            logp, p = obj.log_softmax(x), obj.exp(obj.log_softmax(lab))
        else:
            logp, p = x - mx.logsumexp(x, axis=-1, keepdims=True), mx.exp(lab_logp)
        term = mx.where(p > 0, p * (lab_logp - mx.where(p > 0, logp, 0.0)), 0.0)
        return term.sum()

    x = _logits(3.0)
    (l0, g0), (l1, g1) = (mx.value_and_grad(lambda x: kl(x, f))(x) for f in (False, True))
    assert abs(l0.item() - l1.item()) <= 1e-5 * abs(l0.item())
    np.testing.assert_allclose(np.array(g1), np.array(g0), rtol=1e-4, atol=1e-6)


def test_without_power_exp_the_functions_are_mx_own(monkeypatch):
    monkeypatch.setattr(obj, "_power_exp", lambda: False)
    x = _logits(3.0)
    assert mx.array_equal(obj.logsumexp(x), mx.logsumexp(x, axis=-1, keepdims=True)).item()
    assert mx.array_equal(obj.exp(x), mx.exp(x)).item()


@pytest.mark.parametrize("soft", [True, False])
def test_logit_terms_equal_step_terms_of_the_log_softmax(soft):
    """``logit_terms`` (KL / cross-entropy from the logits, with ``soft_labels`` computed once)
    gives ``step_terms``' loss, accuracy and count, and its gradient, to float32 rounding."""
    B, T, V = 3, 7, 301
    x = mx.random.normal((B, T, V), key=mx.random.key(31)) * 4
    lab = obj.log_softmax(mx.random.normal((B, T, V), key=mx.random.key(32)) * 3)
    tgt = mx.argmax(lab, axis=-1)
    tgt = mx.where(mx.arange(T)[None] % 3 == 0, mx.argmax(x, axis=-1), tgt)  # some hits for the accuracy
    valid = mx.random.uniform(shape=(B, T), key=mx.random.key(33)) > 0.3
    labels = obj.soft_labels(lab) if soft else None

    def old(x):
        return obj.step_terms(obj.log_softmax(x), lab, tgt, valid, soft)

    def new(x):
        return obj.logit_terms(x, tgt, valid, labels)

    (s0, c0, n0), (s1, c1, n1) = old(x), new(x)
    assert abs(s0.item() - s1.item()) <= 1e-5 * abs(s0.item())
    assert c0.item() == c1.item() > 0 and n0.item() == n1.item() == valid.sum().item()
    g0, g1 = mx.grad(lambda x: old(x)[0])(x), mx.grad(lambda x: new(x)[0])(x)
    assert mx.abs(g0 - g1).max().item() < 1e-5
    assert mx.abs(g0).max().item() > 1e-2  # the gradient is not trivially zero


@pytest.mark.parametrize("power", [True, False])
def test_top_hit_is_the_argmax_hitting_the_index(monkeypatch, power):
    """``top_hit`` with the maximum ``logsumexp_max`` returns is ``argmax(x) == idx`` (no ties in
    random logits), on both exp paths; a tie for the maximum counts as a hit."""
    monkeypatch.setattr(obj, "_power_exp", lambda: power)
    x = mx.random.normal((4, 9, 257), key=mx.random.key(41)) * 3
    am = mx.argmax(x, axis=-1)
    idx = mx.where(mx.arange(9)[None] % 2 == 0, am, (am + 1) % 257)
    lse, m = obj.logsumexp_max(x)
    assert mx.array_equal(obj.top_hit(x, idx, m), am == idx).item()
    assert mx.allclose(lse, mx.logsumexp(x, axis=-1, keepdims=True), rtol=1e-6).item()
    tied = mx.zeros((1, 5))
    assert obj.top_hit(tied, mx.array([3]), obj.logsumexp_max(tied)[1]).item()


@pytest.mark.parametrize("power", [True, False])
def test_soft_labels_of_logits_equal_those_of_their_log_softmax(monkeypatch, power):
    """``soft_labels`` normalises its input itself (one exp): from the target's raw logits, shifted
    logits or their log-distribution it gives ``p``, ``sum p log p`` and ``sum p`` of the softmax,
    as ``exp`` of the log-softmax gives them."""
    monkeypatch.setattr(obj, "_power_exp", lambda: power)
    z = mx.random.normal((3, 5, 401), key=mx.random.key(51)) * 4 + 7
    lab = z - mx.logsumexp(z, axis=-1, keepdims=True)
    p = mx.exp(lab)
    want = (p, (p * lab).sum(-1), p.sum(-1))
    for inp in (z, z - 30.0, lab):
        for g, w in zip(obj.soft_labels(inp), want):
            np.testing.assert_allclose(np.array(g), np.array(w), rtol=2e-5, atol=2e-6)
        # with the maximum label_top gathered at the argmax: the same labels
        a, m = obj.label_top(inp)
        assert mx.array_equal(a, mx.argmax(inp, axis=-1)).item()
        assert mx.array_equal(m, mx.max(inp, axis=-1, keepdims=True)).item()
        for g, w in zip(obj.soft_labels(inp, m), want):
            np.testing.assert_allclose(np.array(g), np.array(w), rtol=2e-5, atol=2e-6)
    # a row without a finite logit has no distribution: NaN, as summing its p gave
    bad = mx.full((1, 7), -float("inf"))
    assert all(np.isnan(np.array(x)).all() for x in (obj.soft_labels(bad)[0], obj.soft_labels(bad)[2]))


@pytest.mark.parametrize("blas", [True, False])
def test_rowsum_and_its_gradient_equal_the_sum(monkeypatch, blas):
    """``rowsum`` (a product by ones where the profile says ``blas_rowsum``) gives the row sums and the
    sum's gradient, on contiguous arrays and on strided views (the unrolled steps' labels)."""
    monkeypatch.setattr(obj, "_blas_rowsum", lambda: blas)
    x = mx.random.normal((3, 9, 513), key=mx.random.key(61))
    for a in (x, x[:, 2:7]):
        np.testing.assert_allclose(np.array(obj.rowsum(a)), np.array(a.sum(-1)), rtol=1e-5, atol=1e-4)
        w = mx.random.normal(a.shape[:-1], key=mx.random.key(62))
        g0 = mx.grad(lambda a: ((mx.exp(a) ** 2).sum(-1) * w).sum())(a)
        g1 = mx.grad(lambda a: (obj.rowsum(mx.exp(a) ** 2) * w).sum())(a)
        np.testing.assert_allclose(np.array(g1), np.array(g0), rtol=1e-5, atol=1e-5)
    assert current().blas_rowsum == (platform.machine().lower() in ("x86_64", "amd64") and current().device == "cpu")


def test_ahead_is_the_shifted_rows():
    """``ahead(a, k, n)`` is ``shift(a, k)[:, :n]`` for every offset and length (past the end: zeros)."""
    a = mx.random.normal((2, 5, 3), key=mx.random.key(71))
    for k in range(8):
        for n in range(1, 6):
            got = obj.ahead(a, k, n)
            assert got.shape == (2, n, 3)
            assert mx.array_equal(got, obj.shift(a, k)[:, :n]).item(), (k, n)
