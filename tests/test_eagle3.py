"""EAGLE-3 drafters (``eagle3``): Speculators and SpecForge checkpoints made by
speculators itself (tests/fixtures/eagle3, tools/make_eagle3_fixtures.py) run
with speculators' numbers, losslessly, in every batching mode."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import drive_with_late_joiners, run_requests

from mtpflow import hookimpl
from mtpflow.config import load_config
from mtpflow.drafters.eagle3.config import check_compatible
from mtpflow.engine import LoadError, load_session, make_request, target_only_greedy
from mtpflow.errors import IncompatibleDrafter
from mtpflow.plugins import make_plugin_manager
from mtpflow.state import AcceptResult, BatchState, RowState
from mtpflow.targets.cache import SlotKVCache

FIX = Path(__file__).parent / "fixtures" / "eagle3"
TARGET = FIX / "target"
DRAFTERS = ("drafter_default", "drafter_train", "drafter_specforge")
PROMPTS = ("short", "mid", "long")
TOL = 1e-4


def ref_of(drafter: str, prompt: str):
    own = "drafter_default" if drafter == "drafter_specforge" else drafter  # same weights, no npz of its own
    return np.load(FIX / own / f"ref_{prompt}.npz")


_sessions: dict = {}


def session(drafter: str, block: int = 4, **over):
    key = (drafter, block, json.dumps(over, sort_keys=True))
    if key not in _sessions:
        ov = {"model": {"model": str(TARGET), "draft_model": str(FIX / drafter)}, "draft": {"block_size": block}}
        for k, v in over.items():
            ov.setdefault(k, {}).update(v)
        _sessions[key] = load_session(load_config(overrides=ov))
    return _sessions[key]


def fresh_cache(drafter):
    w = drafter.window
    return SlotKVCache(window=w, retain=None if w is None else w + 32)


# --------------------------------------------------------------------------------------
# numerically speculators
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_configs_load_as_speculators_reads_them(drafter):
    d = session(drafter).drafter
    assert session(drafter).draft_kind == "eagle3"
    want = (1, 3, 6) if drafter == "drafter_train" else (2, 4, 5)  # SpecForge's [1, 3, 4] is one layer earlier
    assert d.cfg.aux_layer_ids == want and d.needs == {f"layer:{i}" for i in want}
    assert (d.cfg.norm_before_residual, d.cfg.norm_before_fc, d.cfg.norm_output) == ((True,) * 3 if drafter == "drafter_train" else (False,) * 3)
    assert d.window == (16 if drafter == "drafter_train" else None)
    assert ("embed_tokens" in d.model) == (drafter != "drafter_specforge")  # SpecForge exports use the target's


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_first_and_chained_steps_equal_speculators(drafter, prompt):
    d = session(drafter).drafter
    m, ref = d.model, ref_of(drafter, prompt)
    g = mx.array(ref["input_hidden_states"])[None]
    toks = mx.array(ref["input_ids"], dtype=mx.int32)[None]
    pos = mx.array(ref["position_ids"], dtype=mx.int32)[None]
    # the target's own aux states, through mtpflow's layer taps, are speculators' inputs
    ids = ref["prompt_ids"].tolist() + [int(ref["target_next_id"])]
    _, _, taps = d.target.prefill([ids[:-1]], taps=d.cfg.aux_layer_ids)
    mine = np.array(mx.concatenate([taps[i] for i in d.cfg.aux_layer_ids], axis=-1)[0])
    assert np.abs(mine - ref["input_hidden_states"]).max() < TOL
    # step 0 at every row (the context pass), then each row's chain, teacher-forced like the TTT forward
    out = d._context(fresh_cache(d), toks, g, pos)
    logits, _ = m.head(out)
    assert np.abs(np.array(logits[0]) - ref["step_logits"][0]).max() < TOL
    ids0 = np.array(mx.argmax(logits[0], axis=-1))
    assert (ids0 == ref["step_draft_ids"][0]).all()
    assert (np.array(m.to_target(mx.array(ids0))) == ref["step_draft_target_ids"][0]).all()
    T = toks.shape[1]
    for r in sorted({0, T // 2, T - 2, T - 1}):
        c = fresh_cache(d)
        o = d._context(c, toks[:, : r + 1], g[:, : r + 1], pos[:, : r + 1])
        lg, h = m.head(o[:, -1])
        anchor = pos[:, r : r + 1]
        for j in range(1, ref["step_logits"].shape[0]):
            if not ref["step_valid"][j, r]:
                break
            p = anchor + j
            q, k, v, res = m.layer.project(d.embed(mx.array([[int(ref["step_input_ids"][j, r])]], dtype=mx.int32)), h[:, None], p)
            keys, values = d._append(c, k, v, p)
            lg, h = m.head(m.layer.finish(q, keys, values, d._mask(c.positions[:, : c.idx], p, anchor), res)[:, 0])
            assert np.abs(np.array(lg[0]) - ref["step_logits"][j, r]).max() < TOL, (r, j)
            assert int(mx.argmax(lg[0])) == int(ref["step_draft_ids"][j, r])


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_the_engines_first_block_is_the_inference_chain(drafter):
    """After prefill, one propose drafts what chained inference drafts (each step
    fed its own previous draft), ``selffed_*`` in the fixtures."""
    s = session(drafter, block=4)
    ref = ref_of(drafter, "long")
    prompt = ref["prompt_ids"].tolist()
    req = make_request(s, prompt, max_tokens=8)
    state = s.hook.mtpflow_prefill(session=s, requests=[req])
    assert int(state.last_tokens[0]) == int(ref["target_next_id"])
    shared = s.hook.mtpflow_bind_shared_kv(session=s, state=state)
    block = s.drafter.propose(s, state, shared, 3)
    assert np.array(block.tokens[0]).tolist() == ref["selffed_draft_target_ids"].tolist()
    s.drafter.reset()


# --------------------------------------------------------------------------------------
# lossless, in every batching mode
# --------------------------------------------------------------------------------------
def _prompts():
    return [ref_of("drafter_default", p)["prompt_ids"].tolist() for p in ("long", "short", "mid")]


@pytest.mark.parametrize("block", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("drafter", ["drafter_default", "drafter_train"])
def test_greedy_equals_target_only_at_every_block_size_and_in_ragged_batches(drafter, block):
    s = session(drafter, block=block)
    reqs, out = run_requests(s, _prompts(), [24, 13, 19])
    for r in reqs:
        assert out[r.id] == target_only_greedy(s.target, r.prompt, r.max_tokens, s.target.eos_ids), (block, r.id)
    if block > 1:
        assert s.stats.draft_tokens > 0


def test_continuous_batching_with_late_joiners():
    s = session("drafter_train", block=4, batch={"policy": "continuous", "max_batch_size": 2})
    ps = _prompts()
    first = [make_request(s, ps[0], max_tokens=20, request_id="a"), make_request(s, ps[1], max_tokens=6, request_id="b")]
    late = [make_request(s, ps[2], max_tokens=15, request_id="c"), make_request(s, ps[1][:4], max_tokens=9, request_id="d")]
    out = drive_with_late_joiners(s, first, late, join_after=2, max_live=2)
    for r in first + late:
        assert out[r.id] == target_only_greedy(s.target, r.prompt, r.max_tokens, s.target.eos_ids), r.id


class RaggedAccept:
    """A sampler that accepts a pseudo-random number of drafts per row (the
    bonus is the target's argmax): ragged acceptance without a trained drafter."""

    def __init__(self, config, processors=()):
        self.n = 0

    def prepare(self, rows, vocab_size):
        pass

    def first(self, logits, state):
        return mx.argmax(logits, axis=-1).astype(mx.int32)

    def accept(self, logits, draft, state):
        self.n += 1
        sel = mx.argmax(logits, axis=-1).astype(mx.int32)
        k = draft.n_draft
        counts = mx.random.randint(0, k + 1, (state.size,), key=mx.random.key(self.n)).astype(mx.int32)
        pos = mx.arange(k + 1)[None]
        d = mx.concatenate([draft.tokens.astype(mx.int32), sel[:, -1:]], axis=1)
        return AcceptResult(counts=counts, tokens=mx.where(pos < counts[:, None], d, mx.take_along_axis(sel, counts[:, None], axis=1)))


class RaggedPlugin:
    @hookimpl
    def mtpflow_register_samplers(self, register):
        register("ragged", RaggedAccept)


def test_drafter_cache_after_ragged_rounds_equals_a_fresh_prefill():
    """Commit keeps exactly the accepted context: after rounds of ragged
    acceptance the next block's drafts and logits equal those of a drafter
    that prefilled the whole sequence at once."""
    pm = make_plugin_manager([RaggedPlugin()], autoload=False)
    cfg = load_config(overrides={"model": {"model": str(TARGET), "draft_model": str(FIX / "drafter_train")},
                                 "draft": {"block_size": 4}, "sampling": {"sampler": "ragged"}})
    s = load_session(cfg, plugins=pm)
    from mtpflow.engine import Batcher

    b = Batcher(s)
    ps = _prompts()
    b.add([make_request(s, p, max_tokens=40, request_id=str(i)) for i, p in enumerate(ps)])
    for _ in range(7):
        b.step()
    st = b.state
    assert max(s.stats.accepted_per_position) > 0 and s.stats.accepted_tokens < s.stats.draft_tokens
    shared = s.hook.mtpflow_bind_shared_kv(session=s, state=st)
    assert_next_block_as_after_a_fresh_prefill(s, st, lambda: load_session(cfg, plugins=pm), shared)


def assert_next_block_as_after_a_fresh_prefill(s, st, fresh_session, shared=None):
    """The drafter's next chain of 3 (drafts and first logits) for every row of
    ``st`` equals that of a ``fresh_session()`` drafter prefilled with the row's
    whole sequence: its cache holds exactly the accepted context."""
    live = s.drafter.propose(s, st, shared, 3)
    live_logits, _ = s.drafter.model.head(s.drafter.last_out)
    for i, row in enumerate(st.rows):
        seq = list(row.request.prompt) + list(row.generated)
        fresh = fresh_session()
        cache, hid, taps = fresh.target.prefill([seq[:-1]], taps=fresh.tap_layers)
        L = len(seq) - 1
        one = BatchState(rows=[RowState(request=row.request, position=L)], cache=cache, last_tokens=mx.array([seq[-1]], dtype=mx.int32),
                         hidden=hid, positions=mx.array([L], dtype=mx.int32), fwd_tokens=mx.array([seq[:-1]], dtype=mx.int32),
                         fwd_positions=mx.arange(L, dtype=mx.int32)[None], taps=taps)
        fresh.drafter.prefilled(fresh, one)
        block = fresh.drafter.propose(fresh, one, None, 3)
        fresh_logits, _ = fresh.drafter.model.head(fresh.drafter.last_out)
        assert np.abs(np.array(fresh_logits[0]) - np.array(live_logits[i])).max() < 1e-3, i
        assert np.array(block.tokens[0]).tolist() == np.array(live.tokens[i]).tolist(), i


def test_sampling_is_lossless_with_an_eagle3_drafter():
    from test_sampling_engine import empirical, exact_joint, tv, tv_bound

    from mtpflow.state import SamplingParams

    s = session("drafter_default", block=2, batch={"max_batch_size": 4000}, sampling={"temperature": 0.8})
    prompt = _prompts()[1]
    P = exact_joint(s.target, SamplingParams(temperature=0.8, top_p=0.9, seed=0), 2, prompt)
    Q = empirical(s, lambda seed: SamplingParams(temperature=0.8, top_p=0.9, seed=seed), 2, prompt, n=8000, chunk=4000)
    assert tv(P, Q) < tv_bound(P, 8000)


# --------------------------------------------------------------------------------------
# bad input: one line, before any weight is read
# --------------------------------------------------------------------------------------
def _edited(tmp_path, src="drafter_default", edit=None, shapes=None):
    dst = tmp_path / "d"
    shutil.copytree(FIX / src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    if edit:
        edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(speculators_model_type="mtp"), "algorithm 'mtp'"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 4, 9]), "reads target layer 9 but the target has 8 layers"),
    (lambda c: c.update(target_hidden_size=128), "target_hidden_size is 128 in the drafter but hidden_size is 64"),
    (lambda c: c.update(draft_vocab_size=500), r"tensor d2t has shape \[512\], expected \[500\]"),
    (lambda c: c["transformer_layer_config"].update(vocab_size=4096), "vocab_size is 4096 in the drafter but 2048"),
    (lambda c: c["speculators_config"]["verifier"].update(architectures=["Qwen3ForCausalLM"]), "trained for a Qwen3ForCausalLM verifier"),
])
def test_bad_checkpoints_fail_in_one_line_before_weights_load(tmp_path, edit, message):
    d = _edited(tmp_path, edit=edit)
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:64 * 1024])  # header intact, tensors cut
    cfg = load_config(overrides={"model": {"model": str(TARGET), "draft_model": str(d)}})
    with pytest.raises((IncompatibleDrafter, LoadError)) as ei:
        load_session(cfg)
    assert len(str(ei.value).splitlines()) == 1
    assert __import__("re").search(message, str(ei.value)), str(ei.value)


