"""OpenAI's frequency and presence penalties and logit bias: the processed
distribution against a reference, and speculative output equal to target-only
output (greedy and seeded sampling) with them on."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_session, prompt

from mtpflow.engine import generate_stream, make_request
from mtpflow.sampling import ProcessParams, process_logits, token_counts
from mtpflow.state import SamplingParams as SP


def ref_penalised(logits, rows, context, starts, appended):
    """logits[t] -= count(t) * frequency + (count(t) > 0) * presence, over the completion
    (context from ``starts``) and the drafts before each position."""
    B, L, V = logits.shape
    out = logits.astype(np.float64).copy()
    for b, r in enumerate(rows):
        for pos in range(L):
            toks = [int(t) for t in context[b][starts[b]:] if t >= 0] + [int(t) for t in appended[b][:pos]]
            for t in set(toks):
                out[b, pos, t] -= toks.count(t) * r.frequency_penalty + r.presence_penalty
    return out


def test_token_counts_and_penalties_against_a_reference():
    V = 16
    rows = [SP(frequency_penalty=0.5, presence_penalty=0.25), SP(), SP(frequency_penalty=-1.0, presence_penalty=2.0)]
    context = np.array([[1, 5, 5, 9, 5], [1, 2, 2, -1, -1], [3, 3, 4, -1, -1]])
    starts = np.array([1, 0, 2])  # prompt lengths: the penalties count what follows
    appended = np.array([[5, 7], [2, 2], [4, 15]])
    logits = np.random.default_rng(0).normal(size=(3, 3, V)).astype(np.float32)
    counts = np.array(token_counts(mx.array(context), V, mx.array(appended), start=mx.array(starts)))
    assert counts[0, 0, 5] == 3 and counts[0, 2, 5] == 4 and counts[0, 0, 1] == 0 and counts[2, 2, 4] == 2
    params = ProcessParams.from_rows([SP(temperature=1.0, frequency_penalty=r.frequency_penalty,
                                         presence_penalty=r.presence_penalty) for r in rows], V)
    got = np.array(process_logits(mx.array(logits), params, mx.array(context), mx.array(appended),
                                  completion_start=mx.array(starts)))
    want = ref_penalised(logits, rows, context, starts, appended)
    want = want - np.log(np.exp(want).sum(-1, keepdims=True))
    np.testing.assert_allclose(got, want, atol=1e-5)
    compiled = mx.compile(lambda x, c, a, s: process_logits(x, params, c, a, completion_start=s))
    np.testing.assert_allclose(np.array(compiled(mx.array(logits), mx.array(context), mx.array(appended),
                                                 mx.array(starts))), got, atol=1e-6)


PROMPTS = [prompt("e", "long")[:12], prompt("e", "long")[5:20], prompt("e", "long")[:7]]
# the fixtures' logits span hundreds: penalties this large change their outputs (the
# engine takes any value; the server keeps OpenAI's [-2, 2])
SAMPLINGS = [
    SP(frequency_penalty=2.0, presence_penalty=40.0),  # greedy
    SP(frequency_penalty=30.0, logit_bias={7: 3.0, 9: -100.0}),
    SP(temperature=0.9, seed=11, frequency_penalty=25.0, presence_penalty=-0.5),  # seeded sampling
    SP(temperature=1.2, top_p=0.9, seed=5, presence_penalty=35.0, logit_bias={3: 2.0}),
]


def _run(session, speculative=True):
    reqs = [make_request(session, p, max_tokens=24, sampling=sp, request_id=f"{i}-{j}", speculative=speculative)
            for i, p in enumerate(PROMPTS) for j, sp in enumerate(SAMPLINGS)]
    out = {r.id: [] for r in reqs}
    for ev in generate_stream(session, reqs):
        out[ev.request_id].extend(ev.tokens)
    return out


@pytest.fixture(scope="module")
def spec():
    return make_session("e", block_size=4, batch={"policy": "continuous", "max_batch_size": 12})


def test_speculative_equals_target_only_with_penalties(spec):
    plain = make_session("e", block_size=4, with_drafter=False, batch={"policy": "continuous", "max_batch_size": 12})
    got = _run(spec)
    assert got == _run(plain)
    assert spec.stats.as_dict()["accepted_tokens"] > 0  # the drafts were used
    # the penalties act: without them the greedy rows differ
    free = {f"{i}-0": generate_stream_one(plain, p) for i, p in enumerate(PROMPTS)}
    assert sum(free[k] != got[k] for k in free) >= 2


def generate_stream_one(session, p):
    from mtpflow.engine import generate

    return generate(session, p, max_tokens=24, sampling=SP()).tokens


def test_a_resumed_request_keeps_counting_what_it_generated(spec):
    """The server resumes a row after an isolated error as prompt + emitted tokens; its
    penalties still count the emitted tokens, so it continues exactly."""
    from mtpflow.serve.batcher import resume_request

    s = spec
    sp = SP(frequency_penalty=20.0, presence_penalty=30.0)
    full = _collect(s, [make_request(s, PROMPTS[0], max_tokens=24, sampling=sp, request_id="a")])["a"]
    resumed = resume_request(make_request(s, PROMPTS[0], max_tokens=24, sampling=sp, request_id="b"), full[:6])
    assert _collect(s, [resumed])["b"] == full[6:]


def _collect(session, reqs):
    out = {r.id: [] for r in reqs}
    for ev in generate_stream(session, reqs):
        out[ev.request_id].extend(ev.tokens)
    return out
