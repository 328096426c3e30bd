"""Lossless sampling through the whole engine: speculative output is
distributed exactly as target-only sampling (temperature > 0)."""

import math
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from conftest import ModelFreeDrafter, make_session, prompt

from mtpflow import hookimpl
from mtpflow.engine import generate_stream, make_request
from mtpflow.plugins import make_plugin_manager
from mtpflow.sampling import ProcessParams, process_logits
from mtpflow.state import DraftBlock, SamplingParams

N = 20_000
CHUNK = 5_000
PROMPT = prompt("e", "long")[:12]
BLOCK = 2  # one draft per row: the second and third tokens come from the speculative round


class RandomDrafter(ModelFreeDrafter):
    """A bad drafter: uniformly random proposals."""

    def propose(self, session, state, shared, n_draft):
        toks = mx.random.randint(0, session.target.vocab_size, (state.size, n_draft), key=mx.random.key(state.round + 7))
        return DraftBlock(tokens=toks.astype(mx.int32), n_draft=n_draft)


class RandomPlugin:
    @hookimpl
    def mtpflow_register_drafters(self, register):
        register("random", RandomDrafter)


def exact_joint(target, sp: SamplingParams, depth: int, prompt=None) -> dict:
    """Target-only probability of every (t1..t_depth) continuation of ``prompt``."""
    prompt = PROMPT if prompt is None else prompt
    out = {(): 1.0}
    for _ in range(depth):
        prefixes = list(out)  # all the same length: one batched forward per depth
        params = ProcessParams.from_rows([sp] * len(prefixes), target.vocab_size)
        cache = target.make_cache()
        target.set_offsets(cache, mx.zeros((len(prefixes),), dtype=mx.int32))
        ids = mx.array([list(prompt) + list(p) for p in prefixes], dtype=mx.int32)
        h = target.forward(ids, cache)
        probs = np.exp(np.array(process_logits(target.logits(h[:, -1]), params)))
        nxt = {}
        for prefix, p in zip(prefixes, probs):
            for t in np.nonzero(p > 0)[0]:
                nxt[prefix + (int(t),)] = out[prefix] * float(p[t])
        out = nxt
    return out


def tv_bound(P: dict, n: int, delta: float = 1e-6) -> float:
    """E[TV] <= 1/2 sum_i sqrt(P_i (1-P_i) / n) (Jensen per outcome), and TV is
    1/n-Lipschitz in each sample, so McDiarmid adds sqrt(ln(1/delta) / (2n))
    for a failure probability below delta."""
    mean = 0.5 * sum(math.sqrt(p * (1 - p) / n) for p in P.values())
    return mean + math.sqrt(math.log(1 / delta) / (2 * n))


def empirical(session, sp_factory, depth, prompt=None, n=N, chunk=CHUNK):
    """The empirical distribution of the first ``depth`` tokens over ``n``
    seeded samples of ``prompt`` (EOS ignored), ``chunk`` rows a batch."""
    prompt = PROMPT if prompt is None else prompt
    counts = Counter()
    for start in range(0, n, chunk):
        reqs = [
            make_request(session, prompt, max_tokens=depth + 1, sampling=sp_factory(start + i), request_id=str(start + i))
            for i in range(chunk)
        ]
        for r in reqs:
            r.stop_ids = frozenset()
        out = {r.id: [] for r in reqs}
        short = len(reqs)  # rows with fewer than `depth` tokens so far
        for ev in generate_stream(session, reqs):
            row = out[ev.request_id]
            had = len(row)
            row.extend(ev.tokens)
            short -= had < depth <= len(row)
            if not short:  # every row has its first `depth` tokens: later rounds cannot change them
                break
        assert all(len(v) >= depth for v in out.values())
        counts.update(tuple(v[:depth]) for v in out.values())
    return {k: v / n for k, v in counts.items()}


def tv(P, Q):
    keys = set(P) | set(Q)
    return 0.5 * sum(abs(P.get(k, 0.0) - Q.get(k, 0.0)) for k in keys)


@pytest.fixture(scope="module")
def sessions():
    good = make_session("e", block_size=BLOCK, batch={"max_batch_size": CHUNK}, sampling={"temperature": 0.7})
    bad = make_session("e", block_size=BLOCK, with_drafter=False, plugins=make_plugin_manager([RandomPlugin()], autoload=False),
                       model={"draft_kind": "random"}, batch={"max_batch_size": CHUNK}, sampling={"temperature": 0.7})
    return {"good": good, "bad": bad}


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("drafter", ["good", "bad"])
def test_first_tokens_distribution_matches_target_only(sessions, temperature, drafter):
    s = sessions[drafter]
    s.reset_stats()
    depth = 2  # t1 from the prefill; t2 accepted or corrected in the first speculative round

    def sp(seed):
        return SamplingParams(temperature=temperature, top_p=0.9, seed=seed)

    P = exact_joint(s.target, sp(0), depth)
    Q = empirical(s, sp, depth)
    bound = tv_bound(P, N)
    assert s.stats.draft_tokens >= N  # every row drafted in its first round
    d = tv(P, Q)
    assert d < bound, f"TV {d:.4f} >= bound {bound:.4f} over {len(P)} outcomes"
    # the test can fail: the same samples against the wrong temperature are far off
    P_wrong = exact_joint(s.target, SamplingParams(temperature=temperature * 0.7, top_p=0.9), depth)
    assert tv(P_wrong, Q) > bound
    if drafter == "good":
        assert s.stats.acceptance_rate > 0.3


def test_seeded_runs_reproduce(sessions):
    s = sessions["good"]
    outs = []
    for _ in range(2):
        reqs = [make_request(s, PROMPT, max_tokens=12, sampling=SamplingParams(temperature=1.0, seed=i), request_id=str(i)) for i in range(4)]
        o = {r.id: [] for r in reqs}
        for ev in generate_stream(s, reqs):
            o[ev.request_id].extend(ev.tokens)
        outs.append(o)
    assert outs[0] == outs[1]
    assert len({tuple(v) for v in outs[0].values()}) > 1  # different seeds differ


def test_seeded_rows_are_batch_block_and_drafter_invariant():
    """A seeded row's tokens depend on its own request only: alone or among
    others, at any block size, with any drafter or none, it gets its
    target-only sampled output (noise keyed by seed and position)."""
    prompts = [PROMPT, PROMPT[:5], list(range(40, 60)), PROMPT[3:11]]
    sps = [SamplingParams(temperature=0.9, top_p=0.95, seed=11), SamplingParams(temperature=0.7, seed=5),
           SamplingParams(temperature=1.2, top_k=20, seed=2**62), SamplingParams()]  # the last one greedy

    def run(session, idx):
        reqs = [make_request(session, prompts[i], max_tokens=18, sampling=sps[i], request_id=str(i)) for i in idx]
        out = {r.id: [] for r in reqs}
        for ev in generate_stream(session, reqs):
            out[ev.request_id].extend(ev.tokens)
        return out

    alone = make_session("e", block_size=1, with_drafter=False)
    want = {str(i): run(alone, [i])[str(i)] for i in range(4)}
    assert len({tuple(v) for v in want.values()}) == 4
    bad = make_plugin_manager([RandomPlugin()], autoload=False)
    for s in (make_session("e", block_size=4), make_session("e", block_size=2),
              make_session("e", block_size=None), make_session("e", block_size=6),
              make_session("e", block_size=3, with_drafter=False, plugins=bad, model={"draft_kind": "random"})):
        got = run(s, [0, 1, 2, 3])
        assert got == want, s.config.draft
        assert run(s, [2, 0]) == {"2": want["2"], "0": want["0"]}