def test_check_reads_only_configs_and_the_header(tmp_path):
    d = _edited(tmp_path)
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:64 * 1024])
    tcfg = json.loads((TARGET / "config.json").read_text())
    cfg = check_compatible(tcfg, json.loads((d / "config.json").read_text()), d)
    assert cfg.aux_layer_ids == (2, 4, 5)


@pytest.mark.parametrize("window", [None, 5])
def test_ttt_attention_equals_the_masked_attention(window):
    """A training-time-test step's attention (``Attention.attend_ttt``: the step-0 keys under the
    causal mask plus one own key per later step) equals Speculators' form, attention over every
    step's keys with the ``[causal, diag x j]`` mask -- values and gradients."""
    from types import SimpleNamespace

    from mtpflow.drafters.eagle3.model import Attention

    cfg = SimpleNamespace(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=16, qk_norm=False,
                          rms_norm_eps=1e-6, rope={"rope_theta": 10000.0}, max_position_embeddings=512)
    attn = Attention(cfg)
    B, T = 2, 12
    t = mx.arange(T)
    causal = t[None, :] <= t[:, None]
    if window is not None:
        causal = causal & (t[None, :] > t[:, None] - window)
    diag = t[None, :] == t[:, None]
    rnd = lambda i, h: mx.random.normal((B, h, T, 16), key=mx.random.key(i))  # noqa: E731
    for j in range(4):
        q = rnd(100 + j, 6)
        keys = [rnd(i, 2) for i in range(j + 1)]
        values = [rnd(50 + i, 2) for i in range(j + 1)]
        mask = mx.concatenate([causal] + [diag] * j, axis=1)[None, None]

        def dense(q, keys, values):
            return attn.attend(q, mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2), mask)

        def sparse(q, keys, values):
            return attn.attend_ttt(q, keys, values, causal)

        want, got = dense(q, keys, values), sparse(q, keys, values)
        assert got.shape == want.shape == (B, T, 48)
        assert mx.abs(got - want).max().item() < 1e-5, j
        w = mx.random.normal(want.shape, key=mx.random.key(7))
        gw = mx.grad(lambda *a: (dense(*a) * w).sum(), argnums=(0, 1, 2))(q, keys, values)
        gg = mx.grad(lambda *a: (sparse(*a) * w).sum(), argnums=(0, 1, 2))(q, keys, values)
        for a, b in zip(tree_flat(gw), tree_flat(gg)):
            assert mx.abs(a - b).max().item() < 1e-5, j


def tree_flat(x):
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(x)]
