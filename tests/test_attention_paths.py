"""mtpflow's rounds hand the attention kernel what mlx-lm's own generate loop
hands it: per forward, the same query length, the same key length and the same
kind of mask (none / ``"causal"`` / an array).  On a GPU these choose the kernel
(CUDA: a one-query step without an array mask runs the fused vector kernel, an
array mask the unfused path), so in bf16 a path that differs only in its mask
already moves near-tie argmaxes; the CPU runs one kernel for all of them, so
the calls themselves are compared here, with the caches handing masks as they do
on a GPU (``SlotKVCache.causal_array = False``).  On a CPU they hand ``"causal"``
as the array it stands for, one per forward; the last test checks that this
changes no value."""

import mlx.core as mx
import pytest
from conftest import make_session, prompt

from mtpflow.engine import generate_stream, make_request, target_only_greedy
from mtpflow.targets.cache import SlotKVCache


@pytest.fixture(autouse=True)
def gpu_masks(monkeypatch):
    monkeypatch.setattr(SlotKVCache, "causal_array", False)


def _kind(mask) -> str:
    return "none" if mask is None else mask if isinstance(mask, str) else "array"


@pytest.fixture
def calls(monkeypatch, gpu_masks):
    """Every SDPA call as ``(mask kind, queries, keys)``, grouped per forward of the target."""
    from mlx_lm.models import gemma4_text

    got: list[list] = []
    sdpa, fwd = mx.fast.scaled_dot_product_attention, gemma4_text.Gemma4TextModel.__call__

    def rec_sdpa(q, k, v, *a, mask=None, **kw):
        got[-1].append((_kind(mask), q.shape[2], k.shape[2]))
        return sdpa(q, k, v, *a, mask=mask, **kw)

    def rec_fwd(self, *a, **kw):
        got.append([])
        return fwd(self, *a, **kw)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", rec_sdpa)
    monkeypatch.setattr(gemma4_text.Gemma4TextModel, "__call__", rec_fwd)
    return got


@pytest.fixture(scope="module")
def session():
    return make_session("e", block_size=1, model={"dtype": "bfloat16"}, batch={"max_batch_size": 4})


def _engine(s, prompts, n, block=1):
    s.block_policy.size = block
    reqs = [make_request(s, p, max_tokens=n, request_id=str(i)) for i, p in enumerate(prompts)]
    for r in reqs:
        r.stop_ids = frozenset()
    out = {r.id: [] for r in reqs}
    for ev in generate_stream(s, reqs):
        out[ev.request_id].extend(ev.tokens)
    return [out[str(i)] for i in range(len(prompts))]


def _mlx_lm(model, p, n):
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in zip((tok for tok, _ in generate_step(mx.array(p), model, max_tokens=n)), range(n))]


@pytest.mark.parametrize("name", ["short", "long"])  # inside the sliding window (10 tokens) and past it (40 > 16)
def test_rounds_call_attention_as_mlx_lm(session, calls, name):
    s, p, n = session, prompt("e", name), 8
    ref = _mlx_lm(s.target.model, p, n)
    want = [list(c) for c in calls]
    calls.clear()
    assert _engine(s, [p], n) == [ref]
    # the prefill of all but the last token, then one-query steps: the same masks and key lengths
    # (mlx-lm's loop builds one forward more than it yields: its next step, ahead)
    assert len(calls) == n + 1 and calls == want[: n + 1]
    calls.clear()
    assert target_only_greedy(s.target, p, n) == ref
    assert calls == want[: len(calls)] and len(calls) == n + 1
    if name == "short":
        assert {k for c in want[1:] for k, _, _ in c} == {"none"} and {k for k, _, _ in want[0]} == {"causal"}


def test_batched_rounds_and_the_verify_take_the_causal_mask(session, calls):
    """Rows of equal length decode as one row does; an aligned verify of several tokens
    gets ``"causal"`` on every layer while the window drops nothing (no array mask)."""
    s, p = session, prompt("e", "short")
    _engine(s, [p] * 4, 3)
    assert [{k for k, _, _ in c} for c in calls] == [{"causal"}] + [{"none"}] * 3
    calls.clear()
    _engine(s, [p], 6, block=3)
    n_layers = len(calls[0])  # (the drafter's own attention calls follow a forward's)
    verifies = [c[:n_layers] for c in calls[2:] if c[0][1] > 1]
    assert len(verifies) >= 2 and all(k == "causal" for c in verifies for k, _, _ in c)


def test_rounds_and_reference_logits_are_bitwise_equal(session):
    """In bf16 the engine's block-1 rounds and ``target_only_greedy`` give the very
    same logits at every step (batch 1)."""
    s, p, n = session, prompt("e", "long"), 6
    got = {"engine": [], "ref": []}
    orig = s.target.logits

    def rec(into):
        def f(h):
            out = orig(h)
            got[into].append(out[0] if out.ndim == 2 else out[0, -1])
            return out
        return f

    try:
        s.target.logits = rec("engine")
        _engine(s, [p], n)
        s.target.logits = rec("ref")
        target_only_greedy(s.target, p, n)
    finally:
        del s.target.logits
    assert len(got["engine"]) == len(got["ref"]) == n
    for a, b in zip(got["engine"], got["ref"]):
        assert a.dtype == mx.bfloat16 and mx.array_equal(a, b).item()


def test_prefill_chunks_end_with_the_last_token_alone(session):
    t = session.target
    assert t.prefill_chunks(1, 512) == [(0, 1)]
    assert t.prefill_chunks(5, 512) == [(0, 4), (4, 5)]
    assert t.prefill_chunks(9, 4) == [(0, 4), (4, 8), (8, 9)]
    assert t.prefill_chunks(10, 4) == [(0, 4), (4, 8), (8, 9), (9, 10)]


def test_cpu_hands_causal_as_one_shared_array(session, monkeypatch):
    """On a CPU (``causal_array`` left to the device) a verify's layers get one boolean
    array -- the same object in every layer of a forward -- where a GPU gets ``"causal"``,
    and the tokens and every logit are the same bits."""
    s, p = session, prompt("e", "short")
    arrays, logits, tokens = {}, {}, {}
    sdpa = mx.fast.scaled_dot_product_attention
    orig = s.target.logits

    def rec(q, k, v, *a, mask=None, **kw):
        if isinstance(mask, mx.array) and q.shape[2] > 1:
            arrays[setting].append(mask)
        return sdpa(q, k, v, *a, mask=mask, **kw)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", rec)
    for setting in (False, None):
        monkeypatch.setattr(SlotKVCache, "causal_array", setting)
        arrays[setting], got = [], logits.setdefault(setting, [])
        s.target.logits = lambda h, got=got: got.append(orig(h)) or got[-1]
        try:
            tokens[setting] = _engine(s, [p], 6, block=3)
        finally:
            del s.target.logits
    assert arrays[False] == [] and arrays[None]
    verifies = [m for m in arrays[None] if m.ndim == 2]  # [N, S]: the causal ones (cache arrays are 4-D)
    assert verifies and all(m.dtype == mx.bool_ for m in verifies)
    assert len({id(m) for m in verifies}) * 2 <= len(verifies)  # each one shared by the layers of a forward
    assert tokens[False] == tokens[None] and len(logits[False]) == len(logits[None])
    for a, b in zip(logits[False], logits[None]):
        assert mx.array_equal(a, b).item()
