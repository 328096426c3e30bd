"""The generic KV-sharing assistant drafter (kind ``assistant``): lossless
greedy speculative decoding on a Gemma 4 and a llama target, save/load."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import FIXTURES
from conftest import prompt as fixture_prompt

from mtpflow.config import load_config
from mtpflow.drafters.mtpflow_assistant.config import IncompatibleDrafter, check_compatible, make_config, target_geometry
from mtpflow.drafters.mtpflow_assistant.drafter import GenericAssistantDrafter, save_drafter
from mtpflow.drafters.mtpflow_assistant.model import GenericAssistantModel
from mtpflow.engine import generate_stream, load_session, make_request, target_only_greedy
from mtpflow.state import SharedKV
from mtpflow.targets.base import FULL, SLIDING, read_config

PAIR_E = FIXTURES / "pair_e" / "target"


def smollm_path():
    from mtpflow.convert.gguf import find_packaged_gguf, load_gguf_cached

    try:
        return load_gguf_cached(find_packaged_gguf("smollm2-135m"))
    except Exception as exc:  # pragma: no cover - the packaged GGUF is not installed
        pytest.skip(f"SmolLM2 GGUF not available: {exc}")


def random_drafter(target_path, out, seed=0, **opts):
    """A randomly initialised drafter with a full-scale post_projection (so
    drafts vary), saved as a folder."""
    cfg = make_config(read_config(target_path), **opts)
    mx.random.seed(seed)
    m = GenericAssistantModel(cfg)
    m.post_projection.weight = mx.random.normal(m.post_projection.weight.shape) * 0.05
    if m.has_draft_vocab:
        V = cfg["vocab_size"]
        m.set_draft_vocab(mx.array(np.sort(np.random.default_rng(seed).choice(V, cfg["draft_vocab_size"], replace=False)).astype(np.int32)))
        assert np.array_equal(np.array(m.draft_vocab), np.array(m.lm_head.draft_vocab))
    save_drafter(m, out)
    return out


def session(target_path, drafter_path, block_size=4):
    ov = {"model": {"model": str(target_path), "draft_model": str(drafter_path)}, "draft": {"block_size": block_size}}
    return load_session(load_config(overrides=ov))


def run(s, prompt, n, block):
    s.block_policy.size = block
    s.reset_stats()
    return [t for ev in generate_stream(s, [make_request(s, prompt, max_tokens=n)]) for t in ev.tokens]


def test_config_geometry_follows_the_target():
    geo = target_geometry(read_config(PAIR_E))
    assert geo["attention"][FULL]["head_dim"] == 64 and geo["attention"][SLIDING]["head_dim"] == 32
    cfg = make_config(read_config(PAIR_E), num_hidden_layers=3)
    assert cfg["layer_types"] == [SLIDING, SLIDING, FULL]
    assert cfg["sliding_window"] == 16 and cfg["backbone_hidden_size"] == 128
    assert cfg["attention"][FULL]["scale"] == 1.0 and cfg["attention"][FULL]["q_norm"]
    bad = dict(cfg, attention={**cfg["attention"], FULL: dict(cfg["attention"][FULL], head_dim=32)})
    with pytest.raises(IncompatibleDrafter, match="head_dim"):
        check_compatible(read_config(PAIR_E), bad)
    with pytest.raises(IncompatibleDrafter, match="backbone_hidden_size"):
        check_compatible(read_config(PAIR_E), dict(cfg, backbone_hidden_size=64))


@pytest.fixture(scope="module")
def pair_e_session(tmp_path_factory):
    d = random_drafter(PAIR_E, tmp_path_factory.mktemp("ge"), num_hidden_layers=3)
    return session(PAIR_E, d), d


def test_auto_detected_kind(pair_e_session):
    s, _ = pair_e_session
    assert s.draft_kind == "assistant" and isinstance(s.drafter, GenericAssistantDrafter)


@pytest.mark.parametrize("block", [2, 3, 4, 5, 6])
def test_gemma4_target_greedy_matches_target_only(pair_e_session, block):
    s, _ = pair_e_session
    prompt = fixture_prompt("e", "long")
    ref = target_only_greedy(s.target, prompt, 40, s.target.eos_ids)
    assert run(s, prompt, 40, block) == ref
    assert s.stats.draft_tokens > 0


def _propose(drafter, target, prompt, n):
    cache = target.make_cache()
    target.set_offsets(cache, mx.array([0], mx.int32))
    h = target.forward(mx.array([prompt[:-1]], mx.int32), cache)
    shared = SharedKV(kv=target.shared_kv(cache), bonus_position=mx.array([len(prompt) - 1], mx.int32),
                      hidden=h[:, -1], last_tokens=mx.array([prompt[-1]], mx.int32))

    class S:
        pass

    sess = S()
    sess.target = target
    return np.array(drafter.propose(sess, None, shared, n).tokens)


def test_save_load_round_trip_gives_identical_drafts(pair_e_session, tmp_path):
    s, d = pair_e_session
    prompt = list(range(3, 40))
    a = _propose(s.drafter, s.target, prompt, 6)
    s2 = session(PAIR_E, save_drafter(s.drafter.model, tmp_path / "again"))
    b = _propose(s2.drafter, s2.target, prompt, 6)
    assert a.shape == (1, 6) and (a == b).all()
    assert len(set(a[0].tolist())) > 1  # a random drafter that actually varies


def test_smollm2_target_greedy_matches_target_only(tmp_path):
    tpath = smollm_path()
    d = random_drafter(tpath, tmp_path / "d", num_hidden_layers=1, intermediate_size=256, draft_vocab_size=1024)
    s = session(tpath, d)
    assert s.draft_kind == "assistant"
    prompt = s.tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    ref = target_only_greedy(s.target, prompt, 10, s.target.eos_ids)
    for block in (2, 3, 4, 5, 6):
        assert run(s, prompt, 10, block) == ref, block
    a = _propose(s.drafter, s.target, prompt, 4)
    s2 = session(tpath, save_drafter(s.drafter.model, tmp_path / "again"))
    assert (a == _propose(s2.drafter, s2.target, prompt, 4)).all()
    assert set(a[0].tolist()) <= set(np.array(s.drafter.model.draft_vocab).tolist())
