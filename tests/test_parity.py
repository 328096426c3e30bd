"""Parity with transformers' reference fixtures (tolerance 1e-4, float32)."""

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES, PROMPTS, make_session

from mtpflow import hookimpl
from mtpflow.engine import generate_stream, make_request
from mtpflow.plugins import make_plugin_manager
from mtpflow.state import KVView, SharedKV

TOL = 1e-4


def maxdiff(a, b):
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


@pytest.fixture(scope="module", params=["e", "d"])
def pair_session(request):
    return request.param, make_session(request.param)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_target_logits_hidden_and_store_kv(pair_session, prompt):
    pair, s = pair_session
    T = np.load(FIXTURES / f"pair_{pair}" / f"target_{prompt}.npz")
    t = s.target
    cache = t.make_cache()
    t.set_offsets(cache, mx.array([0], dtype=mx.int32))
    hidden = t.forward(mx.array(T["input_ids"][None].astype(np.int32)), cache)
    assert maxdiff(t.logits(hidden)[0], T["logits"]) < TOL
    assert maxdiff(hidden[0], T["final_hidden"]) < TOL
    assert maxdiff(t.embed(mx.array(T["input_ids"].astype(np.int32))), T["embeddings"]) < TOL
    kv = t.shared_kv(cache)
    for typ, tag in (("full_attention", "full"), ("sliding_attention", "swa")):
        assert maxdiff(kv[typ].keys[0], T[f"kv_{tag}_k"]) < TOL
        assert maxdiff(kv[typ].values[0], T[f"kv_{tag}_v"]) < TOL
        assert kv[typ].positions[0].tolist() == list(range(len(T["input_ids"])))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_drafter_steps_match_reference(pair_session, prompt):
    pair, s = pair_session
    T = np.load(FIXTURES / f"pair_{pair}" / f"target_{prompt}.npz")
    D = np.load(FIXTURES / f"pair_{pair}" / f"drafter_{prompt}.npz")
    L = len(T["input_ids"])
    kv = {
        typ: KVView(keys=mx.array(T[f"kv_{tag}_k"])[None], values=mx.array(T[f"kv_{tag}_v"])[None], positions=mx.arange(L)[None])
        for typ, tag in (("full_attention", "full"), ("sliding_attention", "swa"))
    }
    shared = SharedKV(
        kv=kv,
        bonus_position=mx.array([int(D["position"])]),
        hidden=mx.array(T["final_hidden"][-1])[None],
        last_tokens=mx.array([int(D["first_token"])]),
    )
    model = s.drafter.model
    kvs, masks = s.drafter.round_inputs(shared)
    for step in range(len(D["tokens"])):
        final, projected = model.step(mx.array(D["inputs_embeds"][step])[None], kvs, masks, shared.bonus_position)
        logits = model.head_logits(final)[0]
        if "selected_token_ids" in D:  # centroid head: compare at the selected ids
            sel = D["selected_token_ids"][step]
            assert set(model.head.select(final)[0].tolist()) == set(sel.tolist())
            assert maxdiff(np.array(logits)[sel], D["logits"][step][sel]) < TOL
        else:
            assert maxdiff(logits, D["logits"][step]) < TOL
        assert maxdiff(final[0], D["final_hidden"][step]) < TOL
        assert maxdiff(projected[0], D["projected"][step]) < TOL
        assert int(model.head_argmax(final)[0]) == int(D["tokens"][step])
    # the whole block, fed back by the drafter itself
    block = s.drafter.propose(s, None, shared, len(D["tokens"]))
    assert block.tokens[0].tolist() == D["tokens"].tolist()


class DraftRecorder:
    """A test plugin that wraps the draft stage and records each block."""

    def __init__(self):
        self.blocks = []
        self.accepted = []

    @hookimpl(wrapper=True)
    def mtpflow_draft_block(self, session, state, shared, block_size):
        block = yield
        self.blocks.append(block.tokens[0].tolist())
        return block

    @hookimpl
    def mtpflow_emit(self, session, record, emitted):
        if record.drafted:
            self.accepted.append(record.accepted[0])


@pytest.mark.parametrize("pair", ["e", "d"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_generation_trace_matches_clean_reference(pair, prompt):
    G = json.loads((FIXTURES / f"pair_{pair}" / f"generate_{prompt}.json").read_text())
    rec = DraftRecorder()
    s = make_session(pair, block_size=G["num_assistant_tokens"] + 1, plugins=make_plugin_manager([rec]))
    req = make_request(s, G["prompt_ids"], max_tokens=G["max_new_tokens"])
    req.stop_ids = frozenset()  # the fixtures disable EOS
    out = [t for ev in generate_stream(s, [req]) for t in ev.tokens]
    ref = G["reimpl_clean"]
    assert G["prompt_ids"] + out == G["plain_greedy"] == ref["tokens"]
    rounds = [r for r in ref["rounds"] if r["drafted"]]
    assert rec.blocks == [r["drafted"] for r in rounds]
    assert rec.accepted == [r["accepted"] for r in rounds]
    assert s.stats.accepted_tokens == sum(r["accepted"] for r in rounds)
