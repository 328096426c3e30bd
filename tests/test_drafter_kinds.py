"""The model-free ``ngram`` drafter and the classic draft-model kind ``model``."""

import json
import shutil

import pytest
from conftest import FIXTURES, RoundLog, drive_with_late_joiners, make_session, prompt, reference
from conftest import run_requests as run

from mtpflow.drafters.draft_model import DraftModelDrafter, DraftModelError, check_tokenizers
from mtpflow.drafters.ngram import NgramDrafter, _RowIndex
from mtpflow.engine import LoadError, make_request
from mtpflow.plugins import make_plugin_manager

TARGET = FIXTURES / "pair_e" / "target"
#: drafter name -> session overrides of the ``model`` section
KINDS = {
    "ngram": {"draft_kind": "ngram"},
    "model-self": {"draft_kind": "model", "draft_model": str(FIXTURES / "pair_e" / "target")},
    "model-other": {"draft_kind": "model", "draft_model": str(FIXTURES / "pair_d" / "target")},
}


def _prompts():
    base = [prompt("e", n) for n in ("short", "edge", "long")]
    # lengths 40, 10, 23: two past the 16-token sliding window
    return [base[2], base[0], base[2][:7] + base[1]]


PROMPTS = _prompts()
MAX_TOKENS = [24, 17, 20]


_sessions = {}


def session_for(name):
    if name not in _sessions:
        rounds = RoundLog()
        s = make_session("e", block_size=4, with_drafter=False, model=KINDS[name],
                         plugins=make_plugin_manager([rounds], autoload=False), batch={"max_batch_size": 8})
        _sessions[name] = (s, rounds)
    return _sessions[name]


def ref(s, prompt, n):
    return reference(s, prompt, n)


@pytest.mark.parametrize("name", list(KINDS))
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_output_equals_target_only(name, batch):
    s, rounds = session_for(name)
    assert type(s.drafter) is (NgramDrafter if name == "ngram" else DraftModelDrafter)
    s.reset_stats()
    rounds.records.clear()
    for bs in range(2, 7):
        s.block_policy.size = bs
        reqs, out = run(s, PROMPTS[:batch], MAX_TOKENS[:batch], ids=[f"{bs}-{i}" for i in range(batch)])
        for r in reqs:
            assert out[r.id] == ref(s, r.prompt, r.max_tokens), (bs, r.id)
    assert {rec.block_size for rec in rounds.records} >= {2, 3, 4, 5, 6}
    acc = s.stats.as_dict()["acceptance_rate"]
    if name == "model-self":
        assert acc == 1.0  # the target drafting for itself
    elif name == "model-other":
        assert 0.0 < acc  # a different model with the same tokenizer
    if batch == 3:
        assert max(rec.batch_size for rec in rounds.records) == 3
        assert min(rec.batch_size for rec in rounds.records) < 3  # rows left the batch


def test_ngram_accepts_on_a_repetitive_prompt():
    s, rounds = session_for("ngram")
    s.reset_stats()
    s.block_policy.size = 5
    # the fixture target falls into a 26-token loop: a prompt that already holds
    # one turn of it makes the continuation a repetition of the prompt
    prompt = PROMPTS[1] + ref(s, PROMPTS[1], 30)
    reqs, out = run(s, [prompt], [24], ids=["rep"])
    assert out["rep"] == ref(s, prompt, 24)
    stats = s.stats.as_dict()
    assert stats["accepted_tokens"] > 0
    assert stats["acceptance_rate"] > 0.5, stats


def test_ngram_index_lookup():
    idx = _RowIndex(request=None, max_ngram=3)
    # last 3 tokens (7, 8, 9) occurred earlier, followed by 4, 5
    seq = [1, 7, 8, 9, 4, 5, 7, 8, 9]
    assert idx.propose(seq, 3) == [4, 5, 7]
    # incremental: the row grows, the index keeps up
    seq += [4]
    assert idx.propose(seq, 3) == [5, 7, 8]
    # the continuation runs into the end: pad with the last token
    idx2 = _RowIndex(request=None, max_ngram=3)
    assert idx2.propose([3, 1, 2, 1, 2], 4) == [1, 2, 2, 2]
    # no match: the last token repeated
    assert _RowIndex(request=None, max_ngram=3).propose([1, 2, 3], 2) == [3, 3]
    # falls back to shorter n-grams: only the 1-gram (6) occurred before
    assert _RowIndex(request=None, max_ngram=3).propose([6, 2, 5, 6], 2) == [2, 5]


