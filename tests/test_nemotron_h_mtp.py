"""The native-MTP kind on Nemotron-H targets: the checkpoint's ``mtp.layers.*`` module."""

import json

import pytest
from conftest import drive_with_late_joiners, quiet_log, run_requests
from tiny_nemotron import build

from mtpflow.config import load_config
from mtpflow.engine import generate_stream, load_session, make_request, target_only_greedy
from mtpflow.errors import IncompatibleDrafter
from mtpflow.state import SamplingParams

PROMPTS = [[2, 17, 300, 41, 999, 5, 77, 1200, 64, 8, 33], [2, 501, 502], [2, 9, 9, 9, 1500, 23, 7]]
MAX = [20, 14, 17]
#: a target whose next token leans on the current one, and a head that mostly
#: passes the embedding through: a part of the drafts is accepted
PREDICTABLE = {"residual": 0.1, "mtp_copy": 0.95}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("nemotron_h_mtp")
    return {"mtp": build(root, seed=0, **PREDICTABLE),
            "stripped": build(root, seed=0, head_weights=False, name="stripped", **PREDICTABLE)}


def session(path, block=3, **model):
    ov = {"model": {"model": str(path), **model}, "draft": {"block_size": block, "policy": "fixed"}}
    return load_session(load_config(overrides=ov), log=quiet_log())


def refs(s, prompts, maxes):
    return [target_only_greedy(s.target, p, m, s.target.eos_ids) for p, m in zip(prompts, maxes)]


@pytest.mark.parametrize("block", [2, 4])
def test_greedy_through_the_native_head_equals_target_only(ckpts, block):
    """Batch 1 and a ragged batch: each row equals its own target-only output."""
    s = session(ckpts["mtp"], block)  # detected: the checkpoint carries mtp.layers.*
    assert s.draft_kind == "native_mtp" and s.drafter.family.__name__ == "NemotronHLayout"
    want = refs(s, PROMPTS, MAX)
    _, out = run_requests(s, PROMPTS[:1], MAX[:1])
    assert out["0"] == want[0]
    _, out = run_requests(s, PROMPTS, MAX)
    assert [out[str(i)] for i in range(3)] == want
    st = s.stats.as_dict()
    assert 0 < st["accepted_tokens"] < st["draft_tokens"]  # accepted and rejected drafts: the Mamba rollback ran


def test_rows_joining_through_the_native_head(ckpts):
    s = load_session(load_config(overrides={"model": {"model": str(ckpts["mtp"])},
                                            "draft": {"block_size": 3, "policy": "fixed"},
                                            "batch": {"policy": "continuous", "max_batch_size": 8}}), log=quiet_log())
    prompts = PROMPTS + [[2, 44, 45, 46, 47, 48], [2, 1000]]
    maxes = MAX + [12, 15]
    reqs = [make_request(s, p, max_tokens=m, request_id=str(i)) for i, (p, m) in enumerate(zip(prompts, maxes))]
    out = drive_with_late_joiners(s, reqs[:3], reqs[3:], join_after=2)
    assert [out[str(i)] for i in range(5)] == refs(s, prompts, maxes)


def test_seeded_sampling_through_the_native_head_equals_target_only(ckpts):
    """At T > 0 every seeded row gets exactly its target-only sample (the
    position-keyed sampler: the exact-distribution check of the hybrid tests)."""
    sps = [SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=1.0, top_p=0.9, seed=8),
           SamplingParams(temperature=0.6, top_k=30, seed=5)]

    def run(s):
        reqs = [make_request(s, p, max_tokens=12, sampling=sp, request_id=str(i)) for i, (p, sp) in enumerate(zip(PROMPTS, sps))]
        out = {r.id: [] for r in reqs}
        for ev in generate_stream(s, reqs):
            out[ev.request_id].extend(ev.tokens)
        return out

    want = run(session(ckpts["mtp"], draft_kind="none"))
    s = session(ckpts["mtp"], 4)
    assert s.draft_kind == "native_mtp"
    assert run(s) == want
    assert s.stats.as_dict()["accepted_tokens"] > 0


def test_a_stripped_head_is_a_one_line_error_and_no_head_runs_target_only(ckpts):
    with pytest.raises(IncompatibleDrafter, match=r"mtp\.layers\.0\.enorm\..*converter") as e:
        session(ckpts["stripped"], draft_kind="native_mtp")
    assert "\n" not in str(e.value)
    assert session(ckpts["stripped"]).drafter is None  # nothing asked: target-only


@pytest.mark.parametrize("field,value,match", [("mtp_hybrid_override_pattern", "E", "one attention block"),
                                               ("mtp_hybrid_override_pattern", "*M", "one attention block"),
                                               ("num_nextn_predict_layers", 2, "one MTP module")])
def test_an_unsupported_head_layout_is_a_one_line_error(ckpts, tmp_path, field, value, match):
    src = ckpts["mtp"]
    for f in src.iterdir():
        (tmp_path / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text()) | {field: value}
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(IncompatibleDrafter, match=match) as e:
        session(tmp_path, draft_kind="native_mtp")
    assert "\n" not in str(e.value)