def test_draft_model_rows_join_between_rounds_and_ids_are_reused():
    s2 = make_session("e", block_size=4, with_drafter=False, model=KINDS["model-other"],
                      batch={"policy": "continuous", "max_batch_size": 3})
    reqs = [make_request(s2, p, max_tokens=m, request_id=str(i)) for i, (p, m) in enumerate(zip(PROMPTS * 2, [9, 14, 20, 12, 7, 16]))]
    out = drive_with_late_joiners(s2, reqs[:2], reqs[2:], join_after=2)
    for r in reqs:
        assert out[r.id] == ref(s2, r.prompt, r.max_tokens), r.id
    # the same request ids again, different prompts: new rows, not stale cache rows
    reqs2, out2 = run(s2, [PROMPTS[2], PROMPTS[0]], [10, 10], ids=["0", "1"])
    for r in reqs2:
        assert out2[r.id] == ref(s2, r.prompt, r.max_tokens)


def test_draft_model_with_adaptive_block_sizes():
    # the adaptive policy tries block size 1 (no drafting round) and varying sizes:
    # the drafter must resynchronise after rounds it did not draft in
    rounds = RoundLog()
    s = make_session("e", block_size=3, with_drafter=False, model=KINDS["model-other"],
                     plugins=make_plugin_manager([rounds], autoload=False),
                     draft={"policy": "adaptive", "max_block_size": 5}, batch={"max_batch_size": 3})
    reqs, out = run(s, PROMPTS, [30, 26, 28])
    for r in reqs:
        assert out[r.id] == ref(s, r.prompt, r.max_tokens)
    sizes = [rec.block_size for rec in rounds.records]
    assert any(a == 1 and b > 1 for a, b in zip(sizes, sizes[1:])), sizes  # drafting after a skipped round
    assert len(set(sizes)) >= 3


def test_draft_model_tokenizer_mismatch_is_a_clear_error(tmp_path):
    bad = tmp_path / "draft"
    shutil.copytree(FIXTURES / "pair_d" / "target", bad)
    tok = json.loads((bad / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped
    (bad / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(DraftModelError, match=r"tokenizer mismatch: .*draft/tokenizer.json differs from .*target/tokenizer.json"):
        check_tokenizers(TARGET, bad)
    with pytest.raises(DraftModelError, match="tokenizer mismatch"):
        make_session("e", with_drafter=False, model={"draft_kind": "model", "draft_model": str(bad)})
    # identical tokenizers pass
    check_tokenizers(TARGET, FIXTURES / "pair_d" / "target")


def test_draft_model_vocab_mismatch_is_refused_before_loading(tmp_path):
    bad = tmp_path / "draft"
    bad.mkdir()
    cfg = json.loads((FIXTURES / "pair_d" / "target" / "config.json").read_text())
    cfg["vocab_size"] = 4096
    (bad / "config.json").write_text(json.dumps(cfg))  # no weights: must fail on the config alone
    with pytest.raises(DraftModelError, match=r"vocab_size \(4096\) differs from the target's \(2048\)"):
        make_session("e", with_drafter=False, model={"draft_kind": "model", "draft_model": str(bad)})


def test_draft_model_kind_needs_a_draft_model():
    with pytest.raises((DraftModelError, LoadError), match="needs --draft-model"):
        make_session("e", with_drafter=False, model={"draft_kind": "model"})


def test_kinds_are_registered():
    p = make_plugin_manager(autoload=False)
    assert p.drafters.get("ngram") is NgramDrafter
    assert p.drafters.get("model") is DraftModelDrafter
